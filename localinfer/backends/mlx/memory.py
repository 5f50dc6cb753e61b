"""The mlx backend's memory: mlx-lm's KV caches and the parameters the engine holds (no mlx import here).

KV: ``KVCache`` keeps plain f16/bf16/f32 rows; ``QuantizedKVCache`` keeps 8- or
4-bit codes packed in uint32 plus a scale and a bias per group (64 values, or 32
for heads not divisible by 64) in the compute dtype.  Both grow 256 tokens at a
time.  Weights: Q4_0/Q4_1/Q8_0 matrices stay affine groups of 32, the rest is
dequantized.
"""

from __future__ import annotations

from localinfer.backends.memory import (
    NOT_RESIDENT,
    QUANT_GROUP,
    WEIGHT_DTYPE_BYTES,
    OwnTensorsMemory,
    ResidentWeights,
    refusal,
    check_tokens,
    check_weight_dtype,
)
from localinfer.errors import UsageError
from localinfer.model.kv import FLOAT_BYTES, attention_layers
from localinfer.model.spec import ModelSpec
from localinfer.units import pad_to

MLX_STEP = 256               # mlx-lm caches grow in steps of 256 tokens
MLX_GROUP_SIZES = (64, 32)   # KV group sizes tried in order (mlx-lm's default 64, else 32)
MLX_KV_BITS = {"q8_0": 8, "q8": 8, "q4_0": 4, "q4": 4}
MLX_AFFINE = {"Q4_0": 16, "Q4_1": 16, "Q8_0": 32}   # code bytes per group of 32


def mlx_group_size(head_dim: int) -> int | None:
    """Values per KV scale/bias group for a head of head_dim values: 64, else 32 (None: not quantizable)."""
    for g in MLX_GROUP_SIZES:
        if head_dim % g == 0:
            return g
    return None


def mlx_quant_group(spec: ModelSpec) -> int | None:
    """The group size K and V share in the mlx engine's quantized cache (one per cache), or None."""
    gk, gv = mlx_group_size(spec.head_dim_k), mlx_group_size(spec.head_dim_v)
    return None if gk is None or gv is None else min(gk, gv)


def mlx_bytes_per_token(spec: ModelSpec, type_k: str = "f16", type_v: str = "f16", *, dtype: str = "f16",
                        group_size: int | None = None, layers=None) -> int:
    """Bytes per cached token in mlx-lm: plain dtype, or packed uint32 codes + per-group scale and bias.

    ``group_size`` defaults to :func:`mlx_quant_group` (64, or 32 for heads
    whose size is not a multiple of 64), the group the mlx engine allocates.
    """
    group = mlx_quant_group(spec) if group_size is None else group_size

    def per_head(type_name: str, dim: int, flag: str) -> int:
        t = str(type_name).lower()
        if t in FLOAT_BYTES:
            return dim * FLOAT_BYTES[t]
        if t not in MLX_KV_BITS:
            raise UsageError(f"mlx-lm has no KV type {type_name!r}", flag=flag,
                             hint="use f16, bf16, f32, q8_0 (8 bits) or q4_0 (4 bits)")
        if not group or dim % group:
            raise UsageError(f"heads of {spec.head_dim_k}/{spec.head_dim_v} values cannot be quantized by MLX "
                             f"(groups of {' or '.join(map(str, MLX_GROUP_SIZES))})", flag=flag,
                             hint="use -ctk f16 -ctv f16")
        return dim * MLX_KV_BITS[t] // 8 + 2 * (dim // group) * FLOAT_BYTES[dtype]

    total = 0
    for il in attention_layers(spec, layers):
        h = spec.n_head_kv[il]
        total += h * (per_head(type_k, spec.head_dim_k, "-ctk") + per_head(type_v, spec.head_dim_v, "-ctv"))
    return total


def mlx_capacity(updates: list[int], step: int = MLX_STEP) -> int:
    """Cells an mlx-lm cache holds after a sequence of ``update_and_fetch`` calls of these sizes.

    The cache grows by ``ceil(n / step) × step`` when an update overflows it; if
    the filled length is not a multiple of ``step`` it is first cut to that length.
    """
    cap = filled = 0
    for n in updates:
        if n <= 0:
            continue
        if cap == 0 or filled + n > cap:
            grow = pad_to(n, step)
            cap = (filled if cap and filled % step else cap) + grow
        filled += n
    return cap


