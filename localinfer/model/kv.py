"""What one token costs in a KV cache: the cache types, row sizes in GGUF's block layout, bytes per token.

A row of ``n`` values in a quantized type is ``n / block_values`` blocks of
``block_bytes`` (q8_0: 34 B per 32 values, q4_0: 18 B); f16/bf16 are 2 B a
value.  Backends decide how many tokens they allocate; these are the bytes of one.

Paged caches hold tokens in blocks of ``DEFAULT_BLOCK_TOKENS`` (the serving
engine's block manager, the planner's ``plan.paging`` and the torch backend's
pool all count in it: one block size, one place); ``blocks_for`` is ⌈L / p⌉.
"""

from __future__ import annotations

from functools import lru_cache

from gguf_tools.quants import layout, parse_type
from gguf_tools.quants import row_bytes as quant_row_bytes
from localinfer.errors import UsageError
from localinfer.model.spec import ModelSpec
from localinfer.util.memo import spec_cache

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")


FLOAT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
DEFAULT_BLOCK_TOKENS = 16    # tokens per paged-KV block (vLLM's default): the block manager's and the torch pool's


def blocks_for(n_tokens: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """Paged-KV blocks for n_tokens: ⌈L / p⌉."""
    return -(-n_tokens // block_tokens)


def check_kv_type(name: str, flag: str = "--kv-type", allowed: tuple[str, ...] = KV_TYPES) -> str:
    """Normalise a KV type name; UsageError naming the flag and the accepted values."""
    t = str(name).strip().lower()
    if t not in allowed:
        raise UsageError(f"{flag}: unknown KV type {name!r}", flag=flag, hint="use one of " + ", ".join(allowed))
    return t


@lru_cache(maxsize=4096)
def row_bytes(type_name: str, n_values: int) -> int:
    """Bytes of one KV row of n_values (ggml_row_size); UsageError when the type's blocks do not divide it."""
    lay = layout(parse_type(type_name))
    if n_values % lay.block_values:
        raise UsageError(f"a {type_name} KV row needs a multiple of {lay.block_values} values, "
                         f"this model has {n_values}", flag="--kv-type", hint="use f16 or q8_0")
    return quant_row_bytes(lay.type, n_values)


def attention_layers(spec: ModelSpec, layers=None) -> list[int]:
    """Layers that hold a KV cache (the family's rule: attention layers, not recurrent ones), optionally
    restricted to ``layers``."""
    chosen = range(spec.n_layers) if layers is None else layers
    return [il for il in chosen if spec.kv_dims[il] != (0, 0)]


def kv_bytes_per_token(spec: ModelSpec, type_k: str = "f16", type_v: str = "f16", *, layers=None) -> int:
    """KV bytes one token adds across all (or the given) attention layers, GGUF block layout.

    Qwen3-8B in f16: 2 × 36 × 8 × 128 × 2 B = 147,456 B (144 KiB).
    """
    type_k, type_v = check_kv_type(type_k, "-ctk"), check_kv_type(type_v, "-ctv")
    total = 0
    for il in attention_layers(spec, layers):
        nk, nv = spec.kv_elements_per_token(il)
        total += row_bytes(type_k, nk) + (row_bytes(type_v, nv) if nv else 0)
    return total


def kv_rows(spec: ModelSpec, type_k: str, type_v: str) -> tuple[tuple[int, int, bool], ...]:
    """Per layer: (K bytes per cell, V bytes per cell, sliding-window layer?); zeros for layers without KV."""
    memo = spec_cache(spec)
    key = ("kv_rows", type_k, type_v)
    if key not in memo:
        rows = []
        for il in range(spec.n_layers):
            nk, nv = spec.kv_elements_per_token(il)
            if (nk, nv) == (0, 0):
                rows.append((0, 0, False))
                continue
            rows.append((row_bytes(type_k, nk), row_bytes(type_v, nv) if nv else 0,
                         bool(spec.swa_layers[il] and spec.sliding_window)))
        memo[key] = tuple(rows)
    return memo[key]



RS_TYPE_BYTES = 4     # llama.cpp's recurrent state is F32 (create_memory: type_r = type_s = GGML_TYPE_F32)


def recurrent_rows(n_seq: int, n_rs_seq: int = 0) -> int:
    """Rows of each recurrent layer's r and s tensors: max(1, n_seq_max) × (1 + n_rs_seq)
    (llama-memory-recurrent.cpp: ``mem_size * (1 + n_rs_seq)``, mem_size = max(1, n_seq_max))."""
    return max(1, n_seq) * (1 + n_rs_seq)


def recurrent_state_bytes(spec: ModelSpec, n_seq: int = 1, *, n_rs_seq: int = 0, layers=None,
                          align: int = 1) -> int:
    """Bytes of the recurrent state (r and s tensors, F32) of the recurrent layers, for ``n_seq`` sequences.

    Qwen3-Next-80B-A3B: 36 of 48 layers recurrent, r = 3 × (4096 + 2·16·128) = 24,576 values,
    s = 128 × 4096 = 524,288 values; (24,576 + 524,288) × 4 B × 36 = 75.4 MiB per sequence.
    Each tensor is padded to the buffer's alignment (32 B on a CPU, 128 on CUDA).
    """
    rows = recurrent_rows(n_seq, n_rs_seq)
    r, s = spec.rs_dims
    per_layer = -(-r * RS_TYPE_BYTES * rows // align) * align + -(-s * RS_TYPE_BYTES * rows // align) * align
    chosen = range(spec.n_layers) if layers is None else layers
    return per_layer * sum(1 for il in chosen if spec.recurrent[il])


def snapshot_bytes(spec: ModelSpec) -> int:
    """Bytes of one sequence's recurrent state saved to host memory (llama.cpp's partial sequence state, what serve
    keeps per snapshot): the state (``recurrent_state_bytes`` of one sequence, unpadded) and its framing -- 8 bytes
    of the context's, the cell count and its one cell's position and sequence count, the s layout flag and layer
    count (20), and per recurrent layer the r and s rows' type and row size (24)
    (``llama_memory_recurrent::state_write``)."""
    if not spec.has_recurrent:
        return 0
    return recurrent_state_bytes(spec, 1) + 28 + 24 * len(spec.recurrent_layers)
