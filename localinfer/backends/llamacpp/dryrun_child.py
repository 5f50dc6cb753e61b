"""The subprocess side of llama.cpp's dry run: load each model once, create a context per request, report.

Run as ``python -m localinfer.backends.llamacpp.dryrun_child`` with the jobs as JSON on stdin (see
:func:`localinfer.backends.llamacpp.dryrun.run_jobs`, the only caller).  A dry run loads with
``no_alloc=True``, ``load_mode=LLAMA_LOAD_MODE_NONE`` and the extra buffer types on, so llama.cpp plans
every buffer (CPU_REPACK included) without reading a weight: header-only skeletons work.  A job with
``mmap`` does a real mmap load instead (the file must be whole).

For each job one JSON line ``{"job", "loaded", "error"}``, then per request one line ``{"job", "request",
"ok", "buffers", "log", "error"}``: ``buffers`` is ``llama_get_memory_breakdown`` (buffer type →
[model, context, compute] bytes), ``log`` llama.cpp's log while it created the context (the parent parses
KV / RS / output buffer lines from it), ``error`` the last error lines of the log.  Every log line is also
written to stderr as it arrives, so the parent sees the tail when llama.cpp aborts.  Only this module imports
llama_cpp, and only in :func:`main`.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

LOG_ERROR, LOG_CONT = 4, 5          # ggml_log_level: GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT
BREAKDOWN_SYMBOL = "_Z26llama_get_memory_breakdownPK13llama_context"   # C++ API: returns a std::map


class _Log:
    """llama.cpp's log lines since the last ``clear``, with their levels (CONT pieces joined)."""

    def __init__(self):
        self.lines: list[list] = []     # [level, text]

    def add(self, level: int, text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()
        if level == LOG_CONT and self.lines:
            self.lines[-1][1] += text
        else:
            self.lines.append([level, text])

    def clear(self) -> None:
        self.lines.clear()

    def text(self) -> str:
        return "".join(t for _, t in self.lines)

    def errors(self, n: int = 4) -> list[str]:
        return [t.strip() for lvl, t in self.lines if lvl == LOG_ERROR and t.strip()][-n:]


def breakdown_reader(L):
    """``read(ctx) -> {buffer type: [model, context, compute]}`` over llama.cpp's ``llama_get_memory_breakdown``
    (a std::map returned through a hidden pointer, x86-64 ABI), or None when libllama lacks the symbol."""
    libdir = Path(L.__file__).parent / "lib"
    llama = ctypes.CDLL(str(libdir / "libllama.so"))
    base = ctypes.CDLL(str(libdir / "libggml-base.so"))
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    fn = getattr(llama, BREAKDOWN_SYMBOL, None)
    if fn is None:
        return None
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p]

    def read(ctx) -> dict:
        raw = (ctypes.c_uint64 * 8)()
        fn(ctypes.addressof(raw), ctx)
        return walk_map(raw[2], base.ggml_backend_buft_name)

    return read


def walk_map(root: int, buft_name) -> dict:
    """In-order walk of a libstdc++ red-black tree ``map<buft, {model, context, compute}>`` from its root."""

    class Node(ctypes.Structure):
        _fields_ = [("color", ctypes.c_int), ("parent", ctypes.c_void_p), ("left", ctypes.c_void_p),
                    ("right", ctypes.c_void_p), ("key", ctypes.c_void_p), ("model", ctypes.c_size_t),
                    ("context", ctypes.c_size_t), ("compute", ctypes.c_size_t)]

    out: dict = {}

    def walk(p):
        if not p:
            return
        node = Node.from_address(p)
        walk(node.left)
        out[buft_name(node.key).decode()] = [node.model, node.context, node.compute]
        walk(node.right)

    walk(root)
    return out


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    import llama_cpp as L

    jobs = json.loads(sys.stdin.read())
    log = _Log()

    @L.llama_log_callback
    def on_log(level, text, user):
        log.add(int(level), text.decode(errors="replace"))

    L.llama_log_set(on_log, None)
    L.llama_backend_init()
    breakdown = breakdown_reader(L)
    for i, job in enumerate(jobs):
        log.clear()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers, mp.use_extra_bufts = job["n_gpu_layers"], job["repack"]
        if job["mmap"]:
            mp.load_mode = L.LLAMA_LOAD_MODE_MMAP
        else:
            mp.no_alloc, mp.load_mode = True, L.LLAMA_LOAD_MODE_NONE
        model = L.llama_model_load_from_file(job["path"].encode(), mp)
        _emit({"job": i, "loaded": bool(model), "error": log.errors(), "log": log.text()[-4000:] if not model else ""})
        if not model:
            continue
        for j, r in enumerate(job["requests"]):
            log.clear()
            cp = L.llama_context_default_params()
            cp.n_ctx, cp.n_seq_max = r["n_ctx"] * r["n_seq"], r["n_seq"]
            cp.n_batch, cp.n_ubatch = r["n_batch"], r["n_ubatch"]
            if r["n_outputs_max"] is not None:
                cp.n_outputs_max = r["n_outputs_max"]
            cp.type_k, cp.type_v = r["type_k_id"], r["type_v_id"]
            cp.flash_attn_type = {True: 1, False: 0, None: -1}[r["flash_attn"]]
            cp.swa_full, cp.kv_unified = r["swa_full"], r["kv_unified"]
            ctx = L.llama_init_from_model(model, cp)
            buffers = {}
            if ctx and breakdown is not None:
                buffers = breakdown(ctx)
            _emit({"job": i, "request": j, "ok": bool(ctx) and breakdown is not None, "buffers": buffers,
                   "log": log.text(), "error": log.errors() if not ctx else
                   ([] if breakdown is not None else [f"libllama has no {BREAKDOWN_SYMBOL}"])})
            if ctx:
                L.llama_free(ctx)
        L.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
