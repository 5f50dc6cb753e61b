"""The KV cache of the mlx backend: mlx-lm's caches, allocated for the whole context.

``-ctk`` / ``-ctv`` map onto MLX as follows::

    f32, f16, bf16   plain KVCache holding that dtype (cast to the compute dtype when read)
    q8_0             QuantizedKVCache, 8-bit affine codes
    q4_0             QuantizedKVCache, 4-bit affine codes
    anything else    refused (UsageError naming the flag)

A quantized row of ``d`` values (one head of one token) is ``d·bits/8`` bytes
of codes packed in uint32 words plus one float16 scale and one float16 bias
per group of 64 values (32 when a head's size is not a multiple of 64; K and
V share one group size).  With groups of 64 that is 1.0625 bytes per value for 8 bits and 0.5625
for 4 bits - the same as llama.cpp's q8_0 and q4_0, though the layout differs
(affine codes with a bias instead of symmetric ones, groups of 64 not 32).  mlx-lm quantizes K and V together, so both must have the same type when
either is quantized.

Unlike mlx-lm, which grows caches in steps of 256 tokens, each sequence's
cache is allocated once for ``capacity(n_ctx)`` = n_ctx rounded up to a
multiple of 256 tokens (what mlx-lm would hold once n_ctx tokens are cached):
memory is known at load, as with llama.cpp, and never copied to grow.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from localinfer.backends.mlx.memory import mlx_bytes_per_token, mlx_capacity
from localinfer.backends.mlx.memory import mlx_quant_group as quant_group
from localinfer.errors import UsageError
from localinfer.model.spec import ModelSpec

STEP = KVCache.step
SCALE_DTYPE = mx.float16
SCALE_NAME = "f16"           # SCALE_DTYPE as the budget names it
PLAIN = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
BITS = {"q8_0": 8, "q4_0": 4}
SUPPORTED = (*PLAIN, *BITS)


def capacity(n_ctx: int) -> int:
    """Tokens allocated per sequence for a context of n_ctx (the budget's mlx-lm step)."""
    return mlx_capacity([n_ctx], STEP)


def check_types(spec: ModelSpec, type_k: str, type_v: str) -> int | None:
    """Validate -ctk/-ctv for this backend; the bits of a quantized cache, or None."""
    for flag, t in (("-ctk", type_k), ("-ctv", type_v)):
        if t not in SUPPORTED:
            raise UsageError(f"the mlx backend has no {t} KV cache", flag=flag,
                             hint="use one of " + ", ".join(SUPPORTED) + ", or --backend llama.cpp")
    if type_k not in BITS and type_v not in BITS:
        return None
    if BITS.get(type_k) != BITS.get(type_v):
        raise UsageError(f"the mlx backend quantizes K and V together; got -ctk {type_k} -ctv {type_v}",
                         flag="-ctv", hint=f"pass -ctv {type_k}")
    if quant_group(spec) is None:
        raise UsageError(f"heads of {spec.head_dim_k}/{spec.head_dim_v} values cannot be quantized by MLX "
                         "(groups of 32 or 64)", flag="-ctk", hint="use -ctk f16 -ctv f16")
    return BITS[type_k]


def bytes_per_token(spec: ModelSpec, type_k: str, type_v: str) -> int:
    """Bytes one cached token takes over all layers: the budget's figure for this engine's caches."""
    check_types(spec, type_k, type_v)
    return mlx_bytes_per_token(spec, type_k, type_v, dtype=SCALE_NAME)


class TypedKVCache(KVCache):
    """mlx-lm's KVCache, preallocated, storing K and V in fixed dtypes."""

    def __init__(self, n_kv_heads: int, head_dim_k: int, head_dim_v: int, tokens: int,
                 dtype_k: mx.Dtype, dtype_v: mx.Dtype):
        super().__init__()
        self.keys = mx.zeros((1, n_kv_heads, tokens, head_dim_k), dtype_k)
        self.values = mx.zeros((1, n_kv_heads, tokens, head_dim_v), dtype_v)

    def update_and_fetch(self, keys, values):
        dt = keys.dtype
        k, v = super().update_and_fetch(keys.astype(self.keys.dtype), values.astype(self.values.dtype))
        return (k if k.dtype == dt else k.astype(dt)), (v if v.dtype == dt else v.astype(dt))


class Float16ScaleQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's QuantizedKVCache, preallocated, with float16 scales and biases whatever the compute dtype."""

    def __init__(self, n_kv_heads: int, head_dim_k: int, head_dim_v: int, tokens: int, bits: int, group: int):
        super().__init__(group_size=group, bits=bits)
        per_word = 32 // bits

        def buffers(hd: int):
            shape = (1, n_kv_heads, tokens)
            groups = hd // self.group_size
            return (mx.zeros((*shape, hd // per_word), mx.uint32),
                    mx.zeros((*shape, groups), SCALE_DTYPE), mx.zeros((*shape, groups), SCALE_DTYPE))

        self.keys, self.values = buffers(head_dim_k), buffers(head_dim_v)

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(keys.astype(SCALE_DTYPE), values.astype(SCALE_DTYPE))


def make_cache(spec: ModelSpec, type_k: str, type_v: str, n_ctx: int) -> list:
    """One sequence's cache: a list with one cache per layer, allocated for n_ctx tokens."""
    bits = check_types(spec, type_k, type_v)
    tokens = capacity(n_ctx)
    caches = []
    for il in range(spec.n_layers):
        args = (spec.n_head_kv[il], spec.head_dim_k, spec.head_dim_v, tokens)
        if bits is None:
            caches.append(TypedKVCache(*args, PLAIN[type_k], PLAIN[type_v]))
        else:
            caches.append(Float16ScaleQuantizedKVCache(*args, bits, quant_group(spec)))
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def cache_bytes(caches: list) -> int:
    """Bytes allocated by one sequence's caches (the arrays themselves, whatever mlx-lm's version)."""
    return sum(a.nbytes for c in caches for _, a in tree_flatten((c.keys, c.values)))
