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

import ctypes
import os
import re
import signal
import sys
import threading
from collections import deque
from typing import Sequence

import numpy as np

try:
    import llama_cpp as _L
except ImportError as exc:  # pragma: no cover - the registry turns this into BackendUnavailableError
    raise ImportError(f"llama-cpp-python is not installed ({exc})") from exc

from gguf import GGMLQuantizationType

from .engine import Engine, LoadPlan
from .errors import ContextFullError, LocalinferError, ModelNotFoundError, UnsupportedModelError, UsageError
from .units import MiB

ABORT_MIN_TOKENS = 32  # evals at least this long can be aborted mid-graph by Ctrl-C
DEFAULT_OUTPUTS_MAX = 64  # logit rows per llama_decode: drafts + 1 fit easily, 512 would cost n_vocab x 2 KiB
_LOG_TAIL = 400

# ---- llama.cpp's log: captured, parsed for buffer sizes, shown only when asked ----

_log_lock = threading.Lock()
_log_lines: deque[str] = deque(maxlen=_LOG_TAIL)
_log_partial: list[str] = []
_log_echo = os.environ.get("LOCALINFER_LLAMA_LOG", "") not in ("", "0")


@_L.llama_log_callback
def _on_log(level: int, text: bytes, _user) -> None:
    s = text.decode("utf-8", errors="replace") if text else ""
    if _log_echo:
        sys.stderr.write(s)
    _log_partial.append(s)
    if s.endswith("\n"):
        line = "".join(_log_partial).rstrip("\n")
        _log_partial.clear()
        if _interesting(line):
            _log_lines.append(line)


def _interesting(line: str) -> bool:
    low = line.lower()
    return "buffer size" in low or "size =" in low or "error" in low or "failed" in low or "unknown" in low


_backend_ready = False
_NO_ABORT = _L.ggml_abort_callback(0)


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        _L.llama_log_set(_on_log, ctypes.c_void_p(0))
        _L.llama_backend_init()
        _backend_ready = True


_MIB = r"([0-9]+(?:\.[0-9]+)?) MiB"
_RE_KV_BUF = re.compile(r"KV buffer size\s*=\s*" + _MIB)
_RE_COMPUTE = re.compile(r"compute buffer size\s*=\s*" + _MIB)
_RE_OUTPUT = re.compile(r"output buffer size\s*=\s*" + _MIB)
_RE_MODEL_BUF = re.compile(r"model buffer size\s*=\s*" + _MIB)
_RE_KV_SIZE = re.compile(r"llama_kv_cache: size =\s*" + _MIB + r" \(\s*(\d+) cells,\s*(\d+) layers")


def _mib(text: str) -> int:
    return round(float(text) * MiB)


def parse_memory_log(lines: Sequence[str]) -> dict[str, int]:
    """Buffer sizes llama.cpp logged while loading: bytes by kind, plus ``kv_cells``.

    A compute buffer is logged again each time the scheduler re-reserves; the
    last figure per buffer name is the one in use.
    """
    kv = compute = output = mapped = cells = 0
    computes: dict[str, int] = {}
    for line in lines:
        if m := _RE_KV_BUF.search(line):
            kv += _mib(m.group(1))
        elif m := _RE_COMPUTE.search(line):
            computes[line.split("compute buffer")[0].split(":", 1)[-1].strip()] = _mib(m.group(1))
        elif m := _RE_OUTPUT.search(line):
            output = _mib(m.group(1))
        elif m := _RE_MODEL_BUF.search(line):
            mapped += _mib(m.group(1))
        elif m := _RE_KV_SIZE.search(line):
            cells += int(m.group(2))
    compute = sum(computes.values())
    return {"kv": kv, "compute": compute, "output": output, "model_buffers": mapped, "kv_cells": cells}


def ggml_type(name: str, flag: str) -> int:
    """The ggml type id of a KV cache type name such as ``q8_0``."""
    try:
        return int(GGMLQuantizationType[name.upper()])
    except KeyError:
        raise UsageError(f"unknown KV type {name!r}", flag=flag) from None


