"""The serving executor on the torch model: a paged KV pool, block tables, one forward per step.

It implements the serving engine's executor contract structurally (``step``,
``copy``, ``drop``, ``cells_used``, ``clock``, ``n_slots``, ``n_vocab``; docs in
``localinfer/backends/executor.py``) and takes any chunk-like objects with
``slot, tokens, start, logits`` and optionally ``blocks``.

A step flattens the new tokens of every chunk into one sequence of N rows
(decodes and prefill pieces together), each with its own position and pool
slot ``T[p // b]·b + p % b``.  One ``Transformer.forward`` runs them; every layer
writes the new K/V through that slot mapping and attends over each request's
keys, gathered through its block table, under the mask
``same request ∧ key position ≤ query position`` (gather + SDPA; a step whose
mask would pass ``max_mask_elements`` is split into several forwards).  Logits are
computed only for the rows asked: the last ``n_logits`` rows of each chunk that
asks (one row, or an ``[n_logits, n_vocab]`` array when a chunk verifies drafts:
``verifies_drafts``).  Pure decode steps (one token per chunk) on CUDA replay a
captured graph instead (``paged_graphs.py``); a draft chunk has several tokens,
so a step holding one runs the varlen forward.

Block tables: with ``external_blocks=True`` (what ``serving.open_executor``
builds, and what runs under the serving engine) they come with every chunk
(``chunk.blocks``, which the engine fills from its block manager's table for
the request: the one source of blocks, of one block size): blocks reused by a
prefix hit are read, not recomputed — ``restore(slot, n)`` marks them held —,
a table entry that changed under already written positions is a copy-on-write
whose content the executor copies, and a table too short for the chunk's
positions is refused with an error naming both counts.  Without it (driving the
executor by hand) they are kept here with a reference-counted allocator, where
``copy(src, dst, n)`` shares src's first ⌈n / b⌉ blocks and a write into a
shared block copies it first; a chunk's ``blocks`` are then not read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Self

import numpy as np
import torch

from localinfer.backends.executor import ExecutorBase, check_chunks, check_slot
from localinfer.errors import ContextFullError, UsageError

from .memory import TORCH_BLOCK_TOKENS
from .memory import graph_batches as default_graph_batches
from .model import Transformer
from .paged_graphs import PagedGraphs, StepView
from .paged_kv import BlockAllocator, PagedKVPool, token_slots


def _to_host(t: torch.Tensor) -> np.ndarray:
    """Logits rows on the host.  From CUDA through pinned memory (torch's caching host allocator reuses the
    buffer once the rows are dropped): one direct copy, at about twice a pageable copy's rate; 39 MB at
    batch 64 of a 151,936-token vocabulary."""
    if t.device.type != "cuda":
        return t.cpu().numpy()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host.numpy()


class PagedExecutor(ExecutorBase):
    """``n_slots`` sequences over a pool of ``num_blocks`` blocks of ``block_size`` tokens."""

    verifies_drafts = True      # honours Chunk.n_logits (the last n rows of a chunk, for draft verification)

    def __init__(self, model: Transformer, *, n_slots: int, num_blocks: int, block_size: int = TORCH_BLOCK_TOKENS,
                 type_k: str = "f16", type_v: str = "f16", max_model_len: int | None = None,
                 cuda_graphs: bool | None = None, padded_decode: bool = False, external_blocks: bool = False,
                 graph_batches: Sequence[int] | None = None):
        """``max_model_len``: most positions a slot holds (default: the model's RoPE tables).
        ``cuda_graphs`` (default: on CUDA) captures decode steps at ``graph_batches`` (default
        ``memory.graph_batches(n_slots)``, what ``fit --backend torch`` counts); ``padded_decode`` runs them
        through the same padded path eagerly (the CPU check of it).  ``external_blocks``: every chunk brings
        its block table (``restores_cached_prefix``: a chunk may start past what its slot holds)."""
        if model.emulate:
            raise UsageError("llamacpp_rounding is a verification mode of TorchEngine, not of the serving executor",
                             hint="load without llamacpp_rounding")
        if n_slots < 1:
            raise UsageError(f"n_slots must be >= 1, got {n_slots}", flag="--parallel")
        self.model, self.device = model, model.device
        self.cpu_threads = torch.get_num_threads() if self.device.type == "cpu" else 0
        cfg = model.cfg
        self.n_slots, self.n_vocab, self.block_size = n_slots, cfg.vocab_size, block_size
        self.max_model_len = min(max_model_len or model.cos.shape[0], model.cos.shape[0])
        self.max_blocks = -(-self.max_model_len // block_size)
        graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        use_graphs = (graphs and self.device.type == "cuda") or padded_decode
        self.pool = PagedKVPool(cfg.n_layers, num_blocks, block_size, cfg.n_head_kv, cfg.head_dim, type_k, type_v,
                                device=self.device, dtype=model.dtype, scratch=use_graphs)
        self.n_cells = num_blocks * block_size
        self.slot_cells = self.max_model_len       # the most one slot can hold (llama.cpp executor's name)
        self.external = external_blocks
        self.alloc = BlockAllocator(num_blocks)
        self.tables: list[list[int]] = [[] for _ in range(n_slots)]
        self.lens = [0] * n_slots
        batches = tuple(graph_batches) if graph_batches is not None else default_graph_batches(n_slots)
        self.graphs = PagedGraphs(model, self.pool, self.max_blocks, batches) if use_graphs else None
        self.max_mask_elements = 1 << 26   # a step whose attention mask would be larger runs in several forwards
        self.forward_seconds = 0.0      # inside the model's forward or graph replay (overhead: wall - this)
        self.steps = 0
        self.forwards = 0               # model forwards (or graph replays): one per step unless split
        self.tokens_computed = 0

    @property
    def restores_cached_prefix(self) -> bool:
        return self.external

    # ---- the contract ---------------------------------------------------------
    @torch.inference_mode()
    def step(self, chunks: Sequence) -> dict[int, np.ndarray]:
        """Append every chunk in one forward; by slot for those asking, logits (float32): one row [n_vocab]
        (``n_logits`` 1) or the last n_logits tokens' rows [n_logits, n_vocab]."""
        self._check(chunks)
        if not chunks:
            return {}
        undo: list = []
        try:
            for c in chunks:
                self._place(c, undo)
            rows = self._forward(chunks)
        except BaseException:
            for fn in reversed(undo):
                fn()
            raise
        for c in chunks:
            self.lens[c.slot] = c.start + len(c.tokens)
        self.steps += 1
        self.tokens_computed += sum(len(c.tokens) for c in chunks)
        return rows

    def copy(self, src: int, dst: int, n_tokens: int, *, append: bool = False) -> int:
        """Slot ``dst`` (empty) shares positions [0, n_tokens) of ``src``: its blocks, no recompute; n_tokens.
        (``append`` is for executors that park KV in host memory; this one keeps every block in its pool.)"""
        if append:
            raise ValueError("the paged executor parks no KV in host memory: copy into an empty slot")
        self._check_slot(src)
        self._check_slot(dst)
        if src == dst or self.lens[dst]:
            raise ValueError(f"copy needs an empty destination slot other than {src}; slot {dst} holds "
                             f"{self.lens[dst]} tokens")
        if not 0 <= n_tokens <= self.lens[src]:
            raise ValueError(f"slot {src} holds {self.lens[src]} tokens; cannot share {n_tokens}")
        shared = self.tables[src][:-(-n_tokens // self.block_size)]
        self._release(dst)
        if not self.external:
            for b in shared:
                self.alloc.ref(b)
        self.tables[dst] = list(shared)
        self.lens[dst] = n_tokens
        return n_tokens

    def restore(self, slot: int, n_tokens: int) -> None:
        """Positions [held, n_tokens) of ``slot`` come back from the pool (a prefix cached in blocks no slot
        holds): their blocks, already written, arrive with the slot's next chunk (external block tables only)."""
        self._check_slot(slot)
        if not self.external:
            raise ValueError("restore needs block tables from the block manager (external_blocks=True)")
        if n_tokens > self.max_model_len:
            raise ValueError(f"slot {slot} cannot hold {n_tokens} positions")
        self.lens[slot] = max(self.lens[slot], n_tokens)

    def drop(self, slot: int, start: int = 0) -> None:
        """Forget positions >= start of ``slot``; blocks no slot holds return to the pool."""
        self._check_slot(slot)
        if start < 0:
            raise ValueError(f"drop start must be >= 0, got {start}")
        self.lens[slot] = min(self.lens[slot], start)
        self._release(slot, -(-self.lens[slot] // self.block_size))

    def cells_used(self) -> int:
        """Pool token slots holding a token of a live slot, each physical slot once."""
        filled: dict[int, int] = {}
        for table, n in zip(self.tables, self.lens):
            for i, b in enumerate(table[:-(-n // self.block_size)]):
                filled[b] = max(filled.get(b, 0), min(self.block_size, n - i * self.block_size))
        return sum(filled.values())

    def clock(self) -> float:
        return time.perf_counter()

    def close(self) -> None:
        """Free the pool and graphs; close the tokenizer if ``serving.open_executor`` attached one."""
        if self.vocab is not None:
            self.vocab.close()
            self.vocab = None
        self.pool = self.graphs = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- block tables ---------------------------------------------------------
    def _release(self, slot: int, keep: int = 0) -> None:
        table = self.tables[slot]
        if not self.external:
            for b in table[keep:]:
                self.alloc.unref(b)
        del table[keep:]

    def _place(self, c, undo: list) -> None:
        """The slot's table covers positions [0, start + n); shared blocks about to be written are copied."""
        s, bs, table = c.slot, self.block_size, self.tables[c.slot]
        old = list(table)
        undo.append(lambda: table.__setitem__(slice(None), old))
        if self.external:
            held = -(-min(self.lens[s], c.start) // bs)
            for i in range(min(held, len(old), len(c.blocks))):
                if c.blocks[i] != old[i]:
                    n = min(bs, self.lens[s] - i * bs)
                    self.pool.copy_block(old[i], c.blocks[i], n)
            table[:] = c.blocks
            return
        first, need = c.start // bs, -(-(c.start + len(c.tokens)) // bs)
        if c.start % bs and self.alloc.refs[table[first]] > 1:
            self._ensure_free(need - len(table) + 1)
            new = self.alloc.take()
            self.pool.copy_block(table[first], new, c.start % bs)
            self.alloc.unref(table[first])
            shared = table[first]
            table[first] = new
            undo.append(lambda: (self.alloc.ref(shared), self.alloc.unref(new)))
        self._ensure_free(need - len(table))
        while len(table) < need:
            b = self.alloc.take()
            table.append(b)
            undo.append(lambda b=b: self.alloc.unref(b))

    def _ensure_free(self, n: int) -> None:
        if n > self.alloc.num_free:
            raise ContextFullError(f"the KV pool has {self.alloc.num_free} free blocks of {self.pool.num_blocks}; "
                                   f"this step needs {n} more", needed=n, available=self.alloc.num_free,
                                   hint="admit fewer requests, preempt one, or give the pool more blocks")

    # ---- the forward ----------------------------------------------------------
    def _forward(self, chunks: Sequence) -> dict[int, np.ndarray]:
        dev, bs = self.device, self.block_size
        asking = [c for c in chunks if c.logits]
        if self.graphs is not None and all(len(c.tokens) == 1 for c in chunks) \
                and len(chunks) <= self.graphs.batches[-1]:
            ids = [c.tokens[0] for c in chunks]
            pos = [c.start for c in chunks]
            slots = [token_slots(self.tables[c.slot], c.start, c.start + 1, bs)[0] for c in chunks]
            tables = [self.tables[c.slot][:c.start // bs + 1] for c in chunks]   # the blocks this step reads
            t0 = time.perf_counter()
            logits = self.graphs.step(ids, pos, slots, tables)     # one host-to-device copy into the graph's inputs
            self._sync()
            self.forward_seconds += time.perf_counter() - t0
            self.forwards += 1
            at = [i for i, c in enumerate(chunks) if c.logits]
            out = _to_host(logits[torch.tensor(at, dtype=torch.long, device=dev)].float()) if at else None
            return {c.slot: out[i] for i, c in enumerate(asking)}
        parts = [self._varlen(g) for g in self._groups(chunks)]
        out = np.concatenate([p for p in parts if p is not None]) if asking else None
        rows, i = {}, 0
        for c in asking:        # rows in chunk order: n_logits of them per asking chunk
            n = _n_logits(c)
            rows[c.slot] = out[i] if n == 1 else out[i:i + n]
            i += n
        return rows

    def _groups(self, chunks: Sequence) -> list[list]:
        """Chunks in order, in as few groups as keep each forward's mask (new tokens × keys, all the
        group's requests) within ``max_mask_elements``: one group, one forward, unless the step is large."""
        groups: list[list] = [[]]
        rows = keys = 0
        for c in chunks:
            n, end = len(c.tokens), c.start + len(c.tokens)
            if groups[-1] and (rows + n) * (keys + end) > self.max_mask_elements:
                groups.append([])
                rows = keys = 0
            groups[-1].append(c)
            rows, keys = rows + n, keys + end
        return groups

    def _varlen(self, chunks: Sequence) -> np.ndarray | None:
        """One forward over the flattened new tokens of every chunk (the mask keeps requests apart)."""
        dev, bs = self.device, self.block_size
        ids, pos, q_req, k_pos, k_req, tables, rows, n = [], [], [], [], [], [], [], 0
        for i, c in enumerate(chunks):
            end = c.start + len(c.tokens)
            ids += c.tokens
            pos.append(torch.arange(c.start, end))
            q_req.append(torch.full((len(c.tokens),), i))
            k_pos.append(torch.arange(end))
            k_req.append(torch.full((end,), i))
            tables.append(torch.tensor(self.tables[c.slot], dtype=torch.long))
            n += len(c.tokens)
            if c.logits:
                rows += range(n - _n_logits(c), n)
        keys = torch.cat([t[p // bs] * bs + p % bs for t, p in zip(tables, k_pos)])
        slots = torch.cat([t[p // bs] * bs + p % bs for t, p in zip(tables, pos)])
        pos_t, kp, qr, kr = (torch.cat(x).to(dev) for x in (pos, k_pos, q_req, k_req))
        mask = ((qr[:, None] == kr[None, :]) & (kp[None, :] <= pos_t[:, None]))[None, None]
        view = StepView(self.pool, slots.to(dev), keys=keys.to(dev))
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)[None]
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        t0 = time.perf_counter()
        logits = self.model.forward(ids_t, pos_t[None], view, seqs=None, n_attn=keys.shape[0], mask=mask,
                                    out_rows=rows_t)
        self._sync()
        self.forward_seconds += time.perf_counter() - t0
        self.forwards += 1
        return _to_host(logits) if rows else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- checks ---------------------------------------------------------------
    def _check(self, chunks: Sequence) -> None:
        check_chunks(chunks, self.n_slots, self.n_vocab, self.max_model_len,
                     "use a larger max_model_len or a shorter request")
        for c in chunks:
            end = c.start + len(c.tokens)
            if self.external:
                blocks = tuple(getattr(c, "blocks", ()) or ())
                if len(blocks) * self.block_size < end:
                    raise ValueError(
                        f"slot {c.slot}: its block table has {len(blocks)} blocks of {self.block_size} tokens "
                        f"({len(blocks) * self.block_size} positions) but the chunk writes positions "
                        f"{c.start}..{end - 1}: the block manager's tables and this executor disagree (is "
                        f"Chunk.blocks filled, and do both use blocks of {self.block_size} tokens?)")
                bad = [b for b in blocks if not 0 <= b < self.pool.num_blocks]
                if bad:
                    raise ValueError(f"slot {c.slot}: block ids {bad} lie outside the pool's {self.pool.num_blocks} "
                                     f"blocks: the block manager has more blocks than the pool")
                if c.start < self.lens[c.slot]:
                    raise ValueError(f"slot {c.slot} holds {self.lens[c.slot]} tokens; a chunk cannot start "
                                     f"at {c.start}")
            elif c.start != self.lens[c.slot]:   # own tables: a chunk's blocks (if any) are not read
                raise ValueError(f"slot {c.slot} holds {self.lens[c.slot]} tokens; a chunk cannot start at {c.start}")

    def _check_slot(self, slot: int) -> None:
        check_slot(slot, self.n_slots)


def _n_logits(c) -> int:
    """Logits rows a chunk asks for (chunk-likes without ``n_logits`` ask for one)."""
    return getattr(c, "n_logits", 1) if c.logits else 0
