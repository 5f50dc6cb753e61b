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

Inputs cross to the device once: ``step`` writes the tokens, positions, slots
and tables of the padded batch into one host staging buffer (pinned on CUDA),
row i = ``[token, pos, slot, table...]``, and one non-blocking copy moves its
first b rows into the static device buffer the graphs read (tokens, positions,
slots and tables are column views of it).  The next ``step`` waits for that
copy before it rewrites the staging buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    """``graphs.step(tokens, pos, slots, tables) -> logits [n, vocab]`` for n <= max(batches) requests."""

    def __init__(self, model: Transformer, pool: PagedKVPool, max_blocks: int, batches: tuple[int, ...],
                 warmup: int = 2):
        if pool.scratch_slot is None:
            raise ValueError("padded decode steps need a pool with a scratch block")
        dev = model.device
        self.model, self.pool, self.batches = model, pool, tuple(sorted(batches))
        self.max_blocks = max_blocks
        top = self.batches[-1]
        self.pinned = dev.type == "cuda"
        self.inputs = torch.zeros(top, 3 + max_blocks, dtype=torch.long, device=dev)   # what the graphs read
        self.inputs[:, 2] = pool.scratch_slot
        self.host = torch.zeros(top, 3 + max_blocks, dtype=torch.long, pin_memory=self.pinned)
        self._host = self.host.numpy()
        self._copied = torch.cuda.Event() if self.pinned else None      # the last staging copy, done when set
        self.tokens, self.pos, self.slots = self.inputs[:, 0], self.inputs[:, 1], self.inputs[:, 2]
        self.tables = self.inputs[:, 3:]
        self.widths = graph_widths(max_blocks)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}    # by (batch, table width)
        self.out: dict[tuple[int, int], torch.Tensor] = {}
        self.measured_bytes = 0         # CUDA memory reserved by warm-up and capture
        self.host_copies = 0            # host-to-device input copies (one per step)
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
        for x in self.widths:
            if x >= w:
                return x
        raise ValueError(f"a block table of {w} blocks exceeds the {self.max_blocks} a slot can hold")

    def load(self, tokens: Sequence[int], pos: Sequence[int], slots: Sequence[int],
             tables: Sequence[Sequence[int]]) -> tuple[int, int]:
        """Stage one decode step (host lists) and copy it to the device in one transfer; (batch, width) to run."""
        n = len(tokens)
        if not n == len(pos) == len(slots) == len(tables):
            raise ValueError("tokens, positions, slots and tables need one entry per request")
        b, w = self.batch_for(n), self.width_for(max(len(t) for t in tables))
        if self._copied is not None:
            self._copied.synchronize()          # the previous step's copy has read the staging rows
        h = self._host
        h[:b, :3 + w] = 0
        h[:n, 0], h[:n, 1], h[:n, 2] = tokens, pos, slots
        h[n:b, 2] = self.pool.scratch_slot
        for i, t in enumerate(tables):
            h[i, 3:3 + len(t)] = t
        self.inputs[:b].copy_(self.host[:b], non_blocking=self.pinned)
        if self._copied is not None:
            self._copied.record()
        self.host_copies += 1
        return b, w

    @torch.inference_mode()
    def step(self, tokens: Sequence[int], pos: Sequence[int], slots: Sequence[int],
             tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits [n, vocab] of one decode step given as host lists (block tables may differ in length)."""
        b, w = self.load(tokens, pos, slots, tables)
        if (b, w) in self.graphs:
            self.graphs[b, w].replay()
            return self.out[b, w][:len(tokens)]
        return self._run(b, w)[:len(tokens)]

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor) -> torch.Tensor:
        """``step`` from tensors (tables [n, m], zero-padded)."""
        return self.step(tokens.tolist(), pos.tolist(), slots.tolist(), tables.tolist())
