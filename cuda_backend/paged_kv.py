"""A paged KV pool: one K and one V tensor per layer, cut into blocks of ``block_size`` tokens.

Per layer (``kv_cache.alloc`` makes the rows, ``kv_cache.encode/decode`` convert them)::

    float  : [num_blocks, block_size, n_head_kv, head_dim]                  f32 / f16 / bf16
    blocks : [num_blocks, block_size, n_head_kv, head_dim / 32, 34 or 18]   uint8 GGUF q8_0 / q4_0

Token ``p`` of a sequence with block table ``T`` lives in slot ``T[p // b]·b + p % b``
of the flattened ``[num_blocks · b, ...]`` view: new K/V are written through a
slot mapping, attention reads a request's keys through its block table.  Bytes:
``num_blocks · b · Σ_layers n_head_kv · (K + V bytes per head)`` =
``memory.torch_block_bytes`` per block, so a pool for n_seq × n_ctx equals
``memory.torch_kv_bytes`` (``fit --backend torch``).  With ``scratch`` one more
block takes the writes of padded rows of a CUDA-graph batch.
"""

from __future__ import annotations

from collections import deque

import torch

from .kv_cache import alloc, decode, encode, head_bytes
from .support import check_kv_types


class PagedKVPool:
    """K and V of every layer in ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_head_kv: int, head_dim: int,
                 type_k: str = "f16", type_v: str = "f16", *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, scratch: bool = False):
        check_kv_types(type_k, type_v, head_dim)
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs >= 1 block of >= 1 token, got {num_blocks} of {block_size}")
        self.n_layers, self.num_blocks, self.block_size = n_layers, num_blocks, block_size
        self.n_head_kv, self.head_dim = n_head_kv, head_dim
        self.type_k, self.type_v, self.dtype = type_k, type_v, dtype
        self.device = torch.device(device)
        shape = (num_blocks + bool(scratch), block_size, n_head_kv)
        self.k = [alloc(shape, head_dim, type_k, self.device) for _ in range(n_layers)]
        self.v = [alloc(shape, head_dim, type_v, self.device) for _ in range(n_layers)]
        self.scratch_slot = num_blocks * block_size if scratch else None

    @staticmethod
    def block_nbytes(n_layers: int, block_size: int, n_head_kv: int, head_dim: int, type_k: str, type_v: str) -> int:
        """Bytes of one block over every layer: ``b · layers · n_head_kv · (K + V bytes per head)``."""
        return block_size * n_layers * n_head_kv * (head_bytes(type_k, head_dim) + head_bytes(type_v, head_dim))

    @property
    def nbytes(self) -> int:
        """The pool's real tensor bytes (scratch block included)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *t.shape[2:])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, n_head_kv, head_dim] at token slots [N] (distinct)."""
        for cache, x, kind in ((self.k[layer], k, self.type_k), (self.v[layer], v, self.type_v)):
            flat = self._flat(cache)
            flat.index_copy_(0, slots, encode(x, kind, flat))

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at token slots [n] as [1, n_head_kv, n, head_dim] in the compute dtype."""
        out = []
        for cache, kind in ((self.k[layer], self.type_k), (self.v[layer], self.type_v)):
            rows = decode(self._flat(cache).index_select(0, slots), kind, self.dtype)
            out.append(rows.transpose(0, 1).unsqueeze(0))
        return out[0], out[1]

    def read_tables(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of block tables [B, m] as [B, n_head_kv, m · b, head_dim] (shapes independent of the data)."""
        B, m = tables.shape
        out = []
        for cache, kind in ((self.k[layer], self.type_k), (self.v[layer], self.type_v)):
            rows = cache.index_select(0, tables.reshape(-1))
            rows = decode(rows.view(B, m * self.block_size, *cache.shape[2:]), kind, self.dtype)
            out.append(rows.transpose(1, 2))
        return out[0], out[1]

    def copy_block(self, src: int, dst: int, n_tokens: int | None = None) -> None:
        """Copy-on-write: the first n_tokens (all) of block src into block dst, every layer."""
        n = self.block_size if n_tokens is None else n_tokens
        for cache in self.k + self.v:
            cache[dst, :n] = cache[src, :n]


def token_slots(table, start: int, stop: int, block_size: int) -> list[int]:
    """Pool slots of positions [start, stop) of a sequence with this block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


class BlockAllocator:
    """Reference-counted block ids for an executor that keeps its own block tables."""

    def __init__(self, num_blocks: int):
        self.refs = [0] * num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        b = self._free.popleft()
        self.refs[b] = 1
        return b

    def ref(self, b: int) -> None:
        self.refs[b] += 1

    def unref(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self._free.append(b)
