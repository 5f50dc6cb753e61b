"""Memory questions the planner asks of any backend by name: KV bytes, resident weights, where it computes.

Each answer comes from the backend's memory model (see
:class:`localinfer.backends.memory.BackendMemory`); the rules themselves live
with the backends: llama.cpp's cells in :mod:`localinfer.backends.llamacpp.memory`,
the torch engine's 16-token blocks in ``cuda_backend.memory``, mlx-lm's caches in
:mod:`localinfer.backends.mlx.memory`.
"""

from __future__ import annotations

from localinfer.backends.memory import ResidentWeights
from localinfer.backends.registry import DEFAULT_BACKEND, canonical, memory_model
from localinfer.errors import UsageError
from localinfer.model.spec import ModelSpec


def _model(backend: str):
    model = memory_model(canonical(backend))
    if model is None:
        raise UsageError(f"the {backend} backend registered no memory model", flag="--backend",
                         hint="use --backend llama.cpp for its memory rules")
    return model


def kv_bytes(spec: ModelSpec, n_tokens: int, type_k: str = "f16", type_v: str = "f16", *,
             backend: str = DEFAULT_BACKEND, n_seq: int = 1, **options) -> int:
    """KV cache bytes for ``n_seq`` sequences of ``n_tokens`` each, as ``backend`` allocates them.

    Options are the backend's own (llama.cpp: ``n_ubatch``, ``kv_unified``,
    ``swa_full``; mlx: ``dtype``, ``group_size``; all: ``layers``).
    Qwen3-8B, 8192 tokens, f16: 36 layers × 2 × 8 heads × 128 × 2 B × 8192 = 1152 MiB.
    """
    return _model(backend).kv_bytes(spec, n_tokens, type_k, type_v, n_seq=n_seq, **options)


def resident_weights(spec: ModelSpec, backend: str, kind: str, dtype: str | None = None, *,
                     packed: bool = False) -> ResidentWeights:
    """Weights an engine that loads them into its own tensors holds on a device of ``kind``."""
    model = _model(backend)
    if not hasattr(model, "resident_weights"):
        raise UsageError(f"resident weights are modelled for engines that load their own tensors, not {backend!r}",
                         flag="--backend")
    return model.resident_weights(spec, kind, dtype, packed=packed)


def backend_device(backend: str, kind: str) -> tuple[str, str | None]:
    """Where ``backend`` computes on a device of ``kind`` ("cuda" | "metal" | "cpu"), and why when not there."""
    return _model(backend).runs_on(kind)
