"""What the torch backend can run, checked before anything is loaded.

Imports neither torch nor llama_cpp, so planners can ask the same question.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as T

from localinfer.errors import UnsupportedModelError, UsageError
from localinfer.model.spec import ModelSpec

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
SUPPORTED_WEIGHT_TYPES = (
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
)
SUPPORTED_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
SUPPORTED_ROPE_SCALING = (None, "linear", "yarn")
_FALLBACK = "use --backend llama.cpp, which runs every GGUF architecture and quant type"

# Per layer: (tensor, required); biases exist only in qwen2, q/k norms only in qwen3.
LAYER_TENSORS = {
    "attn_norm": True, "attn_q": True, "attn_k": True, "attn_v": True, "attn_output": True,
    "ffn_norm": True, "ffn_gate": True, "ffn_up": True, "ffn_down": True,
    "attn_q.bias": False, "attn_k.bias": False, "attn_v.bias": False,
    "attn_q_norm": False, "attn_k_norm": False,
}


def _names(types) -> str:
    return ", ".join(t.name if isinstance(t, T) else str(t) for t in types)


def check_model(spec: ModelSpec) -> None:
    """Raise UnsupportedModelError unless this backend can run spec exactly."""
    facts = {"arch": spec.arch, "path": spec.path}
    if spec.arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"the torch backend does not run the {spec.arch!r} architecture (it runs {', '.join(SUPPORTED_ARCHS)})",
            hint=_FALLBACK, **facts)
    if spec.is_moe:
        raise UnsupportedModelError(
            f"the torch backend runs dense models only; this {spec.arch} model has {spec.n_expert} experts",
            hint=_FALLBACK, **facts)
    if spec.has_swa:
        raise UnsupportedModelError("the torch backend does not run sliding-window attention layers",
                                    hint=_FALLBACK, **facts)
    if spec.rope_scaling not in SUPPORTED_ROPE_SCALING:
        raise UnsupportedModelError(
            f"the torch backend does not implement {spec.rope_scaling!r} RoPE scaling "
            f"(it implements none, linear, yarn and llama3 rope_freqs)", hint=_FALLBACK, **facts)
    if len(set(spec.n_head)) != 1 or len(set(spec.n_head_kv)) != 1 or len(set(spec.n_ff)) != 1:
        raise UnsupportedModelError("the torch backend needs the same head counts and FFN width in every layer",
                                    hint=_FALLBACK, **facts)
    if spec.head_dim_k != spec.head_dim_v:
        raise UnsupportedModelError("the torch backend needs equal K and V head sizes", hint=_FALLBACK, **facts)
    bad = sorted({t.type.name for t in spec.tensors if t.type not in SUPPORTED_WEIGHT_TYPES})
    if bad:
        raise UnsupportedModelError(
            f"the torch backend cannot dequantize {', '.join(bad)} tensors "
            f"(it reads {_names(SUPPORTED_WEIGHT_TYPES)})", hint=_FALLBACK, types=bad, **facts)
    need = ["token_embd.weight", "output_norm.weight"]
    for il in range(spec.n_layers):
        need += [f"blk.{il}.{n}.weight" for n, required in LAYER_TENSORS.items() if required]
    if spec.qk_norm:
        need += [f"blk.{il}.attn_{x}_norm.weight" for il in range(spec.n_layers) for x in "qk"]
    missing = [n for n in need if spec.tensor(n) is None]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UnsupportedModelError(
            f"tensor {missing[0]}{more} is missing; the torch backend expects the standard "
            f"{spec.arch} layout (separate Q, K, V and gate/up/down matrices)", hint=_FALLBACK, **facts)


def check_kv_types(type_k: str, type_v: str, head_dim: int) -> None:
    """Raise UsageError unless both KV types are ones this backend stores."""
    for flag, kind in (("-ctk", type_k), ("-ctv", type_v)):
        if kind not in SUPPORTED_KV_TYPES:
            raise UsageError(f"the torch backend has no {kind} KV cache (it stores {', '.join(SUPPORTED_KV_TYPES)})",
                             flag=flag, hint=f"pick one of those, or --backend llama.cpp for {kind}")
        if kind.startswith("q") and head_dim % 32:
            raise UsageError(f"a {kind} KV cache needs head sizes that are a multiple of 32; this model's is {head_dim}",
                             flag=flag, hint="use -ctk f16 -ctv f16")
