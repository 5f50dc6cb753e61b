"""Decode steps over a paged KV pool with data-independent shapes, captured in CUDA graphs.

A decode step of B requests is tokens, positions and slots [B] plus block tables
[B, m] (m = blocks of the longest sequence a slot may hold).  Attention reads
all m·b keys of each table under the mask ``key ≤ position`` built on the
device, so nothing depends on host values.  One graph per batch size of
``memory.graph_batches(n_slots)`` and table width of ``memory.graph_widths(m)``,
captured largest first into one shared memory pool (``memory.torch_graph_bytes``
counts it); a step of n requests whose longest table has w blocks replays the
graph of the next size ≥ n and the next width ≥ w, its padded rows writing the
pool's scratch slot and reading block 0 (their logits are dropped).  Off CUDA the same
padded step runs eagerly, which is how the CPU tests exercise it.
"""

from __future__ import annotations

import torch

from .memory import graph_widths
from .model import Transformer
from .paged_kv import PagedKVPool


class StepView:
    """What ``Transformer._attention`` asks of a cache, for one step over a paged pool: K/V written
    through ``slots``, read through ``keys`` (token slots, one sequence's exact keys) or ``tables``."""

    def __init__(self, pool: PagedKVPool, slots: torch.Tensor, *, keys: torch.Tensor | None = None,
                 tables: torch.Tensor | None = None):
        self.pool, self.slots, self.keys, self.tables = pool, slots, keys, tables
        self.type_k, self.type_v = pool.type_k, pool.type_v

    def write(self, layer: int, rows, pos, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = (-1, self.pool.n_head_kv, self.pool.head_dim)
        self.pool.write(layer, self.slots, k.reshape(shape), v.reshape(shape))

    def read(self, layer: int, seqs, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:
            return self.pool.read_slots(layer, self.keys)
        return self.pool.read_tables(layer, self.tables)


def decode_forward(model: Transformer, pool: PagedKVPool, tokens: torch.Tensor, pos: torch.Tensor,
                   slots: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Logits [B, vocab] of one token per request: tokens, pos, slots [B], block tables [B, m]."""
    n_keys = tables.shape[1] * pool.block_size
    key = torch.arange(n_keys, device=tokens.device)
    mask = (key[None, :] <= pos[:, None])[:, None, None, :]
    view = StepView(pool, slots, tables=tables)
    return model.forward(tokens[:, None], pos[:, None], view, seqs=None, n_attn=n_keys, mask=mask)


class PagedGraphs:
    """``graphs(tokens, pos, slots, tables) -> logits [n, vocab]`` for n <= max(batches) requests."""

    def __init__(self, model: Transformer, pool: PagedKVPool, max_blocks: int, batches: tuple[int, ...],
                 warmup: int = 2):
        if pool.scratch_slot is None:
            raise ValueError("padded decode steps need a pool with a scratch block")
        dev = model.device
        self.model, self.pool, self.batches = model, pool, tuple(sorted(batches))
        top = self.batches[-1]
        self.tokens = torch.zeros(top, dtype=torch.long, device=dev)
        self.pos = torch.zeros(top, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), pool.scratch_slot, dtype=torch.long, device=dev)
        self.tables = torch.zeros(top, max_blocks, dtype=torch.long, device=dev)
        self.widths = graph_widths(max_blocks)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}    # by (batch, table width)
        self.out: dict[tuple[int, int], torch.Tensor] = {}
        self.measured_bytes = 0         # CUDA memory reserved by warm-up and capture
        if dev.type == "cuda":
            self._capture(warmup)

    def _run(self, b: int, w: int) -> torch.Tensor:
        return decode_forward(self.model, self.pool, self.tokens[:b], self.pos[:b], self.slots[:b],
                              self.tables[:b, :w])

    def _capture(self, warmup: int) -> None:
        dev = self.model.device
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_reserved(dev)
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(warmup):
                self._run(self.batches[-1], self.widths[-1])
        torch.cuda.current_stream(dev).wait_stream(stream)
        for b in reversed(self.batches):      # largest first: the smaller ones fit in its pool
            for w in reversed(self.widths):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool), torch.inference_mode():
                    self.out[b, w] = self._run(b, w)
                self.graphs[b, w] = graph
        torch.cuda.synchronize(dev)
        self.measured_bytes = torch.cuda.memory_reserved(dev) - before

    def batch_for(self, n: int) -> int:
        """The captured size a step of n requests pads to."""
        for b in self.batches:
            if b >= n:
                return b
        raise ValueError(f"{n} requests exceed the largest captured batch {self.batches[-1]}")

    def width_for(self, w: int) -> int:
        """The captured table width a step whose longest table has w blocks pads to."""
        return next(x for x in self.widths if x >= w)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor) -> torch.Tensor:
        n, b, w = tokens.shape[0], self.batch_for(tokens.shape[0]), self.width_for(tables.shape[1])
        self.tokens[:n].copy_(tokens)
        self.pos[:n].copy_(pos)
        self.slots[:n].copy_(slots)
        self.tables[:n].zero_()
        self.tables[:n, :tables.shape[1]].copy_(tables)
        self.tokens[n:b].zero_()
        self.pos[n:b].zero_()
        self.slots[n:b].fill_(self.pool.scratch_slot)
        self.tables[n:b].zero_()
        if (b, w) in self.graphs:
            self.graphs[b, w].replay()
            return self.out[b, w][:n]
        return self._run(b, w)[:n]
