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

# ---- hybrid recurrent + attention presets (gguf_tools/layouts/hybrid.py) -----------------------------------
# Qwen3.5 / Qwen3-Next: SSM fields in llama.cpp's meaning (conversion/qwen.py): ssm_state = linear_key_head_dim,
# ssm_groups = linear_num_key_heads, ssm_dt_rank = linear_num_value_heads; every 4th layer is full attention.

_QWEN35_9B: dict[str, Any] = {
    "arch": "qwen35", "name": "Qwen3.5-9B",
    "n_layers": 32, "n_embd": 4096, "n_head": 16, "n_head_kv": 4, "head_dim": 256,
    "n_ff": 12288, "vocab_size": 248320, "context_length": 262144,
    "rope_freq_base": 10_000_000.0, "norm_eps": 1e-6, "tied_embeddings": False,
    "full_attention_interval": 4, "ssm_conv_kernel": 4, "ssm_state": 128, "ssm_groups": 16, "ssm_dt_rank": 32,
    "rope_sections": [11, 11, 10, 0],
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "Qwen/Qwen3.5-9B config.json (text_config); no MTP block (convert --no-mtp)",
}

_QWEN35_27B: dict[str, Any] = {
    **_QWEN35_9B, "name": "Qwen3.5-27B",
    "n_layers": 64, "n_embd": 5120, "n_head": 24, "n_head_kv": 4, "head_dim": 256, "n_ff": 17408,
    "ssm_groups": 16, "ssm_dt_rank": 48,
    "source": "Qwen/Qwen3.5-27B config.json (text_config); no MTP block (convert --no-mtp)",
}

_QWEN35_35B_A3B: dict[str, Any] = {
    "arch": "qwen35moe", "name": "Qwen3.5-35B-A3B",
    "n_layers": 40, "n_embd": 2048, "n_head": 16, "n_head_kv": 2, "head_dim": 256,
    "n_expert": 256, "n_expert_used": 8, "expert_ff": 512, "shared_expert_ff": 512,
    "vocab_size": 248320, "context_length": 262144,
    "rope_freq_base": 10_000_000.0, "norm_eps": 1e-6, "tied_embeddings": False,
    "full_attention_interval": 4, "ssm_conv_kernel": 4, "ssm_state": 128, "ssm_groups": 16, "ssm_dt_rank": 32,
    "rope_sections": [11, 11, 10, 0],
    "type": "q4_k_m", "types": ["q4_k_m", "q3_k_m", "q8_0", "bf16"],
    "source": "Qwen/Qwen3.5-35B-A3B config.json (text_config); no MTP block (convert --no-mtp)",
}

_QWEN3_NEXT_80B: dict[str, Any] = {
    "arch": "qwen3next", "name": "Qwen3-Next-80B-A3B",
    "n_layers": 48, "n_embd": 2048, "n_head": 16, "n_head_kv": 2, "head_dim": 256, "n_ff": 5120,
    "n_expert": 512, "n_expert_used": 10, "expert_ff": 512, "shared_expert_ff": 512,
    "vocab_size": 151936, "context_length": 262144,
    "rope_freq_base": 10_000_000.0, "norm_eps": 1e-6, "tied_embeddings": False,
    "full_attention_interval": 4, "ssm_conv_kernel": 4, "ssm_state": 128, "ssm_groups": 16, "ssm_dt_rank": 32,
    "type": "q4_k_m", "types": ["q4_k_m", "q2_k", "q8_0", "bf16"],
    "source": "Qwen/Qwen3-Next-80B-A3B-Instruct config.json; no MTP block (convert --no-mtp)",
}

# Granite 4.0-H: attention at layers 5, 15, 25, 35 (layer_types), the rest Mamba-2 (d_head 64); no RoPE, so the
# converter writes context_length 2**20 (conversion/granite.py).
_GRANITE4_PATTERN = "".join("*" if i % 10 == 5 else "M" for i in range(40))

_GRANITE4_H_SMALL: dict[str, Any] = {
    "arch": "granitehybrid", "name": "Granite-4.0-H-Small",
    "n_layers": 40, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "head_dim": 128,
    "n_expert": 72, "n_expert_used": 10, "expert_ff": 768, "shared_expert_ff": 1536,
    "vocab_size": 100352, "context_length": 1 << 20, "norm_eps": 1e-5, "tied_embeddings": True,
    "layer_pattern": _GRANITE4_PATTERN,
    "ssm_conv_kernel": 4, "ssm_inner": 8192, "ssm_state": 128, "ssm_groups": 1, "ssm_dt_rank": 128,
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "ibm-granite/granite-4.0-h-small config.json (mamba_n_heads 128, mamba_d_head 64, mamba_n_groups 1)",
}

