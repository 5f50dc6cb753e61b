"""The llama.cpp executor: many sequences in one context, one ``llama_decode`` per step.

One llama.cpp context holds ``n_slots`` sequence ids over a *unified* KV cache
(``kv_unified``: a single stream of ``n_cells`` cells that every sequence draws
from).  A cell stores one token's K/V rows and the set of sequence ids that
attend to it, so

* a step is one batch whose rows carry (token, position, sequence id, wants
  logits); the rows of all chunks go into one ``llama_decode`` (split only when
  they exceed ``n_batch`` tokens or ``n_outputs_max`` logit rows);
* ``copy(src, dst, n)`` is ``llama_memory_seq_cp``: cells of positions [0, n)
  of ``src`` gain the id ``dst``; nothing is recomputed and no bytes move;
* ``drop(slot, start)`` is ``llama_memory_seq_rm``: the id leaves those cells,
  and a cell left with no id is free again;
* ``cells_used()`` is llama.cpp's own count of non-empty cells, read from the
  header of its sequence-state serialisation for ``seq_id = -1`` (every cell):

      u32 io_magic 0xaf143cd8 | i32 seq_id | u32 n_stream (1 here)
      | u32 cell_count | cell_count x (i32 pos, u32 n_seq, n_seq x i32 seq_id) | K/V rows

  so with a shared prefix of P tokens and private tails t_i it reads
  P + sum(t_i), not sum(P + t_i).

A step either appends every chunk or, on any error (no free cells:
:class:`~localinfer.errors.ContextFullError`; Ctrl-C), leaves every slot as it
was before the step.

On a CPU, llama.cpp computes a token's logits bit for bit the same alone and
inside a batch of other sequences only with one thread and flash attention on
(more threads split the matrix products differently per batch shape); see
``tests/serve/test_llamacpp_executor.py``.
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from collections.abc import Sequence

import llama_cpp as _L
import numpy as np

from localinfer.backends.engine import LoadPlan
from localinfer.backends.llamacpp import native
from localinfer.backends.llamacpp.engine import ABORT_MIN_TOKENS, LlamaCppEngine
from localinfer.errors import ContextFullError, LocalinferError, UnsupportedModelError
from localinfer.serve.executor import Chunk

IO_MAGIC = 0xAF143CD8           # llama_context's state_seq_write_data header
_HEADER = struct.Struct("<IiII")  # magic, seq_id, n_stream, cell_count of stream 0


class LlamaCppExecutor:
    """The :class:`~localinfer.serve.executor.Executor` contract on one llama.cpp context.

    ``engine`` is the underlying :class:`LlamaCppEngine` (tokenizer, EOS ids,
    memory figures); do not evaluate through it while the executor is in use.
    ``decode_seconds`` and ``steps`` add up the time spent inside
    ``llama_decode`` and the steps taken (step overhead = wall time - decode time).
    """

    def __init__(self, plan: LoadPlan):
        self.engine = LlamaCppEngine(plan.with_(options={**plan.options, "kv_unified": True}))
        ctx = self.engine._ctx
        self._mem = self.engine._mem
        self.n_slots = plan.n_seq
        self.n_vocab = self.engine.n_vocab
        self.n_cells = int(_L.llama_n_ctx(ctx))
        self.n_batch = plan.n_batch
        self.n_outputs_max = native.outputs_cap(plan)
        self._ext_bytes = 8 if _L.llama_model_rope_type(self.engine._model) in _MROPE else 0
        self._len = [0] * self.n_slots
        self._state = np.zeros(0, dtype=np.uint8)
        self.decode_seconds = 0.0
        self.steps = 0

    @classmethod
    def open(cls, model: str | os.PathLike, *, n_slots: int = 8, n_ctx: int = 2048, threads: int | None = None,
             flash_attn: bool | None = True, n_batch: int = 512, n_ubatch: int = 512, type_k: str = "f16",
             type_v: str = "f16", n_gpu_layers: int = -1, **options) -> LlamaCppExecutor:
        """An executor over ``n_ctx`` KV cells shared by ``n_slots`` sequences."""
        return cls(LoadPlan(os.fspath(model), n_ctx=n_ctx, n_seq=n_slots, n_threads=threads, flash_attn=flash_attn,
                            n_batch=n_batch, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v,
                            n_gpu_layers=n_gpu_layers, options=options))

    # ---- the contract ---------------------------------------------------------
    def step(self, chunks: Sequence[Chunk]) -> dict[int, np.ndarray]:
        """Append every chunk (one ``llama_decode`` unless past n_batch / n_outputs_max); logits rows by slot."""
        self._alive()
        self._check_chunks(chunks)
        if not chunks:
            return {}
        groups = _pack(chunks, self.n_batch, self.n_outputs_max)
        out: dict[int, np.ndarray] = {}
        try:
            for rows in groups:
                out.update(self._decode(rows))
        except ContextFullError as exc:
            self._rollback(chunks)
            need = sum(len(c.tokens) for c in chunks)
            used = self.cells_used()
            raise ContextFullError(f"the KV cache has {self.n_cells - used} free cells of {self.n_cells}; "
                                   f"this step needs {need}", needed=need, available=self.n_cells - used,
                                   hint="admit fewer requests, preempt one, or use a larger --ctx") from exc
        except BaseException:
            self._rollback(chunks)
            raise
        for c in chunks:
            self._len[c.slot] = c.start + len(c.tokens)
        self.steps += 1
        return out

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
        if n_tokens:
            _L.llama_memory_seq_cp(self._mem, src, dst, 0, n_tokens)
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
        magic, _seq, n_stream, count = _HEADER.unpack_from(self._state_blob())
        self._check_header(magic, n_stream)
        return count

    def clock(self) -> float:
        return time.perf_counter()

    # ---- inspection -----------------------------------------------------------
    def slot_len(self, slot: int) -> int:
        """Tokens slot holds, as llama.cpp reports it (pos_max + 1)."""
        self._alive()
        self._check_slot(slot)
        return int(_L.llama_memory_seq_pos_max(self._mem, slot)) + 1

    def cells(self) -> list[tuple[int, tuple[int, ...]]]:
        """Every non-empty cell in cache order: (position, slots holding it), from llama.cpp's state."""
        blob = self._state_blob()
        magic, _seq, n_stream, count = _HEADER.unpack_from(blob)
        self._check_header(magic, n_stream)
        out, off = [], _HEADER.size
        for _ in range(count):
            pos, n_seq = struct.unpack_from("<iI", blob, off)
            off += 8 + self._ext_bytes
            if not 0 < n_seq <= self.n_slots:
                raise LocalinferError(f"llama.cpp's KV state lists a cell with {n_seq} sequences")
            out.append((pos, struct.unpack_from(f"<{n_seq}i", blob, off)))
            off += 4 * n_seq
        return out

    # ---- internals ------------------------------------------------------------
    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> dict[int, np.ndarray]:
        eng = self.engine
        tokens, pos, seqs, want = zip(*rows)
        eng._fill(tokens, pos, seqs, want)
        t0 = time.perf_counter()
        try:
            eng._decode(len(rows), abortable=len(rows) >= ABORT_MIN_TOKENS)
        finally:
            self.decode_seconds += time.perf_counter() - t0
        at = [i for i, w in enumerate(want) if w]
        if not at:
            return {}
        logits = eng._rows(at)
        return {seqs[i]: logits[k] for k, i in enumerate(at)}

    def _rollback(self, chunks: Sequence[Chunk]) -> None:
        for c in chunks:
            _L.llama_memory_seq_rm(self._mem, c.slot, c.start, -1)

    def _check_chunks(self, chunks: Sequence[Chunk]) -> None:
        seen: set[int] = set()
        for c in chunks:
            self._check_slot(c.slot)
            if c.slot in seen:
                raise ValueError(f"slot {c.slot} appears twice in one step")
            seen.add(c.slot)
            if not c.tokens:
                raise ValueError(f"slot {c.slot}: a chunk needs at least one token")
            if c.start != self._len[c.slot]:
                raise ValueError(f"slot {c.slot} holds {self._len[c.slot]} tokens; a chunk cannot start at {c.start}")
            if any(not 0 <= t < self.n_vocab for t in c.tokens):
                raise ValueError(f"slot {c.slot}: token ids must lie in 0..{self.n_vocab - 1}")
            if c.start + len(c.tokens) > self.n_cells:
                raise ContextFullError(f"slot {c.slot}: {c.start + len(c.tokens)} positions exceed the "
                                       f"{self.n_cells} KV cells", needed=c.start + len(c.tokens),
                                       available=self.n_cells, hint="use a larger --ctx or a shorter request")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} outside 0..{self.n_slots - 1}")

    def _state_blob(self) -> memoryview:
        self._alive()
        ctx = self.engine._ctx
        n = int(_L.llama_state_seq_get_size(ctx, -1))
        if self._state.size < n:
            self._state = np.zeros(n, dtype=np.uint8)
        ptr = self._state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if _L.llama_state_seq_get_data(ctx, ptr, n, -1) != n or n < _HEADER.size:
            raise LocalinferError("llama.cpp did not serialise its KV state", hint="rerun with LOCALINFER_LLAMA_LOG=1")
        return memoryview(self._state)[:n]

    def _check_header(self, magic: int, n_stream: int) -> None:
        if magic != IO_MAGIC or n_stream != 1:
            raise UnsupportedModelError(f"llama.cpp's KV state has an unexpected header (magic {magic:#x}, "
                                        f"{n_stream} streams)", hint="this llama-cpp-python may be too new or old")

    def _alive(self) -> None:
        if getattr(self.engine, "_ctx", None) is None:
            raise LocalinferError("this executor is closed")

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LlamaCppExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_MROPE = {getattr(_L, n) for n in ("LLAMA_ROPE_TYPE_MROPE", "LLAMA_ROPE_TYPE_IMROPE", "LLAMA_ROPE_TYPE_VISION")
          if hasattr(_L, n)}


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
            w = c.logits and i == last
            if len(groups[-1]) == n_batch or (w and outs == n_outputs):
                groups.append([])
                outs = 0
            groups[-1].append((int(t), c.start + i, c.slot, w))
            outs += w
    return groups