def mlx_weight_bytes(spec: ModelSpec, dtype: str = "f16") -> int:
    """Bytes of the mlx backend's parameters: Q4_0/Q4_1/Q8_0 matrices as affine groups of 32
    (codes + scale + bias in dtype), every other tensor dequantized to n × dtype (rope_freqs
    becomes RoPE frequencies, not a parameter)."""
    size = WEIGHT_DTYPE_BYTES[check_weight_dtype(dtype)]
    total = 0
    for t in spec.tensors:
        if t.name in NOT_RESIDENT:
            continue
        code = MLX_AFFINE.get(t.type.name)
        if code is not None and len(t.shape) > 1:
            total += t.n_elements // QUANT_GROUP * (code + 2 * size)
        else:
            total += t.n_elements * size
    return total


def mlx_kv_bytes(spec: ModelSpec, n_tokens: int, type_k: str = "f16", type_v: str = "f16", *, n_seq: int = 1,
                 dtype: str = "f16", group_size: int | None = None, layers=None, **_ignored) -> int:
    """mlx-lm's cache for ``n_seq`` sequences of ``n_tokens``: capacity ``ceil(n / 256) × 256`` (one prefill
    call, then decode; see :func:`mlx_capacity` for other update patterns) × :func:`mlx_bytes_per_token`."""
    check_tokens(n_tokens, n_seq)
    if n_tokens == 0:
        return 0
    return n_seq * mlx_capacity([n_tokens]) * mlx_bytes_per_token(spec, type_k, type_v, dtype=dtype,
                                                                 group_size=group_size, layers=layers)


def default_dtype(spec: ModelSpec, runs_on: str) -> str:
    """f16 on Metal (bf16 for files with BF16 tensors); float32 on the CPU."""
    if runs_on == "cpu":
        return "f32"
    return "bf16" if any(t.type.name == "BF16" for t in spec.tensors) else "f16"


class MLXMemory(OwnTensorsMemory):
    """The memory model the registry hands out for ``mlx``."""

    name = "mlx"
    blocks = "256-token steps (mlx-lm)"
    default_dtype = staticmethod(default_dtype)

    def refuses(self, spec: ModelSpec) -> str | None:
        """Why the mlx engine cannot run ``spec`` (backends/mlx/support.py), or None."""
        from localinfer.backends.mlx.support import check_supported

        return refusal(check_supported, spec)

    def runs_on(self, kind: str) -> tuple[str, str | None]:
        """Metal or the CPU: MLX's CUDA build is not supported by this backend, which then runs on the host CPU."""
        if kind == "cuda":
            return "cpu", ("the mlx backend does not use CUDA GPUs (MLX's CUDA build is not supported by "
                           "localinfer's mlx backend): it runs on the host CPU")
        return kind, None

    def resident_weights(self, spec: ModelSpec, kind: str, dtype: str | None = None, *, packed: bool = False
                         ) -> ResidentWeights:
        """SmolLM2-135M Q4_1 (96,576,768 B in the file): 98,275,968 B on Metal, 115,156,224 B on the CPU."""
        runs_on, note, dt, size = self.placement(spec, kind, dtype)
        formula = (f"mlx on {runs_on}, {dt}: Q4_0/Q4_1 n/32 × (16 + 2·{size}) B, Q8_0 n/32 × (32 + 2·{size}) B "
                   f"(affine groups of 32, scale and bias in {dt}); other tensors n × {size} B (dequantized)")
        if spec.tied_embeddings:
            formula += "; tied output: token_embd counted once"
        return ResidentWeights(mlx_weight_bytes(spec, dt), runs_on, dt, formula, note)

    def kv_bytes(self, spec, n_tokens, type_k="f16", type_v="f16", **options) -> int:
        return mlx_kv_bytes(spec, n_tokens, type_k, type_v, **options)

    def load_request(self, plan) -> dict:
        return {"dtype": plan.dtype}


MEMORY = MLXMemory()
