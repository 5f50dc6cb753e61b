"""Per-sequence KV cache: float or GGUF q8_0/q4_0 blocks, allocated in 16-token blocks.

Each layer holds one K and one V tensor for all sequences, written by
position (a static cache, so decode steps can be captured in CUDA graphs)::

    float  : [n_seq, n_head_kv, capacity, head_dim]                   f32 / f16 / bf16
    blocks : [n_seq, n_head_kv, capacity, head_dim / 32, 34 or 18]    uint8 (see quant.py)

``capacity`` is the context rounded up to whole 16-token blocks, so the bytes
equal ``n_seq · ⌈n_ctx/16⌉·16 · Σ_layers n_head_kv · (K bytes + V bytes per head)``.
Quantized K/V are dequantized to the compute dtype inside attention.
``trim(seq, n)`` only moves the length: positions past it are rewritten.
"""

from __future__ import annotations

import torch

from gguf_tools.quants import layout, parse_type
from localinfer.model.kv import row_bytes
from localinfer.units import ceil_div

from . import quant
from .memory import TORCH_BLOCK_TOKENS as BLOCK_TOKENS
from .support import check_kv_types

FLOAT_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def padded_tokens(n_tokens: int) -> int:
    """Tokens of storage for n_tokens: whole blocks of the budget's torch block size."""
    return ceil_div(n_tokens, BLOCK_TOKENS) * BLOCK_TOKENS


def head_bytes(kind: str, head_dim: int) -> int:
    """Bytes one head of one token takes in kind (the budget's GGUF row size)."""
    return row_bytes(kind, head_dim)


def cache_bytes(n_layers: int, n_head_kv: int, head_dim: int, n_ctx: int, type_k: str, type_v: str,
                n_seq: int = 1) -> int:
    """Bytes a KVCache with these dimensions allocates."""
    per_token = n_layers * n_head_kv * (head_bytes(type_k, head_dim) + head_bytes(type_v, head_dim))
    return n_seq * padded_tokens(n_ctx) * per_token


def alloc(shape: tuple[int, ...], head_dim: int, kind: str, device: torch.device | str) -> torch.Tensor:
    """Zeros for K or V rows of head_dim values under leading dims shape: [*shape, head_dim] in a float
    kind, or uint8 [*shape, head_dim / 32, 34 or 18] GGUF blocks for q8_0 / q4_0."""
    if kind in FLOAT_TYPES:
        return torch.zeros(*shape, head_dim, dtype=FLOAT_TYPES[kind], device=device)
    block = layout(parse_type(kind))
    return torch.zeros(*shape, head_dim // block.block_values, block.block_bytes, dtype=torch.uint8, device=device)


def encode(x: torch.Tensor, kind: str, like: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] as stored in a cache tensor like ``like`` of this kind."""
    return x.to(like.dtype) if kind in FLOAT_TYPES else quant.quantize(x, kind)


def decode(x: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows back to [..., head_dim] values in the compute dtype."""
    return x.to(dtype) if kind in FLOAT_TYPES else quant.dequantize(x, kind, dtype)


class KVCache:
    """K and V of every layer for n_seq sequences of up to n_ctx tokens each."""

    def __init__(self, n_layers: int, n_seq: int, n_ctx: int, n_head_kv: int, head_dim: int,
                 type_k: str = "f16", type_v: str = "f16", *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        check_kv_types(type_k, type_v, head_dim)
        self.n_layers, self.n_seq, self.n_ctx = n_layers, n_seq, n_ctx
        self.n_head_kv, self.head_dim = n_head_kv, head_dim
        self.type_k, self.type_v = type_k, type_v
        self.dtype = dtype
        self.device = torch.device(device)
        self.capacity = padded_tokens(n_ctx)
        self.lens = [0] * n_seq
        self.k = [self._alloc(type_k) for _ in range(n_layers)]
        self.v = [self._alloc(type_v) for _ in range(n_layers)]

    def _alloc(self, kind: str) -> torch.Tensor:
        return alloc((self.n_seq, self.n_head_kv, self.capacity), self.head_dim, kind, self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def _encode(x: torch.Tensor, kind: str, like: torch.Tensor) -> torch.Tensor:
        return encode(x, kind, like)

    def _decode(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return decode(x, kind, self.dtype)

    def write(self, layer: int, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [b, t, n_head_kv, head_dim] of sequences rows [b, 1] at positions pos [b, t]."""
        ck, cv = self.k[layer], self.v[layer]
        ck[rows, :, pos] = self._encode(k, self.type_k, ck)
        cv[rows, :, pos] = self._encode(v, self.type_v, cv)

    def read(self, layer: int, seqs: torch.Tensor | None, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [b, n_head_kv, n, head_dim] in the compute dtype: the first n positions of
        sequences seqs [b] (None: sequences 0..b-1, read without a gather)."""
        ck, cv = self.k[layer], self.v[layer]
        if seqs is None:
            k, v = ck[:b, :, :n], cv[:b, :, :n]
        else:
            k, v = ck[seqs, :, :n], cv[seqs, :, :n]
        return self._decode(k, self.type_k), self._decode(v, self.type_v)

    def trim(self, seq: int, n: int) -> None:
        """Forget positions >= n of sequence seq."""
        if not 0 <= n <= self.lens[seq]:
            raise ValueError(f"cannot trim sequence {seq} to {n}; it holds {self.lens[seq]}")
        self.lens[seq] = n
