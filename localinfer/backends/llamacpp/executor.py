"""The llama.cpp executor: many sequences in one context, one ``llama_decode`` per step.

One context holds ``n_slots`` sequence ids over ``n_cells`` KV cells, in one stream (``unified``, the default:
``copy`` is ``llama_memory_seq_cp``, a shared prefix held once; on the CPU ``compact`` lays each sequence's cells in
one run again, compaction.py) or a stream per slot (``unified=False``: each slot's cells laid out as a solo
context's, where a token is computed exactly as alone).  A step is one batch of every chunk (split only past
``n_batch`` tokens or ``n_outputs_max`` logit rows, and short rows first in a call of their own: ``split_short``);
``drop`` is ``llama_memory_seq_rm``; ``cells_used`` is llama.cpp's own count.  A step appends every chunk or none.

On a recurrent or hybrid model (``snapshots``) a slot's recurrent state is saved to host memory (``snapshot``:
llama.cpp's partial sequence state, ``seq_state.py``) and a slot taken back to one (``rewind``), so its tail can be
cut at a saved position; a rejected lookup draft rolls back that way too (the state before the verify restored, the
accepted tokens computed again).

Ids beyond the running requests park finished requests' KV for prefix hits (``drops_tail``; on a recurrent or hybrid
model cut back to a snapshot); with ``park_host`` a parked slot's KV moves to host memory
(``llama_state_seq_get_data``) and is written back on a hit.  ``interrupt`` stops the step in flight: llama.cpp's
abort callback, read between graph nodes, ends the ``llama_decode`` (status 2; llama.cpp drops the aborted ubatch's
positions) and the step drops the rest of its chunks'.  docs/executor.md explains each choice with its measurements.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Self

import llama_cpp as _L
import numpy as np

from localinfer.backends.engine import LoadPlan
from localinfer.backends.executor import Chunk, ExecutorBase, SeqState, check_chunks, check_slot, pack_rows
from localinfer.backends.llamacpp import aside, native, seq_state
from localinfer.backends.llamacpp.aside_plan import FA_TILE_ROWS
from localinfer.backends.llamacpp.compaction import CompactionError, CompactPolicy, Shares, compact
from localinfer.backends.llamacpp.engine import ABORT_MIN_TOKENS, LlamaCppEngine
from localinfer.backends.llamacpp.kv_state import CELL_EXT_BYTES, cut_seq_state, layout_known, parse_kv_state
from localinfer.errors import ContextFullError, LocalinferError
from localinfer.util.hostmem import host_cache_budget

FILL_BYTES = 1 << 30        # the most KV state ``fill`` writes, within half the host budget (70B's f16 KV: 3,276)


class LlamaCppExecutor(ExecutorBase):
    """The :class:`~localinfer.backends.executor.Executor` contract on one llama.cpp context.  ``engine`` is the
    underlying :class:`LlamaCppEngine` (tokenizer, EOS ids, memory figures; evaluate nothing through it meanwhile);
    ``decode_seconds`` and ``steps`` add up the time inside ``llama_decode`` and the steps taken."""

    verifies_drafts = True      # honours Chunk.n_logits (several logits rows of one chunk); not on recurrent models
    interrupts_steps = True     # a graph on the CPU stops at its next node; elsewhere before the next llama_decode

    def __init__(self, plan: LoadPlan, *, park_host: bool = False, host_budget: int | None = None,
                 lend_rows: bool = False):
        self.unified = bool(plan.options.get("kv_unified", True))
        self.engine = LlamaCppEngine(plan.with_(options={**plan.options, "kv_unified": self.unified}))
        self._aside: aside.PrefillAside | None = None    # a lone prompt beside running sequences computed apart
        ctx = self.engine.context
        self._mem = self.engine.kv_memory
        self.n_slots = plan.n_seq
        self.n_vocab = self.engine.n_vocab
        self.n_cells = int(_L.llama_n_ctx(ctx))            # all cells of the context
        self.slot_cells = int(_L.llama_n_ctx_seq(ctx))     # the most one slot can hold
        self.n_batch = plan.n_batch
        self.n_outputs_max = native.outputs_cap(plan)
        # llama_kv_cell_ext (x, y, tok: 12 bytes) follows each cell's (pos, n_seq) for M-RoPE models
        self._ext_bytes = CELL_EXT_BYTES if _L.llama_model_rope_type(self.engine.model_handle) in _MROPE else 0
        model = self.engine.model_handle
        self.drops_tail = not (_L.llama_model_is_recurrent(model) or _L.llama_model_is_hybrid(model))
        self.snapshots = not self.drops_tail       # a recurrent state is saved and restored instead of cut
        # rejected drafts: a partial seq_rm, or (recurrent) the state before the verify restored and the kept replayed
        self.verifies_drafts = True
        self._verify: dict[int, tuple[SeqState, tuple[int, ...]]] = {}   # slot -> state before its verify, tokens
        self._lost: set[int] = set()     # slots a failed step left with a state past their length (recurrent)
        on_cpu = plan.n_gpu_layers == 0 or not (native.local_accelerator() or plan.options.get("rpc"))
        whole = plan.n_gpu_layers < 0 or plan.n_gpu_layers > int(_L.llama_model_n_layer(model))   # output layer too
        self.cpu_threads = 0 if not on_cpu and whole else plan.threads    # a layer on the CPU keeps its threads busy
        self.split_short = (on_cpu and plan.flash_attn is not False and min(plan.n_ubatch, plan.n_batch) >= FA_TILE_ROWS
                            and not _L.llama_model_is_recurrent(model))   # short chunks in a call of their own
        self._len = [0] * self.n_slots
        # a state this can cut: one unified stream, no sliding window (masked cells left out), no per-cell extension
        self.parks_in_host = (park_host and self.drops_tail and self.unified and not self._ext_bytes
                              and int(_L.llama_model_n_swa(model)) == 0)
        # each sequence's cells in one run now and then (compaction.py): one unified stream on the CPU, no SWA or M-RoPE
        self._cell_bytes = self.engine.memory()["kv"] // max(1, self.n_cells)    # one cell's K and V, all layers
        self.compaction = CompactPolicy(on_cpu and self.drops_tail and self.unified and not self._ext_bytes
                                        and int(_L.llama_model_n_swa(model)) == 0 and self._cell_bytes > 0)
        self._shared = Shares()
        self._host: dict[int, np.ndarray] = {}         # slot -> its KV blob (llama_state_seq_get_data), cells freed
        self._saved: dict[int, int] = {}               # slot -> positions its blob holds (drop cuts _len only)
        self.host_budget = host_budget     # bytes of parked KV in host memory (None: HOST_PARK_MAX or half the free RAM)
        self.position_bytes = 0            # bytes one more position adds to a parked state (the probe measures it)
        self.decode_seconds, self.steps = 0.0, 0
        self.lend_rows = lend_rows         # step's one-token rows are llama.cpp's buffer, read before the next call
        self._flight = threading.Lock()    # step() in flight or not, and the interrupt flag, change together
        self._stepping = False
        self._interrupt_asked = False      # interrupt() before this step reached llama_decode
        try:
            if self.parks_in_host:     # decided now, before an engine sizes its cache on it: a two-token probe
                self.step([Chunk(0, (1, 1), 0)])
                two = int(_L.llama_state_seq_get_size(self.engine.context, 0))
                blob = seq_state.read_cells(self.engine.context, 0, two)
                self.parks_in_host = blob is not None and layout_known(blob, self._len[0])   # for good
                self.drop(0, 1)
                self.position_bytes = two - int(_L.llama_state_seq_get_size(self.engine.context, 0))
                self.drop(0)
            if self.snapshots:         # one state's bytes (whatever the positions held): a one-token probe
                self.step([Chunk(0, (1,), 0)])
                self.state_bytes = seq_state.size(self.engine.context, 0)
                self.drop(0)
            self._aside = aside.for_executor(self, model, plan, FA_TILE_ROWS)    # None unless asked and safe
        except BaseException:
            self.close()
            raise
        self.steps, self.decode_seconds = 0, 0.0

    @classmethod
    def open(cls, model: str | os.PathLike, *, n_slots: int = 8, n_ctx: int = 2048, threads: int | None = None,
             flash_attn: bool | None = True, unified: bool = True, n_batch: int = 512, n_ubatch: int = 512,
             type_k: str = "f16", type_v: str = "f16", n_gpu_layers: int = -1, park_host: bool = False,
             host_budget: int | None = None, **options) -> LlamaCppExecutor:
        """An executor over ``n_ctx`` KV cells for ``n_slots`` sequences (shared, or n_ctx / n_slots each)."""
        return cls(LoadPlan(os.fspath(model), n_ctx=n_ctx, n_seq=n_slots, n_threads=threads, flash_attn=flash_attn,
                            n_batch=n_batch, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v,
                            n_gpu_layers=n_gpu_layers, options={**options, "kv_unified": unified}),
                   park_host=park_host, host_budget=host_budget)

    @property
    def vocab(self) -> LlamaCppEngine:
        """The tokenizer: the underlying engine."""
        return self.engine

    # ---- the contract ---------------------------------------------------------
    def step(self, chunks: Sequence[Chunk]) -> dict[int, np.ndarray]:
        """Append every chunk (one ``llama_decode``, two with ``split_short``, more past n_batch / n_outputs_max);
        logits rows by slot (with ``lend_rows`` a one-row chunk's from the step's last llama_decode is a read-only view
        that the next step rewrites)."""
        self._alive()
        self._check_chunks(chunks)
        if not chunks:
            return {}
        groups = self._groups(chunks)
        got: dict[int, list[np.ndarray]] = {}
        spent = self.decode_seconds
        if self.snapshots:     # a verify's state before it, to roll a rejected draft back to
            for c in chunks:
                self._verify.pop(c.slot, None)
                if c.logits and c.n_logits > 1:
                    self._verify[c.slot] = (self.snapshot(c.slot), c.tokens)
        live = lambda: sum(n for s, n in enumerate(self._len) if s not in self._host) * self._cell_bytes  # noqa: E731
        # a shared or lost slot blocks compact(): not asked, so a blocked compaction costs a step nothing
        if not (self._interrupt_asked or self._shared or self._lost) and self.compaction.due(live, self._budget):
            self.compact()
        with self._flight:
            self._stepping = True
            if self._interrupt_asked:     # asked while the chunks were checked: stop at the first graph node
                self.engine.interrupt()
        try:
            for k, rows in enumerate(groups):     # a lent row is only the last call's: the next call rewrites it
                for slot, row in self._decode(rows, lend=self.lend_rows and k == len(groups) - 1):
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
        finally:
            with self._flight:
                self._stepping = self._interrupt_asked = False
                self.engine.clear_interrupt()     # one that came too late to stop this step stops no other
        for c in chunks:
            self._len[c.slot] = c.start + len(c.tokens)
        self.steps += 1
        self.compaction.stepped(len({c.slot for c in chunks}), self.decode_seconds - spent)
        return {c.slot: got[c.slot][0] if c.n_logits == 1 else np.stack(got[c.slot]) for c in chunks if c.logits}

    def copy(self, src: int, dst: int, n_tokens: int, *, append: bool = False) -> int:
        """Slot ``dst`` (empty) shares positions [0, n_tokens) of ``src``: llama_memory_seq_cp, no recompute.

        ``append`` (a unified cache): dst already holds a prefix ``have`` of the same tokens, shared from another
        slot, and gets [have, n_tokens) of src.  From a slot parked in host memory the positions are written back
        into fresh cells.  Returns the tokens dst now holds: ``n_tokens``, or ``have`` when llama.cpp found no
        cells for a write-back (compute the rest)."""
        self._alive()
        self._check_slot(src, dst)
        if src == dst:
            raise ValueError(f"copy needs two different slots, got {src} twice")
        if dst in self._host:
            raise ValueError(f"slot {dst} is parked in host memory; drop it before copying into it")
        have = self._len[dst]
        if have and not (append and self.unified):
            raise ValueError(f"slot {dst} holds {have} tokens; drop it before copying into it"
                             + ("" if self.unified else " (per-slot streams cannot append a copy)"))
        if not have <= n_tokens <= self._len[src]:
            raise ValueError(f"slot {src} holds {self._len[src]} tokens and slot {dst} {have}; "
                             f"cannot share up to {n_tokens}")
        if n_tokens == have:
            return have
        if src in self._host:
            if not self._write_back(src, dst, have, n_tokens):
                return have
        elif self.unified:
            _L.llama_memory_seq_cp(self._mem, src, dst, have, n_tokens)
            self._shared.add(src, dst)
        else:   # across streams llama.cpp copies whole streams only
            _L.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
            _L.llama_memory_seq_rm(self._mem, dst, n_tokens, -1)
        self._len[dst] = n_tokens
        return n_tokens

    def park(self, slot: int) -> bool | None:
        """With ``park_host``: move ``slot``'s KV to host memory and free its cells (a later ``copy`` from it
        writes positions back; ``drop`` forgets them).  True when it is there; otherwise its cells stay: False
        when it does not fit beside the parked states (giving some up would make room), None when it never will
        (over the whole ``host_budget``, unreadable) or without ``park_host``."""
        self._alive()
        self._check_slot(slot)
        if not self.parks_in_host:
            return None
        if slot in self._host or not self._len[slot]:
            return True
        n = int(_L.llama_state_seq_get_size(self.engine.context, slot))
        budget = self._budget()
        if n > budget:
            return None
        if self._host_bytes() + n > budget:
            self._cut_dropped_tails()
            if self._host_bytes() + n > budget:
                return False
        blob = seq_state.read_cells(self.engine.context, slot, n)
        if blob is None:
            return None
        _L.llama_memory_seq_rm(self._mem, slot, -1, -1)
        self._host[slot], self._saved[slot] = blob, self._len[slot]
        self._freed(slot)
        return True

    def fill(self, src: int, dst: int, n_tokens: int) -> int:
        """Empty ``dst`` gets up to ``n_tokens`` positions repeating ``src``'s K and V, nothing computed (calibration's
        wide view, never text; FILL_BYTES at most, and half the host budget: tiling holds it twice).  How many."""
        self._alive()
        self._check_slot(src, dst)
        n = min(n_tokens, min(FILL_BYTES, self._budget() // 2) // max(1, self.position_bytes))
        if (not self.parks_in_host or self._len[dst] or not self._len[src] or n <= self._len[src]
                or {src, dst} & self._host.keys() or not seq_state.write_tiled(self.engine.context, src, dst, n)):
            return 0
        self._len[dst] = n
        return n

    def host_cells(self) -> int:
        """Positions the host budget holds, parked states' fixed headers aside (0 without ``parks_in_host``):
        how far an engine's cache may reach past the cells."""
        return self._budget() // self.position_bytes if self.parks_in_host and self.position_bytes > 0 else 0

    def host_tokens(self) -> int:
        """Positions parked in host memory (not in any cell)."""
        return sum(self._len[s] for s in self._host)

    def _host_bytes(self) -> int:
        return sum(b.size for b in self._host.values())

    def _cut_dropped_tails(self) -> None:
        """Cut the saved states that hold positions ``drop`` gave up (it only shortens a host slot)."""
        for s, blob in self._host.items():
            if self._saved[s] > self._len[s]:
                self._host[s], self._saved[s] = cut_seq_state(blob, 0, self._len[s])[0], self._len[s]

    def _budget(self) -> int:
        return self.host_budget if self.host_budget is not None else host_cache_budget()

    def drop(self, slot: int, start: int = 0) -> None:
        """Forget positions >= start of ``slot`` (llama_memory_seq_rm); cells no slot holds become free."""
        self._alive()
        self._check_slot(slot)
        if start < 0:
            raise ValueError(f"drop start must be >= 0, got {start}")
        if slot in self._host:       # no cells: positions < start stay wanted; the blob is cut when written back
            if not start:
                del self._host[slot], self._saved[slot]
            self._len[slot] = min(self._len[slot], start)
            return
        verify = self._verify.pop(slot, None)
        if start and verify is not None and verify[0].n_tokens <= start < self._len[slot]:
            state, tokens = verify       # a verify's rejected tail: back to before it, the kept tokens again
            self.rewind(slot, state)
            if start > state.n_tokens:
                self.step([Chunk(slot, tokens[:start - state.n_tokens], state.n_tokens)])
            return
        if start < self._len[slot] or slot in self._lost:
            if not _L.llama_memory_seq_rm(self._mem, slot, start, -1):
                raise LocalinferError(f"llama.cpp cannot drop positions >= {start} of slot {slot} for this model",
                                      hint="recurrent models drop whole sequences, or rewind to a snapshot")
            self._len[slot] = start
            self._lost.discard(slot)
            if not start:
                self._freed(slot)

    def rebase(self, dst: int, src: int, n_tokens: int) -> None:
        """``dst``'s first ``n_tokens`` positions become ``src``'s cells (seq_rm, seq_cp); then rewind a recurrent one."""
        self._alive()
        self._check_slot(src, dst)
        if src == dst or not self.unified or {src, dst} & self._host.keys():
            raise ValueError(f"slot {dst} cannot take slot {src}'s cells (one unified cache, both in cells)")
        if not 0 < n_tokens <= min(self._len[src], self._len[dst]) or self.snapshots and n_tokens != self._len[dst]:
            raise ValueError(f"slots {src} and {dst} hold {self._len[src]} and {self._len[dst]} positions; "
                             f"cannot share {n_tokens}")
        if not _L.llama_memory_seq_rm(self._mem, dst, 0, n_tokens):
            raise LocalinferError(f"llama.cpp cannot free positions < {n_tokens} of slot {dst}")
        _L.llama_memory_seq_cp(self._mem, src, dst, 0, n_tokens)
        self._shared.add(src, dst)
        self._verify.pop(dst, None)

    def snapshot(self, slot: int) -> SeqState:
        """``slot``'s recurrent state at the positions it holds, in host memory (llama.cpp's partial state)."""
        self._alive()
        self._check_slot(slot)
        if not self.snapshots:
            raise LocalinferError(f"slot {slot} holds no recurrent state to save (an attention-only model)")
        return seq_state.save(self.engine.context, slot, self._len[slot])

    def rewind(self, slot: int, state: SeqState) -> None:
        """``slot`` back to ``state.n_tokens`` positions: its recurrent state is ``state``, its positions past it gone."""
        self._alive()
        self._check_slot(slot)
        n = state.n_tokens
        if not 0 < n <= self._len[slot] or slot in self._host:
            raise ValueError(f"slot {slot} holds {self._len[slot]} positions; cannot rewind it to {n}")
        self._verify.pop(slot, None)
        try:
            seq_state.restore(self.engine.context, self._mem, slot, state)
        except LocalinferError:
            self._len[slot] = 0         # a refused state leaves the slot cleared
            raise
        self._len[slot] = n
        self._lost.discard(slot)

    def interrupt(self) -> None:
        """Stop the step in flight (any thread): it raises StepInterrupted with every slot as before it; a call
        before it reaches llama_decode stops it there, one after it returned is dropped by ``forget_interrupt``."""
        with self._flight:
            if self._stepping:
                self.engine.interrupt()
            else:
                self._interrupt_asked = True

    def forget_interrupt(self) -> None:
        with self._flight:
            self._interrupt_asked = False

    def cells_used(self) -> int:
        """KV cells holding a token of any slot, as llama.cpp counts them (copies the used cells' rows once); a
        pure recurrent model has none."""
        if _L.llama_model_is_recurrent(self.engine.model_handle):
            return 0
        return len(self.cells())

    clock = staticmethod(time.perf_counter)

    # ---- inspection -----------------------------------------------------------
    def slot_len(self, slot: int) -> int:
        """Tokens slot holds, as llama.cpp reports it (pos_max + 1)."""
        self._alive()
        self._check_slot(slot)
        return int(_L.llama_memory_seq_pos_max(self._mem, slot)) + 1

    def cells(self) -> list[tuple[int, tuple[int, ...]]]:
        """Every non-empty cell, stream by stream in cache order: (position, slots holding it)."""
        self._alive()
        return parse_kv_state(seq_state.whole(self.engine.context), self.n_slots, self._ext_bytes)

    # ---- internals ------------------------------------------------------------
    def _groups(self, chunks: Sequence[Chunk]) -> list[list[tuple[int, int, int, bool]]]:
        """The step's llama_decode calls: short chunks first on their own when they would share a tiled ubatch."""
        if self.split_short:
            short = [c for c in chunks if len(c.tokens) < FA_TILE_ROWS]
            if short and len(short) < len(chunks):
                long = [c for c in chunks if len(c.tokens) >= FA_TILE_ROWS]
                return (pack_rows(short, self.n_batch, self.n_outputs_max)
                        + pack_rows(long, self.n_batch, self.n_outputs_max))
        return pack_rows(chunks, self.n_batch, self.n_outputs_max)

    def _decode(self, rows: list[tuple[int, int, int, bool]], lend: bool = False) -> list[tuple[int, np.ndarray]]:
        eng = self.engine
        if self._aside is not None and (got := self._aside.offer(self, rows, lend)) is not None:
            return got
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
        logits = eng.logit_rows(at, lend=lend)
        return [(seqs[i], logits[k]) for k, i in enumerate(at)]

    @property
    def prefill_aside(self) -> aside.PrefillAside | None:
        """The context lone prompts are computed in (aside.py), for /metrics; None where there is none."""
        return self._aside

    def others_hold_cells(self, slot: int) -> bool:
        """Whether a slot other than ``slot`` holds cells in the context (not parked in host memory)."""
        return any(n and s != slot and s not in self._host for s, n in enumerate(self._len))

    def _rollback(self, chunks: Sequence[Chunk]) -> None:
        for c in chunks:
            if not _L.llama_memory_seq_rm(self._mem, c.slot, c.start, -1):
                self._lost.add(c.slot)     # a recurrent state went past start: only a rewind or a drop mends it

    def _freed(self, slot: int) -> None:
        """``slot`` holds no cells now: the holes it left make a compaction worth its cost (compaction.py)."""
        self._shared.gone(slot)
        self.compaction.freed = True

    def compact(self) -> bool:
        """Every slot holding cells written back in one run each (compaction.py); False where it cannot be (see
        ``compaction.able``), when a cell may be held by two slots, or fewer than two slots hold cells."""
        self._alive()
        live = [s for s in range(self.n_slots) if self._len[s] and s not in self._host]
        if not self.compaction.able or self._shared or self._lost or len(live) < 2:
            return False
        try:
            moved, seconds = compact(self.engine.context, self._mem, live)
        except CompactionError as exc:       # slots lost: no more compaction, and the step fails
            self.compaction.able = False
            for s in exc.slots:
                self._len[s] = 0
            raise
        except (LocalinferError, MemoryError):     # nothing removed yet: the cache as it was, compaction off
            self.compaction.able = False
            return False
        self.compaction.done(seconds, moved)
        return True

    def _check_chunks(self, chunks: Sequence[Chunk]) -> None:
        check_chunks(chunks, self.n_slots, self.n_vocab, self.slot_cells, "use a larger --ctx or a shorter request")
        for c in chunks:
            if c.slot in self._host:
                raise ValueError(f"slot {c.slot} is parked in host memory; drop it before appending to it")
            if c.slot in self._lost:
                raise ValueError(f"slot {c.slot} lost its recurrent state in a failed step; rewind or drop it first")
            if c.start != self._len[c.slot]:
                raise ValueError(f"slot {c.slot} holds {self._len[c.slot]} tokens; a chunk cannot start at {c.start}")

    def _check_slot(self, *slots: int) -> None:
        for slot in slots:
            check_slot(slot, self.n_slots)

    def _write_back(self, src: int, dst: int, lo: int, hi: int) -> bool:
        """Positions [lo, hi) of host-parked ``src`` into fresh cells of ``dst``.  From 0 (dst empty) the state,
        cut to those cells unless it is all of them, is read into dst; past a shared prefix it is read into src's
        (cell-less) id, shared with dst, and src's id taken off again.  False: no free cells, or the state lacks
        some of those positions."""
        if lo == 0 and hi == self._saved[src]:    # the stored state holds exactly [0, hi): no cut
            blob, kept = self._host[src], hi
        else:
            blob, kept = cut_seq_state(self._host[src], lo, hi)
        if kept != hi - lo:
            return False
        into = dst if lo == 0 else src
        if not seq_state.write_cells(self.engine.context, into, blob):
            return False
        if into == src:
            _L.llama_memory_seq_cp(self._mem, src, dst, lo, hi)
            _L.llama_memory_seq_rm(self._mem, src, -1, -1)
        return True

    def _alive(self) -> None:
        if getattr(self.engine, "_ctx", None) is None:
            raise LocalinferError("this executor is closed")

    def close(self) -> None:
        if self._aside is not None:
            self._aside.close()
        self.engine.close()

    def __enter__(self) -> Self:     # ExecutorBase's __exit__ closes it
        return self


_MROPE = {getattr(_L, n) for n in ("LLAMA_ROPE_TYPE_MROPE", "LLAMA_ROPE_TYPE_IMROPE", "LLAMA_ROPE_TYPE_VISION")
          if hasattr(_L, n)}


def open_serving(plan: LoadPlan, *, running: int) -> LlamaCppExecutor:
    """The serving executor (the registry's factory): ``plan.n_seq`` ids over one context; the ids past
    ``running`` park finished requests' KV, in host memory (``park_host``: off the cells every step attends
    over; without parked ids no load-time parking probe runs).  Its rows are lent, not copied: the serving engine
    samples every row of a step before it calls the executor again."""
    return LlamaCppExecutor(plan, park_host=plan.n_seq > running, lend_rows=True)
