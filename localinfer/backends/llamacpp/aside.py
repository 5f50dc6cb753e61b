"""A lone prompt prefilled in a context of its own and copied in: its attention spans its own cells only.

A prompt's ubatch pays per cell of the view for its mask: llama.cpp builds it on the host, and ggml-cpu's tiled
flash attention (ubatches of 64 rows and more) converts and scans it for every query tile and head, skipping a KV
tile only after that scan. So a prompt prefilled into a unified cache beside running sequences pays for their cells.
On a 2-vCPU VM a closed-loop cycle of 300-token prompts and 128-token replies whose prompts go in one at a time
beside the others cost 1.8% more through the executor than the same prompts prefilled together into an emptied cache
(llama-server's waves) at four sequences, 6.2% more at eight (benchmarks/schedule_cycles.py). :class:`PrefillAside`
computes such a prompt in a second context of the same model, one sequence and ``n_batch`` cells, whose cache is
empty, then copies the sequence's state into the serving context (``llama_state_seq_get_data`` /
``llama_state_seq_set_data``, which lays its cells in order) and empties its own cache again: the cycles
then cost 0.996x the waves' at both. A solo run computes a prompt the same way, so the prompt's logits and cells are
the ones a request alone would get.

Made only where the plan asks for it (option ``prefill_aside``), so what a load allocates is what its fit check
counts (aside_plan.py prices the second context's KV, compute and output buffers): ``serve`` asks by default on the
CPU (``LOCALINFER_PREFILL_ASIDE=0`` turns it off), and /metrics shows its bytes, prompts, fallbacks and seconds; an
executor opened without the option (``generate_batch``, ``bench``'s batch scaling, a library user) makes none.
Where it cannot copy (too few free cells) the step computes the prompt in place as before, which then fails as it
would have without it.
"""

from __future__ import annotations

import ctypes
import logging
import time

import llama_cpp as _L
import numpy as np

from localinfer.backends.engine import LoadPlan
from localinfer.backends.executor import StepInterrupted
from localinfer.backends.llamacpp import native, seq_state
from localinfer.errors import LocalinferError
from localinfer.util import env, signals

ENV = "LOCALINFER_PREFILL_ASIDE"


OFF, ON = ("0", "off", "false", "no"), ("1", "on", "true", "yes")


def wanted() -> bool:
    """Unless ``LOCALINFER_PREFILL_ASIDE=0`` (or off, false, no; another value is warned about and read as on)."""
    return env.choice(ENV, OFF + ON) not in OFF


def for_executor(x, model, plan: LoadPlan, min_rows: int) -> PrefillAside | None:
    """A :class:`PrefillAside` for executor ``x`` when the plan asks for one (option ``prefill_aside``, as serve
    sets it from :func:`wanted` and fit counts it) and its cache is one the scan costs and a copy can enter: where
    ``x`` compacts (one unified cache on the CPU, no SWA or M-RoPE cells, an attention-only model) and splits short
    rows off (flash attention, ubatches of ``min_rows`` or more); the same conditions as aside_plan.aside_request's,
    read from the loaded model (that module says where the two can differ).  A context llama.cpp cannot make is
    warned about and left out: the prompts are computed in place."""
    if not (plan.options.get("prefill_aside") and x.compaction.able and x.split_short):
        return None
    try:
        return PrefillAside(model, plan, x.engine.interrupt_flag, x.n_vocab, min_rows, x.slot_cells)
    except (LocalinferError, MemoryError) as exc:
        logging.getLogger("localinfer").warning("no second context for lone prompts (%s); they are computed in "
                                                "place (%s=0 stops trying)", exc, ENV)
        return None


