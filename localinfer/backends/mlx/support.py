"""What the mlx backend runs: the architectures and shapes mlx-lm's modules reproduce exactly (no mlx import,
so ``fit`` can ask)."""

from __future__ import annotations

from localinfer.errors import UnsupportedModelError
from localinfer.model.spec import ModelSpec

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


def _refuse(what: str, **facts) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"the mlx backend cannot run this model: {what}",
        hint="the mlx backend runs dense llama, qwen2 and qwen3 GGUFs; use --backend llama.cpp", **facts)


def check_supported(spec: ModelSpec) -> None:
    """Raise UnsupportedModelError unless mlx-lm's modules can run the model exactly."""
    if spec.arch not in SUPPORTED_ARCHS:
        raise _refuse(f"architecture {spec.arch!r}", arch=spec.arch)
    if spec.is_moe:
        raise _refuse(f"{spec.n_expert} experts (mixture of experts)", arch=spec.arch)
    if spec.has_swa:
        raise _refuse(f"sliding-window attention ({spec.sliding_window} tokens)", arch=spec.arch)
    for name, values in (("head_count", spec.n_head), ("head_count_kv", spec.n_head_kv), ("feed_forward_length", spec.n_ff)):
        if len(set(values)) != 1:
            raise _refuse(f"{name} differs between layers", arch=spec.arch)
    if spec.head_dim_k != spec.head_dim_v:
        raise _refuse(f"K heads of {spec.head_dim_k} and V heads of {spec.head_dim_v} values", arch=spec.arch)
    if spec.arch == "qwen2" and spec.head_dim_k * spec.n_head[0] != spec.n_embd:
        raise _refuse("qwen2 with a head size other than n_embd / n_head", arch=spec.arch)
    if spec.n_rot != spec.head_dim_k:
        raise _refuse(f"RoPE over {spec.n_rot} of {spec.head_dim_k} head dimensions", arch=spec.arch)
    if spec.rope_scaling not in (None, "linear"):
        raise _refuse(f"rope scaling {spec.rope_scaling!r} (only linear is mapped)", arch=spec.arch)