class LlamaCppEngine(Engine):
    """One llama.cpp model and context with ``plan.n_seq`` independent KV streams."""

    name = "llama.cpp"

    def __init__(self, plan: LoadPlan):
        super().__init__(plan)
        self._model = self._ctx = None
        self._batch = None
        path = _check_readable(plan.model_path)
        from .spec import ModelSpec

        self.spec = ModelSpec.from_gguf(path)  # bounded header checks before llama.cpp sees the file
        _init_backend()
        with _log_lock:
            _log_lines.clear()
            try:
                self._model = _load_model(path, plan)
                self._ctx = _new_context(self._model, plan)
            except BaseException:
                self.close()
                raise
            self._log = list(_log_lines)
        self._mem = _L.llama_get_memory(self._ctx)
        self._vocab = _L.llama_model_get_vocab(self._model)
        self.n_vocab = _L.llama_vocab_n_tokens(self._vocab)
        if _L.llama_vocab_type(self._vocab) == _L.LLAMA_VOCAB_TYPE_NONE or self.n_vocab <= 0:
            self.close()
            raise UnsupportedModelError(f"{os.path.basename(path)} has no tokenizer, so it cannot generate text",
                                        hint="is this a header-only skeleton (localinfer skeleton)? those are for "
                                             "`localinfer fit`; pass a full model file")
        per_seq = max(1, plan.n_ctx // plan.n_seq)
        self.n_ctx = min(per_seq, _L.llama_n_ctx_seq(self._ctx))
        self.add_bos = bool(_L.llama_vocab_get_add_bos(self._vocab))
        bos = _L.llama_vocab_bos(self._vocab)
        self.bos_id = bos if bos >= 0 else None
        self.eos_ids = frozenset(i for i in range(self.n_vocab) if _L.llama_vocab_is_eog(self._vocab, i))
        self._reported = parse_memory_log(self._log)
        self.kv_cells = self._reported["kv_cells"]
        self._pieces: dict[int, bytes] = {}
        self._n_batch = plan.n_batch
        self._n_outputs = _outputs_cap(plan)
        self._batch = _L.llama_batch_init(self._n_batch, 0, plan.n_seq)
        self._views = {k: np.ctypeslib.as_array(getattr(self._batch, k), shape=(self._n_batch,))
                       for k in ("token", "pos", "n_seq_id", "logits")}
        self._views["n_seq_id"][:] = 1
        self._slot_seq = np.full(self._n_batch, -1, dtype=np.int64)
        self._abort = threading.Event()
        self.aborted = 0  # llama_decode calls stopped by Ctrl-C inside the graph
        self._abort_cb = _L.ggml_abort_callback(lambda _data: self._abort.is_set())

    # ---- tokenizer ---------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of text; ``add_bos`` prepends BOS when the model's tokenizer wants one."""
        self._alive()
        data = text.encode("utf-8", errors="replace")
        cap = len(data) + 8
        while True:
            buf = (_L.llama_token * cap)()
            n = _L.llama_tokenize(self._vocab, data, len(data), buf, cap, False, special)
            if n >= 0:
                break
            cap = -n
        out = list(buf[:n])
        if add_bos and self.add_bos and self.bos_id is not None and (not out or out[0] != self.bos_id):
            out.insert(0, self.bos_id)
        return out

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            self._alive()
            if not 0 <= token < self.n_vocab:
                raise ValueError(f"token id {token} outside the vocabulary of {self.n_vocab}")
            size = 64
            while True:
                buf = ctypes.create_string_buffer(size)
                n = _L.llama_token_to_piece(self._vocab, token, buf, size, 0, False)
                if n >= 0:
                    break
                size = -n
            piece = self._pieces[token] = buf.raw[:n]
        return piece

    def token_text(self, token: int) -> str:
        """A token's vocabulary text, special tokens included (for display)."""
        raw = _L.llama_vocab_get_text(self._vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    # ---- KV cache ----------------------------------------------------------
    def kv_len(self, seq: int = 0) -> int:
        self._alive()
        self._check_seq(seq)
        return int(_L.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def _trim(self, n: int, seq: int) -> None:
        self._alive()
        if not _L.llama_memory_seq_rm(self._mem, seq, n, -1):
            raise LocalinferError(f"llama.cpp cannot rewind sequence {seq} to {n} tokens for this model",
                                  hint="recurrent models cannot be trimmed; start a new conversation")

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq} outside 0..{self.n_seq - 1}")

    # ---- evaluation --------------------------------------------------------
    def _fill(self, tokens: Sequence[int], pos: Sequence[int], seqs: Sequence[int], want: Sequence[bool]) -> None:
        """Write rows into the batch from slot 0: token, position, sequence, logits flag."""
        n = len(tokens)
        v = self._views
        v["token"][:n] = tokens
        v["pos"][:n] = pos
        v["logits"][:n] = want
        seqs = np.asarray(seqs, dtype=np.int64)
        for i in np.flatnonzero(self._slot_seq[:n] != seqs):
            self._batch.seq_id[i][0] = int(seqs[i])
            self._slot_seq[i] = seqs[i]

    def _decode(self, n_tokens: int, abortable: bool) -> None:
        self._batch.n_tokens = n_tokens
        if not (abortable and threading.current_thread() is threading.main_thread()):
            rc = _L.llama_decode(self._ctx, self._batch)
        else:
            rc = self._decode_abortable()
        if rc == 2 or (rc == 0 and self._abort.is_set()):
            self.aborted += rc == 2
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
        previous = signal.getsignal(signal.SIGINT)
        if previous in (signal.SIG_IGN, None):
            return _L.llama_decode(self._ctx, self._batch)
        signal.signal(signal.SIGINT, lambda *_: self._abort.set())
        _L.llama_set_abort_callback(self._ctx, self._abort_cb, None)
        try:
            return _L.llama_decode(self._ctx, self._batch)
        finally:
            _L.llama_set_abort_callback(self._ctx, _NO_ABORT, None)
            signal.signal(signal.SIGINT, previous)

    def _rows(self, indices: Sequence[int]) -> np.ndarray:
        out = np.empty((len(indices), self.n_vocab), dtype=np.float32)
        row = self.n_vocab * 4
        for r, i in enumerate(indices):
            ptr = _L.llama_get_logits_ith(self._ctx, i)
            if not ptr:
                raise LocalinferError(f"llama.cpp returned no logits for batch slot {i}")
            ctypes.memmove(out.ctypes.data + r * row, ptr, row)
        return out

    def eval(self, tokens: Sequence[int], logits_at: Sequence[int] | None = None, *, seq: int = 0) -> np.ndarray:
        """As :meth:`Engine.eval`, with a short path for the one-token decode step."""
        if len(tokens) != 1 or (logits_at is not None and list(logits_at) not in ([0], [-1])):
            return super().eval(tokens, logits_at, seq=seq)
        self._alive()
        self._check_seq(seq)
        start = self.kv_len(seq)
        if start + 1 > self.n_ctx:
            return super().eval(tokens, logits_at, seq=seq)  # raises ContextFullError
        self._fill(tokens, (start,), (seq,), (1,))
        try:
            self._decode(1, abortable=False)
            return self._rows((0,))
        except BaseException:
            if self.kv_len(seq) > start:
                self._trim(start, seq)
            raise

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
            self._fill(tokens[lo:hi], np.arange(start + lo, start + hi), np.full(hi - lo, seq), flags)
            self._decode(hi - lo, abortable=hi - lo >= ABORT_MIN_TOKENS)
            if mine:
                rows.update(zip(mine, self._rows([i - lo for i in mine])))
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
        self._fill(toks, pos, seqs, want)
        try:
            self._decode(len(toks), abortable=len(toks) >= ABORT_MIN_TOKENS)
            rows = self._rows(list(last.values()))
        except BaseException:
            for seq, s in starts.items():
                if self.kv_len(seq) > s:
                    self._trim(s, seq)
            raise
        return {seq: rows[k] for k, seq in enumerate(last)}

    # ---- resources ---------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes by kind: weights (exact tensor bytes), kv, compute, output (as llama.cpp logged them)."""
        self._alive()
        r = self._reported
        return {"weights": int(_L.llama_model_size(self._model)), "kv": r["kv"],
                "compute": r["compute"], "output": r["output"]}

    def load_log(self) -> list[str]:
        """llama.cpp's log lines about buffers and errors, as captured during load."""
        return list(self._log)

    def _alive(self) -> None:
        if getattr(self, "_ctx", None) is None:
            raise LocalinferError("this engine is closed")

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            _L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None) is not None:
            _L.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None) is not None:
            _L.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _check_readable(path) -> str:
    p = os.fspath(path)
    if not os.path.exists(p):
        raise ModelNotFoundError(f"model file not found: {p}", hint="check the path, or omit MODEL to use the embedded default")
    if os.path.isdir(p):
        raise ModelNotFoundError(f"{p} is a directory, not a GGUF file", hint="pass the path of a .gguf file")
    try:
        with open(p, "rb") as f:
            f.read(4)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read model file {p}: {exc.strerror}", hint="check its permissions") from None
    return p