class PrefillAside:
    """A one-sequence context of ``model`` for prompts of ``min_rows`` (the tiled kernel's: shorter ones take the
    one-row kernel, which skips a masked cell at once) to ``plan.n_batch`` tokens; ``stop`` the serving engine's
    interrupt flag (``[flag, NUL]``), read before each decode here and by this context's abort callback."""

    def __init__(self, model, plan: LoadPlan, stop: ctypes.Array, n_vocab: int, min_rows: int, slot_cells: int):
        self.n_cells, self.min_rows = min(plan.n_batch, slot_cells), min_rows    # no prompt is longer than a slot
        self.n_vocab, self.stop = n_vocab, stop
        self.ctx = self.batch = self._token = self._logits = None
        one = plan.with_(n_ctx=self.n_cells, n_seq=1, options={**plan.options, "kv_unified": True,
                                                               "n_outputs_max": 1})    # one logits row: a smaller
        try:                                                                           # compute buffer
            with native.log_lock:
                native.log_lines.clear()
                self.ctx = native.new_context(model, one)
                logged = list(native.log_lines)
            # what this context holds, as llama.cpp logged it (fit's aside_plan predicts it; /metrics shows it)
            reported = native.parse_memory_log(logged)
            self.memory = {k: int(reported[k]) for k in ("kv", "compute", "output")}
            self.mem = _L.llama_get_memory(self.ctx)
            self.batch = b = _L.llama_batch_init(self.n_cells, 0, 1)
            # one sequence (id 0) from position 0: only the tokens and the last row's logits flag change
            self._token = np.ctypeslib.as_array(b.token, shape=(self.n_cells,))
            self._logits = np.ctypeslib.as_array(b.logits, shape=(self.n_cells,))
            np.ctypeslib.as_array(b.pos, shape=(self.n_cells,))[:] = np.arange(self.n_cells)
            np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_cells,))[:] = 1
            self._logits[:] = 0
            for i in range(self.n_cells):
                b.seq_id[i][0] = 0
            if native.FLAG_ABORT is not None:
                _L.llama_set_abort_callback(self.ctx, native.FLAG_ABORT, ctypes.cast(stop, ctypes.c_void_p))
        except BaseException:
            self.close()
            raise
        self.prompts = 0          # prompts computed here and copied in
        self.fallbacks = 0        # prompts that could not be copied in (computed in place instead)
        self.seconds = 0.0        # in llama_decode here and copying

    def offer(self, x, rows, lend: bool) -> list[tuple[int, np.ndarray]] | None:
        """``rows`` of executor ``x``'s step computed here when they are a lone prompt and another slot holds cells
        (the time added to ``x.decode_seconds``); None when they are not, or the copy found no room."""
        if not (self.takes(rows) and x.others_hold_cells(rows[0][2])):
            return None
        spent = self.seconds
        try:
            return self.decode(rows, x.engine.context, lend)
        finally:
            x.decode_seconds += self.seconds - spent

    def takes(self, rows) -> bool:
        """Whether ``rows`` (token, position, sequence, wants logits) are one sequence's prompt from position 0 that
        fits here; the caller also checks that other sequences hold cells (else nothing is saved)."""
        n = len(rows)
        if not self.min_rows <= n <= self.n_cells or rows[0][1] != 0 or any(r[3] for r in rows[:-1]):
            return False
        seq = rows[0][2]
        return all(r[2] == seq and r[1] == i for i, r in enumerate(rows))

    def decode(self, rows, into_ctx, lend: bool = False) -> list[tuple[int, np.ndarray]] | None:
        """Compute ``rows`` here and copy the sequence into ``into_ctx``; its logits row (when the last row wants
        one; read-only with ``lend``, as a lent row is), or None when the copy found no room (nothing left behind:
        compute them in place).  Only for rows :meth:`takes` (the batch's positions and sequence id are preset).
        Raises StepInterrupted when the interrupt flag stopped the graph, or was set before the call."""
        if self.stop[0] != b"\x00":          # as the engine's decode_batch: an interrupt asked before the call
            raise StepInterrupted("interrupted before llama_decode")
        b, n, seq, want = self.batch, len(rows), rows[0][2], rows[-1][3]
        t0 = time.perf_counter()
        try:
            self._token[:n] = [r[0] for r in rows]
            self._logits[n - 1] = 1 if want else 0
            b.n_tokens = n
            with signals.native():
                rc = _L.llama_decode(self.ctx, b)
            if rc == 2:
                raise StepInterrupted("llama_decode interrupted")
            if rc == 1:                      # no room (not expected in an emptied cache): compute it in place
                self.fallbacks += 1
                return None
            if rc != 0:
                raise LocalinferError(f"llama_decode failed with status {rc} (prompt computed aside)",
                                      hint=f"rerun with {ENV}=0, or with LOCALINFER_LLAMA_LOG=1 to see why")
            row = None
            if want:
                row = np.empty(self.n_vocab, dtype=np.float32)
                ctypes.memmove(row.ctypes.data, _L.llama_get_logits_ith(self.ctx, n - 1), self.n_vocab * 4)
                row.flags.writeable = not lend
            blob = seq_state.read_cells(self.ctx, 0, buffer=seq_state.scratch)
            if blob is None or not seq_state.write_cells(into_ctx, seq, blob):
                self.fallbacks += 1
                return None
            self.prompts += 1
            return [(seq, row)] if row is not None else []
        finally:
            self._logits[n - 1] = 0
            _L.llama_memory_clear(self.mem, False)      # the cells freed; their bytes need no zeroing
            self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Free the context and its batch (before the model they came from)."""
        self._token = self._logits = None     # views of the batch's arrays
        if self.batch is not None:
            _L.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            _L.llama_free(self.ctx)
            self.ctx = None
