"""The llama.cpp executor: many sequences in one context, one ``llama_decode`` per step.

One llama.cpp context holds ``n_slots`` sequence ids.  A KV cell stores one
token's K/V rows and the set of sequence ids that attend to it.  Two layouts:

* ``unified`` (the default, ``kv_unified``): one stream of ``n_cells`` cells
  that every sequence draws from.  ``copy(src, dst, n)`` is
  ``llama_memory_seq_cp``: the cells of positions [0, n) of ``src`` gain the id
  ``dst``; nothing is recomputed and no bytes move, so a shared prefix of P
  tokens with private tails t_i holds P + sum(t_i) cells, not sum(P + t_i).
* per-slot streams (``unified=False``): slot s owns its own ``n_cells / n_slots``
  cells; ``copy`` is llama.cpp's stream copy (the bytes of the whole stream,
  then the tail dropped), so a copied prefix is stored twice.

Either way a step is one batch whose rows carry (token, position, sequence id,
wants logits), all chunks in one ``llama_decode`` (split only past ``n_batch``
tokens or ``n_outputs_max`` logit rows); ``drop(slot, start)`` is
``llama_memory_seq_rm``.  ``cells_used()`` is llama.cpp's own count of non-empty
cells, read from its sequence-state serialisation for ``seq_id = -1`` (every cell):

    u32 io_magic 0xaf143cd8 | i32 seq_id | u32 n_stream
    | per stream: u32 cell_count | cell_count x (i32 pos, u32 n_seq, n_seq x i32 seq_id)
                  | u32 v_trans | u32 n_layer | K rows per layer | V rows per layer

Sequence ids need not all be running requests: the server gives the context
``--parallel`` + parked ids (``n_seq_max``; a unified cache's size does not
depend on it), and a finished request's sequence stays *parked* with its
prompt's whole blocks, evictable, so a later prompt with the same prefix is a
``copy`` from it (serve/engine.py).  Parking cuts a sequence's tail
(``drop(slot, start)``), which recurrent and hybrid models cannot do:
``drops_tail`` is False for them.

Short rows go in a call of their own (``split_short``, CPU with flash attention):
ggml's CPU flash attention computes 64 query rows at a time once a ubatch has 64
or more, and skips a tile of 64 KV cells only when every row of the query tile
masks it.  A decode row of another sequence inside a prefill's query tile makes
that tile attend to the union of both sequences' cells: 7 decodes (of slots
holding 302 tokens each) beside a 302-token prefill added 93 ms to its 639 ms in
one ubatch, 43 ms in a call of their own (2 threads; benchmarks/results/
serve_split_cpu.txt).  Chunks under 64 tokens are
decoded first in a call of fewer rows (the one-row kernel, each row over its own
cells, as in a decode-only step) while they total under 64 rows (64+ decodes,
or decodes with lookup drafts at many slots, take the tiled kernel in their own
call); the long chunks follow in their own call.  Not with ``n_ubatch`` < 64
(every ubatch takes the one-row kernel anyway) nor on a recurrent model.

A step either appends every chunk or, on any error (no free cells:
:class:`~localinfer.errors.ContextFullError`; Ctrl-C), leaves every slot as it was.

Batch invariance (llama.cpp's CPU kernels, embedded model; tests/serve and
benchmarks/serving.py): a token's logits inside a batch equal its logits alone
bit for bit when its attention runs the same kernel over the same cells in the
same order.  Per-slot streams lay each slot's cells out as a solo context does:
exact at 1 and 2 threads, flash attention on or off (a slot as large as the
solo context).  Two things still part them:

* the kernel: ggml's flash attention takes a one-row kernel (f16 running sum)
  for fewer than 64 query rows of a stream in a ubatch and a tiled float32 one
  for 64 or more, so prompts of 64+ tokens prefilled alongside others (llama.cpp
  splits such a batch into equal shares per sequence) differ by up to ~0.8 from
  a solo prefill; with ``n_ubatch`` < 64 on both sides every row takes the
  one-row kernel and they are equal again.  Decodes beside a long prefill are
  exact with ``split_short`` (their own call: the one-row kernel); inside the
  prefill's ubatch they differed by 0.47-0.90 from a decode-only step;
* a unified cache: attention spans every slot's cells (without flash attention
  rows then differ by ~1.1), and a sequence's cells leave position order once
  llama.cpp reuses a freed cell below them (it searches free cells from a
  moving head and wraps); measured, 2 of 8 greedy 32-token replies stayed
  identical with 4 slots refilled.
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from collections.abc import Sequence
from typing import Self

import llama_cpp as _L
import numpy as np

from localinfer.backends.engine import LoadPlan
from localinfer.backends.executor import Chunk, check_chunks, check_slot
from localinfer.backends.llamacpp import native
from localinfer.backends.llamacpp.engine import ABORT_MIN_TOKENS, LlamaCppEngine
from localinfer.errors import ContextFullError, LocalinferError, UnsupportedModelError

IO_MAGIC = 0xAF143CD8           # llama_context's state_seq_write_data header
FA_TILE_ROWS = 64               # ggml-cpu's GGML_FA_TILE_Q: ubatches of at least this many rows use the tiled kernel
_HEADER = struct.Struct("<IiI")   # magic, seq_id, n_stream


class LlamaCppExecutor:
    """The :class:`~localinfer.backends.executor.Executor` contract on one llama.cpp context.

    ``engine`` is the underlying :class:`LlamaCppEngine` (tokenizer, EOS ids,
    memory figures); do not evaluate through it while the executor is in use.
    ``decode_seconds`` and ``steps`` add up the time spent inside
    ``llama_decode`` and the steps taken (step overhead = wall time - decode time).
    """

    verifies_drafts = True      # honours Chunk.n_logits (several logits rows of one chunk); not on recurrent models

    def __init__(self, plan: LoadPlan):
        self.unified = bool(plan.options.get("kv_unified", True))
        self.engine = LlamaCppEngine(plan.with_(options={**plan.options, "kv_unified": self.unified}))
        ctx = self.engine.context
        self._mem = self.engine.kv_memory
        self.n_slots = plan.n_seq
        self.n_vocab = self.engine.n_vocab
        self.n_cells = int(_L.llama_n_ctx(ctx))            # all cells of the context
        self.slot_cells = int(_L.llama_n_ctx_seq(ctx))     # the most one slot can hold
        self.n_batch = plan.n_batch
        self.n_outputs_max = native.outputs_cap(plan)
        self._ext_bytes = 8 if _L.llama_model_rope_type(self.engine.model_handle) in _MROPE else 0
        model = self.engine.model_handle
        self.drops_tail = not (_L.llama_model_is_recurrent(model) or _L.llama_model_is_hybrid(model))
        self.verifies_drafts = self.drops_tail     # rejected drafts are cut with a partial seq_rm
        on_cpu = plan.n_gpu_layers == 0 or not _L.llama_supports_gpu_offload()
        self.split_short = (on_cpu and plan.flash_attn is not False and min(plan.n_ubatch, plan.n_batch) >= FA_TILE_ROWS
                            and not _L.llama_model_is_recurrent(model))   # short chunks in a call of their own
        self._len = [0] * self.n_slots
        self._state = np.zeros(0, dtype=np.uint8)
        self.decode_seconds = 0.0
        self.steps = 0

    @classmethod
    def open(cls, model: str | os.PathLike, *, n_slots: int = 8, n_ctx: int = 2048, threads: int | None = None,
             flash_attn: bool | None = True, unified: bool = True, n_batch: int = 512, n_ubatch: int = 512,
             type_k: str = "f16", type_v: str = "f16", n_gpu_layers: int = -1, **options) -> LlamaCppExecutor:
        """An executor over ``n_ctx`` KV cells for ``n_slots`` sequences (shared, or n_ctx / n_slots each)."""
        return cls(LoadPlan(os.fspath(model), n_ctx=n_ctx, n_seq=n_slots, n_threads=threads, flash_attn=flash_attn,
                            n_batch=n_batch, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v,
                            n_gpu_layers=n_gpu_layers, options={**options, "kv_unified": unified}))

    # ---- the contract ---------------------------------------------------------
    def step(self, chunks: Sequence[Chunk]) -> dict[int, np.ndarray]:
        """Append every chunk (one ``llama_decode``, two with ``split_short``, more past n_batch / n_outputs_max);
        logits rows by slot."""
        self._alive()
        self._check_chunks(chunks)
        if not chunks:
            return {}
        groups = self._groups(chunks)
        got: dict[int, list[np.ndarray]] = {}
        try:
            for rows in groups:
                for slot, row in self._decode(rows):
                    got.setdefault(slot, []).append(row)
        except ContextFullError as exc:
            self._rollback(chunks)
            need = sum(len(c.tokens) for c in chunks)
            free = self.n_cells - self.cells_used()
            where = "the KV cache has" if self.unified else f"the {self.n_slots} slots' own KV streams have"
            raise ContextFullError(f"{where} {free} free cells of {self.n_cells}; this step needs {need}",
                                   needed=need, available=free,
                                   hint="admit fewer requests, preempt one, or use a larger --ctx") from exc
        except BaseException:
            self._rollback(chunks)
            raise
        for c in chunks:
            self._len[c.slot] = c.start + len(c.tokens)
        self.steps += 1
        return {c.slot: got[c.slot][0] if c.n_logits == 1 else np.stack(got[c.slot]) for c in chunks if c.logits}

    def copy(self, src: int, dst: int, n_tokens: int) -> None:
        """Slot ``dst`` (empty) shares positions [0, n_tokens) of ``src``: llama_memory_seq_cp, no recompute."""
        self._alive()
        self._check_slot(src)
        self._check_slot(dst)
        if src == dst:
            raise ValueError(f"copy needs two different slots, got {src} twice")
        if self._len[dst]:
            raise ValueError(f"slot {dst} holds {self._len[dst]} tokens; drop it before copying into it")
        if not 0 <= n_tokens <= self._len[src]:
            raise ValueError(f"slot {src} holds {self._len[src]} tokens; cannot share {n_tokens}")
        if n_tokens and self.unified:
            _L.llama_memory_seq_cp(self._mem, src, dst, 0, n_tokens)
        elif n_tokens:   # across streams llama.cpp copies whole streams only
            _L.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
            _L.llama_memory_seq_rm(self._mem, dst, n_tokens, -1)
        self._len[dst] = n_tokens

    def drop(self, slot: int, start: int = 0) -> None:
        """Forget positions >= start of ``slot`` (llama_memory_seq_rm); cells no slot holds become free."""
        self._alive()
        self._check_slot(slot)
        if start < 0:
            raise ValueError(f"drop start must be >= 0, got {start}")
        if start < self._len[slot]:
            if not _L.llama_memory_seq_rm(self._mem, slot, start, -1):
                raise LocalinferError(f"llama.cpp cannot drop positions >= {start} of slot {slot} for this model",
                                      hint="recurrent models can only drop whole sequences")
            self._len[slot] = start

    def cells_used(self) -> int:
        """KV cells holding a token of any slot, as llama.cpp counts them (copies the used cells' rows once)."""
        return len(self.cells())

    def clock(self) -> float:
        return time.perf_counter()

    # ---- inspection -----------------------------------------------------------
    def slot_len(self, slot: int) -> int:
        """Tokens slot holds, as llama.cpp reports it (pos_max + 1)."""
        self._alive()
        self._check_slot(slot)
        return int(_L.llama_memory_seq_pos_max(self._mem, slot)) + 1

    def cells(self) -> list[tuple[int, tuple[int, ...]]]:
        """Every non-empty cell, stream by stream in cache order: (position, slots holding it)."""
        return parse_kv_state(self._state_blob(), self.n_slots, self._ext_bytes)

    # ---- internals ------------------------------------------------------------
    def _groups(self, chunks: Sequence[Chunk]) -> list[list[tuple[int, int, int, bool]]]:
        """The step's llama_decode calls: short chunks first on their own when they would share a tiled ubatch."""
        if self.split_short:
            short = [c for c in chunks if len(c.tokens) < FA_TILE_ROWS]
            if short and len(short) < len(chunks):
                long = [c for c in chunks if len(c.tokens) >= FA_TILE_ROWS]
                return (_pack(short, self.n_batch, self.n_outputs_max)
                        + _pack(long, self.n_batch, self.n_outputs_max))
        return _pack(chunks, self.n_batch, self.n_outputs_max)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[tuple[int, np.ndarray]]:
        eng = self.engine
        tokens, pos, seqs, want = zip(*rows)
        eng.fill_batch(tokens, pos, seqs, want)
        t0 = time.perf_counter()
        try:
            eng.decode_batch(len(rows), abortable=len(rows) >= ABORT_MIN_TOKENS)
        finally:
            self.decode_seconds += time.perf_counter() - t0
        at = [i for i, w in enumerate(want) if w]
        if not at:
            return []
        logits = eng.logit_rows(at)
        return [(seqs[i], logits[k]) for k, i in enumerate(at)]

    def _rollback(self, chunks: Sequence[Chunk]) -> None:
        for c in chunks:
            _L.llama_memory_seq_rm(self._mem, c.slot, c.start, -1)

    def _check_chunks(self, chunks: Sequence[Chunk]) -> None:
        check_chunks(chunks, self.n_slots, self.n_vocab, self.slot_cells, "use a larger --ctx or a shorter request")
        for c in chunks:
            if c.start != self._len[c.slot]:
                raise ValueError(f"slot {c.slot} holds {self._len[c.slot]} tokens; a chunk cannot start at {c.start}")

    def _check_slot(self, slot: int) -> None:
        check_slot(slot, self.n_slots)

    def _state_blob(self) -> memoryview:
        self._alive()
        ctx = self.engine.context
        n = int(_L.llama_state_seq_get_size(ctx, -1))
        if self._state.size < n:
            self._state = np.zeros(n, dtype=np.uint8)
        ptr = self._state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if _L.llama_state_seq_get_data(ctx, ptr, n, -1) != n or n < _HEADER.size:
            raise LocalinferError("llama.cpp did not serialise its KV state", hint="rerun with LOCALINFER_LLAMA_LOG=1")
        return memoryview(self._state)[:n]

    def _alive(self) -> None:
        if getattr(self.engine, "_ctx", None) is None:
            raise LocalinferError("this executor is closed")

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_MROPE = {getattr(_L, n) for n in ("LLAMA_ROPE_TYPE_MROPE", "LLAMA_ROPE_TYPE_IMROPE", "LLAMA_ROPE_TYPE_VISION")
          if hasattr(_L, n)}


def parse_kv_state(blob, n_seq_max: int, ext_bytes: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    """(position, sequence ids) of every cell in a ``llama_state_seq_get_data(ctx, .., -1)`` blob.

    ``ext_bytes``: the per-cell extra position llama.cpp writes for M-RoPE models (8), else 0.
    """
    magic, _seq, n_stream = _HEADER.unpack_from(blob)
    if magic != IO_MAGIC or not 0 < n_stream <= max(n_seq_max, 1):
        raise UnsupportedModelError(f"llama.cpp's KV state has an unexpected header (magic {magic:#x}, "
                                    f"{n_stream} streams)", hint="this llama-cpp-python may be too new or old")
    out, off = [], _HEADER.size
    for _ in range(n_stream):
        (count,), off = struct.unpack_from("<I", blob, off), off + 4
        for _ in range(count):
            pos, n_seq = struct.unpack_from("<iI", blob, off)
            off += 8 + ext_bytes
            if not 0 < n_seq <= n_seq_max:
                raise UnsupportedModelError(f"llama.cpp's KV state lists a cell with {n_seq} sequences",
                                            hint="this llama-cpp-python may be too new or old")
            out.append((pos, struct.unpack_from(f"<{n_seq}i", blob, off)))
            off += 4 * n_seq
        if count:
            off = _skip_rows(blob, off, count)
    return out


def _skip_rows(blob, off: int, count: int) -> int:
    """Past one stream's K and V rows: per layer (i32 type, u64 row bytes, rows) for K, the same for V,
    or (i32 type, u32 element bytes, u32 row width, elements) for a transposed V."""
    v_trans, n_layer = struct.unpack_from("<II", blob, off)
    off += 8
    for _ in range(n_layer):
        _t, row = struct.unpack_from("<iQ", blob, off)
        off += 12 + row * count
    for _ in range(n_layer):
        if v_trans:
            _t, el, width = struct.unpack_from("<iII", blob, off)
            off += 12 + el * width * count
        else:
            _t, row = struct.unpack_from("<iQ", blob, off)
            off += 12 + row * count
    return off


def _pack(chunks: Sequence[Chunk], n_batch: int, n_outputs: int) -> list[list[tuple[int, int, int, bool]]]:
    """Rows (token, position, slot, wants logits) in groups of <= n_batch rows and <= n_outputs logit rows.

    Rows keep the order of the chunks; a step within both limits is one group
    (one ``llama_decode``), and a long chunk may straddle two groups.
    """
    groups: list[list[tuple[int, int, int, bool]]] = [[]]
    outs = 0
    for c in chunks:
        last = len(c.tokens) - 1
        for i, t in enumerate(c.tokens):
            w = c.logits and i > last - c.n_logits
            if len(groups[-1]) == n_batch or (w and outs == n_outputs):
                groups.append([])
                outs = 0
            groups[-1].append((int(t), c.start + i, c.slot, w))
            outs += w
    return groups