def _last_error() -> str:
    """The most specific error llama.cpp logged (its cause, not the "failed to load" summary)."""
    for words in (("error loading model:",), ("error", "unknown", "failed")):
        for line in reversed(_log_lines):
            low = line.lower()
            if any(w in low for w in words):
                text = line.rsplit("error loading model:", 1)[-1] if "error loading model:" in line else line
                return text.split(":", 1)[-1].strip() if text is line and ":" in text else text.strip()
    return "see LOCALINFER_LLAMA_LOG=1 for llama.cpp's log"


def _load_model(path: str, plan: LoadPlan):
    mp = _L.llama_model_default_params()
    mp.n_gpu_layers = plan.n_gpu_layers
    model = _L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise UnsupportedModelError(f"llama.cpp could not load {os.path.basename(path)}: {_last_error()}",
                                    hint="check that llama.cpp supports this architecture and quant type, "
                                         "or try another --backend", path=path)
    return model


def _outputs_cap(plan: LoadPlan) -> int:
    """Most logit rows one llama_decode may return (llama.cpp reserves compute memory for them)."""
    cap = plan.options.get("n_outputs_max", DEFAULT_OUTPUTS_MAX)
    if not isinstance(cap, int) or cap < 1:
        raise UsageError(f"n_outputs_max must be a positive integer, got {cap!r}")
    return min(cap, plan.n_batch)