_GRANITE4_H_TINY: dict[str, Any] = {
    **_GRANITE4_H_SMALL, "name": "Granite-4.0-H-Tiny",
    "n_embd": 1536, "n_head": 12, "n_head_kv": 4, "head_dim": 128,
    "n_expert": 64, "n_expert_used": 6, "expert_ff": 512, "shared_expert_ff": 1024,
    "ssm_inner": 3072, "ssm_dt_rank": 48,
    "source": "ibm-granite/granite-4.0-h-tiny config.json (mamba_n_heads 48, mamba_d_head 64, mamba_n_groups 1)",
}

# Nemotron-H: M Mamba-2, * attention, - squared-ReLU MLP (hybrid_override_pattern); Mamba heads 128 x 80.
_NEMOTRON_NANO_9B_V2: dict[str, Any] = {
    "arch": "nemotron_h", "name": "NVIDIA-Nemotron-Nano-9B-v2",
    "n_layers": 56, "n_embd": 4480, "n_head": 40, "n_head_kv": 8, "head_dim": 128, "n_ff": 15680,
    "vocab_size": 131072, "context_length": 131072, "norm_eps": 1e-5, "tied_embeddings": False,
    "layer_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "ssm_conv_kernel": 4, "ssm_inner": 10240, "ssm_state": 128, "ssm_groups": 8, "ssm_dt_rank": 128,
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "nvidia/NVIDIA-Nemotron-Nano-9B-v2 config.json",
}

# LFM2: short-conv layers (conv_L_cache 3) and attention at full_attn_idxs; FFN 12288 auto-adjusted to 8192.
_LFM2_1_2B: dict[str, Any] = {
    "arch": "lfm2", "name": "LFM2-1.2B",
    "n_layers": 16, "n_embd": 2048, "n_head": 32, "n_head_kv": 8, "head_dim": 64, "n_ff": 8192,
    "vocab_size": 65536, "context_length": 128000, "rope_freq_base": 1_000_000.0, "norm_eps": 1e-5,
    "tied_embeddings": True,
    "layer_pattern": "".join("*" if i in (2, 5, 8, 10, 12, 14) else "M" for i in range(16)),
    "ssm_conv_kernel": 3,
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "LiquidAI/LFM2-1.2B config.json",
}

# Pure Mamba-2 (mamba_ssm defaults: d_state 128, head dim 64, n_groups 1, d_conv 4, expand 2); the converter pads
# the vocabulary to a multiple of 16 (conversion/mamba.py) and writes head_count 0, so n_head here is a placeholder.
_MAMBA2_2_7B: dict[str, Any] = {
    "arch": "mamba2", "name": "mamba2-2.7b",
    "n_layers": 64, "n_embd": 2560, "n_head": 1, "vocab_size": 50288, "context_length": 1 << 20,
    "norm_eps": 1e-5, "tied_embeddings": True,
    "ssm_conv_kernel": 4, "ssm_inner": 5120, "ssm_state": 128, "ssm_groups": 1, "ssm_dt_rank": 80,
    "type": "q8_0", "types": ["q8_0", "q4_k_m", "bf16"],
    "source": "state-spaces/mamba2-2.7b config.json (d_model 2560, n_layer 64, vocab 50277 padded to 50288)",
}

HYBRID_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-9b": _QWEN35_9B,
    "qwen3.5-27b": _QWEN35_27B,
    "qwen3.5-35b-a3b": _QWEN35_35B_A3B,
    "qwen3-next-80b-a3b": _QWEN3_NEXT_80B,
    "granite-4.0-h-small": _GRANITE4_H_SMALL,
    "granite-4.0-h-tiny": _GRANITE4_H_TINY,
    "nemotron-nano-9b-v2": _NEMOTRON_NANO_9B_V2,
    "lfm2-1.2b": _LFM2_1_2B,
    "mamba2-2.7b": _MAMBA2_2_7B,
}
# ---- end of hybrid presets ------------------------------------------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": _QWEN3_8B,
    "qwen3-235b-a22b": _QWEN3_235B,
    "qwen3-235b-a22b-ud-q2_k_xl": _QWEN3_235B_UD,
    "llama-3.1-8b": _LLAMA31_8B,
    "smollm2-135m": _SMOLLM2_135M,
    # ---- hybrid recurrent + attention ----
    **HYBRID_PRESETS,
    # ---- end of hybrid ----
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
