"""Model presets for skeleton GGUFs: the architecture facts of models people run.

Each preset is a plain dict in the same schema a ``--spec`` file uses (see
``gguf_tools.skeleton.SPEC_FIELDS``).  Numbers come from each model's published
``config.json``; ``type`` is the default file type and ``types`` the ones the
preset is meant for (any ftype in ``gguf_tools.mix.FTYPES`` works).
"""

from __future__ import annotations

from typing import Any

_QWEN3_8B: dict[str, Any] = {
    "arch": "qwen3", "name": "Qwen3-8B",
    "n_layers": 36, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "head_dim": 128,
    "n_ff": 12288, "vocab_size": 151936, "context_length": 40960,
    "rope_freq_base": 1_000_000.0, "norm_eps": 1e-6, "tied_embeddings": False,
    "type": "bf16", "types": ["bf16", "q8_0", "q4_0", "q2_k"],
    "source": "Qwen/Qwen3-8B config.json",
}

_QWEN3_235B: dict[str, Any] = {
    "arch": "qwen3moe", "name": "Qwen3-235B-A22B",
    "n_layers": 94, "n_embd": 4096, "n_head": 64, "n_head_kv": 4, "head_dim": 128,
    "n_ff": 12288, "n_expert": 128, "n_expert_used": 8, "expert_ff": 1536,
    "vocab_size": 151936, "context_length": 40960,
    "rope_freq_base": 1_000_000.0, "norm_eps": 1e-6, "tied_embeddings": False,
    "type": "q2_k", "types": ["q2_k", "q4_k_m", "q8_0", "bf16"],
    "source": "Qwen/Qwen3-235B-A22B config.json",
}

# Unsloth's UD-Q2_K_XL is a hand-tuned mix whose per-tensor table is not published as
# text; this approximates it: llama.cpp's Q2_K mix with the embedding and attention raised
# to Q4_K (V to Q6_K) and the expert FFNs of the first layers raised one step, with the
# number of raised layers chosen so the file comes to the published ≈81.97 GiB.
_QWEN3_235B_UD = {
    **_QWEN3_235B,
    "name": "Qwen3-235B-A22B (UD-Q2_K_XL approximation)",
    "type": "q2_k", "types": ["q2_k"],
    "overrides": [
        [r"^token_embd\.weight$", "q4_k"],
        [r"\.attn_(q|k|output)\.weight$", "q4_k"],
        [r"\.attn_v\.weight$", "q6_k"],
        [r"^blk\.[0-4]\.ffn_(gate|up)_exps\.weight$", "q3_k"],
        [r"^blk\.0\.ffn_down_exps\.weight$", "q4_k"],
    ],
    "source": "Qwen/Qwen3-235B-A22B config.json; mix approximated (unsloth UD-Q2_K_XL ≈ 81.97 GiB)",
}

_LLAMA31_8B: dict[str, Any] = {
    "arch": "llama", "name": "Llama-3.1-8B",
    "n_layers": 32, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "head_dim": 128,
    "n_ff": 14336, "vocab_size": 128256, "context_length": 131072,
    "rope_freq_base": 500_000.0, "norm_eps": 1e-5, "tied_embeddings": False, "rope_freqs": True,
    "type": "bf16", "types": ["bf16", "q8_0", "q4_0", "q4_k_m"],
    "source": "meta-llama/Llama-3.1-8B config.json (llama3 rope scaling -> rope_freqs tensor)",
}

_SMOLLM2_135M: dict[str, Any] = {
    "arch": "llama", "name": "SmolLM2-135M",
    "n_layers": 30, "n_embd": 576, "n_head": 9, "n_head_kv": 3, "head_dim": 64,
    "n_ff": 1536, "vocab_size": 49152, "context_length": 8192,
    "rope_freq_base": 100_000.0, "norm_eps": 1e-5, "tied_embeddings": True,
    "type": "q4_1", "types": ["q4_1", "q8_0", "bf16"],
    "source": "HuggingFaceTB/SmolLM2-135M config.json (the embedded default model is its Q4_1)",
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": _QWEN3_8B,
    "qwen3-235b-a22b": _QWEN3_235B,
    "qwen3-235b-a22b-ud-q2_k_xl": _QWEN3_235B_UD,
    "llama-3.1-8b": _LLAMA31_8B,
    "smollm2-135m": _SMOLLM2_135M,
}


def get_preset(name: str) -> dict[str, Any]:
    """A copy of one preset; ValueError naming the known presets."""
    key = str(name).strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    spec = dict(PRESETS[key])
    spec["preset"] = key
    return spec


def list_presets() -> list[tuple[str, str, str, list[str]]]:
    """(preset, model name, default type, suggested types) for each preset."""
    return [(key, p["name"], p["type"], list(p["types"])) for key, p in PRESETS.items()]