def _new_context(model, plan: LoadPlan):
    cp = _L.llama_context_default_params()
    cp.n_ctx = plan.n_ctx
    cp.n_batch = plan.n_batch
    cp.n_ubatch = min(plan.n_ubatch, plan.n_batch)
    cp.n_seq_max = plan.n_seq
    cp.n_threads = cp.n_threads_batch = plan.threads
    cp.type_k = ggml_type(plan.type_k, "-ctk")
    cp.type_v = ggml_type(plan.type_v, "-ctv")
    v_quantized = plan.type_v not in ("f32", "f16", "bf16")
    if plan.flash_attn is False and v_quantized:
        raise UsageError(f"a {plan.type_v} V cache needs flash attention", flag="-ctv",
                         hint="drop --no-flash-attn, or use -ctv f16")
    if plan.flash_attn is None:
        cp.flash_attn_type = _L.LLAMA_FLASH_ATTN_TYPE_ENABLED if v_quantized else _L.LLAMA_FLASH_ATTN_TYPE_AUTO
    else:
        cp.flash_attn_type = _L.LLAMA_FLASH_ATTN_TYPE_ENABLED if plan.flash_attn else _L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.n_outputs_max = _outputs_cap(plan)
    cp.no_perf = True
    ctx = _L.llama_init_from_model(model, cp)
    if not ctx:
        raise UnsupportedModelError(f"llama.cpp could not create a context: {_last_error()}",
                                    hint="try a smaller --ctx, another KV type, or fewer --parallel sequences")
    return ctx
