"""The llama.cpp backend, on llama-cpp-python's low-level C API.

The high-level ``llama_cpp.Llama`` keeps a full-vocabulary score row for every
prompt token when ``logits_all`` is on; here each batch slot carries its own
output flag, so a prompt prefill asks for no logits at all and a speculative
verification asks only for the positions it checks.

Memory figures are what llama.cpp itself reports: the exact tensor bytes
(``llama_model_size``) and the KV / compute / output buffer sizes it logs while
building the context (MiB with two decimals, so within 0.005 MiB).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Sequence

import numpy as np

try:
    import llama_cpp as _L
except ImportError as exc:  # pragma: no cover - the registry turns this into BackendUnavailableError
    raise ImportError(f"llama-cpp-python is not installed ({exc})") from exc

from localinfer.backends.engine import Engine, LoadPlan
from localinfer.backends.executor import SeqState, StepInterrupted
from localinfer.backends.llamacpp import native, seq_state
from localinfer.backends.llamacpp.native import parse_memory_log  # noqa: F401  (re-exported)
from localinfer.backends.vocab import LlamaVocab
from localinfer.errors import ContextFullError, LocalinferError, UnsupportedModelError
from localinfer.util import signals

ABORT_MIN_TOKENS = 32  # evals at least this long can be aborted mid-graph by Ctrl-C
FEW_ROWS = 32          # fill_batch writes up to this many rows item by item


class LlamaCppEngine(Engine):
    """One llama.cpp model and context with ``plan.n_seq`` independent KV streams."""

    name = "llama.cpp"
    embeds = True

    def __init__(self, plan: LoadPlan):
        super().__init__(plan)
        self._model = self._ctx = None
        self._batch = None
        path = native.check_readable(plan.model_path)
        from localinfer.model.spec import ModelSpec

        self.spec = ModelSpec.from_gguf(path)  # bounded header checks before llama.cpp sees the file
        native.init_backend()
        with native.log_lock:
            native.log_lines.clear()
            try:
                self._model = native.load_model(path, plan)
                self._ctx = native.new_context(self._model, plan)
            except BaseException:
                self.close()
                raise
            self._log = list(native.log_lines)
        self._mem = _L.llama_get_memory(self._ctx)
        self.trims_tail = not (_L.llama_model_is_recurrent(self._model) or _L.llama_model_is_hybrid(self._model))
        self.vocab = LlamaVocab(_L.llama_model_get_vocab(self._model))
        self.n_vocab = self.vocab.n_vocab
        if not self.vocab.has_vocab:
            self.close()
            raise UnsupportedModelError(f"{os.path.basename(path)} has no tokenizer, so it cannot generate text",
                                        hint="is this a header-only skeleton (localinfer skeleton)? those are for "
                                             "`localinfer fit`; pass a full model file")
        per_seq = max(1, plan.n_ctx // plan.n_seq)
        self.n_ctx = min(per_seq, _L.llama_n_ctx_seq(self._ctx))
        self.add_bos = self.vocab.add_bos
        self.bos_id = self.vocab.bos_id
        self.eos_ids = self.vocab.eos_ids
        self._reported = parse_memory_log(self._log)
        self.kv_cells = self._reported["kv_cells"]
        self._n_batch = plan.n_batch
        self._n_outputs = native.outputs_cap(plan)
        self._batch = _L.llama_batch_init(self._n_batch, 0, plan.n_seq)
        self._views = {k: np.ctypeslib.as_array(getattr(self._batch, k), shape=(self._n_batch,))
                       for k in ("token", "pos", "n_seq_id", "logits")}
        self._views["n_seq_id"][:] = 1
        self._slot_seq = [-1] * self._n_batch      # each batch row's sequence id as written
        self._row_type = ctypes.c_float * self.n_vocab      # a logits row lent in place (logit_rows(lend=True))
        self._lent: dict[int, np.ndarray] = {}                # address -> the read-only view lent there
        self._abort = threading.Event()
        self.aborted = 0  # llama_decode calls stopped inside the graph (Ctrl-C, or interrupt())
        self._stop = ctypes.create_string_buffer(2)     # [flag, NUL]: interrupt() sets the flag (native.FLAG_ABORT)
        self._abort_cb = _L.ggml_abort_callback(
            lambda _data: self._abort.is_set() or self.interrupted or signals.pending() is not None)
        self._rest_abort()

    # ---- tokenizer (llama.cpp's own, shared with the other backends) --------
    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of text; ``add_bos`` prepends BOS when the model's tokenizer wants one."""
        return self.vocab.tokenize(text, add_bos=add_bos, special=special)

    def token_bytes(self, token: int) -> bytes:
        return self.vocab.token_bytes(token)

    def token_text(self, token: int) -> str:
        """A token's vocabulary text, special tokens included (for display)."""
        return self.vocab.token_text(token)

    # ---- KV cache ----------------------------------------------------------
    def kv_len(self, seq: int = 0) -> int:
        self._alive()
        self._check_seq(seq)
        return int(_L.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def snapshot(self, seq: int = 0) -> SeqState:
        self._alive()
        self._check_seq(seq)
        if self.trims_tail:
            raise LocalinferError("this model has no recurrent state to snapshot", hint="cut its KV with trim")
        return seq_state.save(self._ctx, seq, self.kv_len(seq))

    def rewind(self, state: SeqState, seq: int = 0) -> None:
        self._alive()
        self._check_seq(seq)
        n, cur = state.n_tokens, self.kv_len(seq)
        if not 0 < n <= cur:
            raise ValueError(f"sequence {seq} holds {cur} tokens; cannot rewind it to {n}")
        seq_state.restore(self._ctx, self._mem, seq, state)

    def _trim(self, n: int, seq: int) -> None:
        self._alive()
        if not _L.llama_memory_seq_rm(self._mem, seq, n, -1):
            raise LocalinferError(f"llama.cpp cannot rewind sequence {seq} to {n} tokens for this model",
                                  hint="recurrent models cannot be trimmed; start a new conversation")

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq} outside 0..{self.n_seq - 1}")

    # ---- evaluation --------------------------------------------------------
    # ---- the native handles, for executors that drive this context directly ----------------
    @property
    def context(self):
        """The llama_context (None once closed)."""
        return self._ctx

    @property
    def kv_memory(self):
        """The context's llama_memory handle."""
        return self._mem

    @property
    def model_handle(self):
        """The llama_model (None once closed)."""
        return self._model

    def embedder(self, n_ctx: int, n_seq: int = 8):
        """Sentence embeddings over this model on a context of their own (:class:`.embeddings.LlamaEmbedder`)."""
        from localinfer.backends.llamacpp.embeddings import LlamaEmbedder

        return LlamaEmbedder(self._model, n_ctx, n_seq, self.plan.threads)

    def fill_batch(self, tokens: Sequence[int], pos: Sequence[int], seqs: Sequence[int], want: Sequence[bool]) -> None:
        """Write rows into the batch from slot 0: token, position, sequence, logits flag."""
        n, b, mine = len(tokens), self._batch, self._slot_seq
        if n <= FEW_ROWS:     # a decode step's few rows: item by item (numpy's conversions cost more after a decode)
            tok, at, out = b.token, b.pos, b.logits
            for i in range(n):
                tok[i], at[i], out[i] = tokens[i], pos[i], 1 if want[i] else 0
        else:
            v = self._views
            v["token"][:n], v["pos"][:n], v["logits"][:n] = tokens, pos, want
        for i in range(n):
            s = int(seqs[i])
            if mine[i] != s:
                b.seq_id[i][0] = mine[i] = s

    # ---- interrupting a decode from another thread ---------------------------
    def interrupt(self) -> None:
        """Stop the llama_decode in flight (any thread): it raises StepInterrupted, as does every later one
        until :meth:`clear_interrupt`.  On the CPU backend the graph stops at its next node; elsewhere the
        decode runs to its end and the next one does not start."""
        self._stop[0] = b"\x01"

    @property
    def interrupt_flag(self) -> ctypes.Array:
        """The ``[flag, NUL]`` buffer :meth:`interrupt` sets, for another context's abort callback to read."""
        return self._stop

    def clear_interrupt(self) -> None:
        self._stop[0] = b"\x00"

    @property
    def interrupted(self) -> bool:
        return self._stop[0] != b"\x00"

    def _rest_abort(self) -> None:
        """The abort callback between Ctrl-C-armed decodes: the interrupt flag, read in C (no GIL)."""
        if native.FLAG_ABORT is not None:
            _L.llama_set_abort_callback(self._ctx, native.FLAG_ABORT, ctypes.cast(self._stop, ctypes.c_void_p))
        else:     # pragma: no cover - no libc: decode_batch checks the flag before each llama_decode
            _L.llama_set_abort_callback(self._ctx, native.NO_ABORT, None)

    def decode_batch(self, n_tokens: int, abortable: bool) -> None:
        """llama_decode of the batch's first ``n_tokens`` rows; StepInterrupted when :meth:`interrupt` stopped
        it (llama.cpp has removed the aborted ubatch's positions; earlier ubatches' are the caller's to drop),
        KeyboardInterrupt when Ctrl-C did."""
        if self.interrupted:
            raise StepInterrupted("interrupted before llama_decode")
        self._batch.n_tokens = n_tokens
        with signals.native():  # a SIGTERM inside aborts the graph (abortable) and raises Terminated here
            rc = self._decode_abortable() if abortable else _L.llama_decode(self._ctx, self._batch)
            self.aborted += rc == 2     # counted here: leaving the block raises when the signal was deferred
        if rc == 2 and self.interrupted and not self._abort.is_set():
            raise StepInterrupted("llama_decode interrupted")
        if rc == 2 or (rc == 0 and self._abort.is_set()):
            self._abort.clear()
            raise KeyboardInterrupt
        if rc == 1:
            raise ContextFullError("llama.cpp found no free KV slot for the batch", needed=n_tokens,
                                   available=self.n_ctx, hint="use a larger --ctx or a shorter prompt")
        if rc != 0:
            raise LocalinferError(f"llama_decode failed with status {rc}", hint="rerun with LOCALINFER_LLAMA_LOG=1")

    def _decode_abortable(self) -> int:
        """llama_decode with Ctrl-C aborting inside the graph (CPU backend)."""
        self._abort.clear()
        with native.sigint_sets(self._abort) as armed:
            if not armed:
                return _L.llama_decode(self._ctx, self._batch)
            _L.llama_set_abort_callback(self._ctx, self._abort_cb, None)
            try:
                return _L.llama_decode(self._ctx, self._batch)
            finally:
                self._rest_abort()

    def logit_rows(self, indices: Sequence[int], *, lend: bool = False) -> np.ndarray | list[np.ndarray]:
        """The logits rows of these batch slots, copied; ``lend``: a list of read-only views of llama.cpp's own
        output buffer instead, no copy, which the next ``llama_decode`` overwrites or frees (the caller reads them
        first)."""
        if lend:
            return [self._lent_row(i) for i in indices]
        out = np.empty((len(indices), self.n_vocab), dtype=np.float32)
        row = self.n_vocab * 4
        for r, i in enumerate(indices):
            ctypes.memmove(out.ctypes.data + r * row, self._logits_at(i), row)
        return out

    def _logits_at(self, i: int) -> int:
        addr = native.LOGITS_ADDR(self._ctx, i)
        if not addr:
            raise LocalinferError(f"llama.cpp returned no logits for batch slot {i}")
        return addr

    def _lent_row(self, i: int) -> np.ndarray:
        addr = self._logits_at(i)
        view = self._lent.get(addr)
        if view is None:         # llama.cpp's output buffer moved, or a new row of it: a view of it, kept for next time
            if len(self._lent) >= self._n_outputs:
                self._lent.clear()
            view = self._lent[addr] = np.frombuffer(self._row_type.from_address(addr), dtype=np.float32)
            view.flags.writeable = False
        return view

    def _eval_chunk(self, tokens, start, logits_at, seq):
        self._alive()
        self._check_seq(seq)
        want = sorted(set(logits_at))
        rows: dict[int, np.ndarray] = {}
        lo = 0
        while lo < len(tokens):  # at most n_outputs_max outputs per llama_decode
            k = len([i for i in want if i >= lo][: self._n_outputs])
            hi = len(tokens) if k < self._n_outputs else [i for i in want if i >= lo][k - 1] + 1
            mine = [i for i in want if lo <= i < hi]
            flags = np.zeros(hi - lo, dtype=np.int8)
            flags[[i - lo for i in mine]] = 1
            self.fill_batch(tokens[lo:hi], np.arange(start + lo, start + hi), np.full(hi - lo, seq), flags)
            self.decode_batch(hi - lo, abortable=hi - lo >= ABORT_MIN_TOKENS)
            if mine:
                rows.update(zip(mine, self.logit_rows([i - lo for i in mine])))
            lo = hi
        if not logits_at:
            return None
        return rows[logits_at[0]][None] if len(logits_at) == 1 else np.stack([rows[i] for i in logits_at])

    def eval_batch(self, steps: dict[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """One llama_decode over several sequences; logits of each one's last token."""
        total = sum(len(t) for t in steps.values())
        if total > self._n_batch or len(steps) > self._n_outputs or any(len(t) == 0 for t in steps.values()):
            return super().eval_batch(steps)
        starts = {seq: self.kv_len(seq) for seq in steps}
        for seq, toks in steps.items():
            if starts[seq] + len(toks) > self.n_ctx:
                raise ContextFullError(f"sequence {seq}: {starts[seq] + len(toks)} tokens do not fit in "
                                       f"the context of {self.n_ctx}", needed=starts[seq] + len(toks),
                                       available=self.n_ctx, hint="use a larger --ctx")
        toks, pos, seqs, want, last = [], [], [], [], {}
        for seq, t in steps.items():
            toks.extend(t)
            pos.extend(range(starts[seq], starts[seq] + len(t)))
            seqs.extend([seq] * len(t))
            want.extend([0] * (len(t) - 1) + [1])
            last[seq] = len(toks) - 1
        self.fill_batch(toks, pos, seqs, want)
        try:
            self.decode_batch(len(toks), abortable=len(toks) >= ABORT_MIN_TOKENS)
            rows = self.logit_rows(list(last.values()))
        except BaseException:
            for seq, s in starts.items():
                if self.kv_len(seq) > s:
                    self._trim(s, seq)
            raise
        return {seq: rows[k] for k, seq in enumerate(last)}

    # ---- resources ---------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes by kind: weights (exact tensor bytes), kv, compute, output (as llama.cpp logged them), and the
        recurrent state of a hybrid or recurrent model."""
        self._alive()
        r = self._reported
        out = {"weights": int(_L.llama_model_size(self._model)), "kv": r["kv"],
               "compute": r["compute"], "output": r["output"]}
        return out | ({"state": r["state"]} if r["state"] else {})

    def load_log(self) -> list[str]:
        """llama.cpp's log lines about buffers and errors, as captured during load."""
        return list(self._log)

    def _alive(self) -> None:
        if getattr(self, "_ctx", None) is None:
            raise LocalinferError("this engine is closed")

    def close(self) -> None:
        with signals.native():
            self._free()

    def _free(self) -> None:
        if getattr(self, "_batch", None) is not None:
            _L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None) is not None:
            _L.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "vocab", None) is not None:
            self.vocab.release()
        if getattr(self, "_model", None) is not None:
            _L.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


