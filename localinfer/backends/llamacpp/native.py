"""llama.cpp plumbing under the engine: its log, loading, context parameters, Ctrl-C.

llama.cpp reports what it allocates only in its log, so every line goes
through one callback; the lines about buffers and errors are kept (the last
few hundred) and parsed into byte counts.  Set ``LOCALINFER_LLAMA_LOG=1`` to
see the whole log on stderr.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import llama_cpp as _L
from gguf import GGMLQuantizationType

from localinfer.backends.engine import LoadPlan
from localinfer.backends.llamacpp.memory import outputs_cap
from localinfer.errors import ModelNotFoundError, UnsupportedModelError, UsageError
from localinfer.units import MiB
from localinfer.util import signals

_LOG_TAIL = 400

# ---- llama.cpp's log: captured, parsed for buffer sizes, shown only when asked ----

log_lock = threading.Lock()
log_lines: deque[str] = deque(maxlen=_LOG_TAIL)
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
            log_lines.append(line)


def _interesting(line: str) -> bool:
    low = line.lower()
    return "buffer size" in low or "size =" in low or "error" in low or "failed" in low or "unknown" in low


_backend_ready = False
NO_ABORT = _L.ggml_abort_callback(0)


def _flag_abort():
    """An abort callback in C that reads a flag and needs no GIL: libc's ``strlen`` over a two-byte buffer
    ``[flag, NUL]`` is 1 when the flag byte is set and 0 when not.  ggml's CPU backend calls its abort callback
    after every graph node from the compute thread; a Python callback there would take the GIL each time and wait
    behind the event loop.  None where libc cannot be found (interrupts then wait for the next llama_decode)."""
    try:
        libc = ctypes.CDLL(None) if os.name != "nt" else ctypes.cdll.msvcrt
        return _L.ggml_abort_callback(ctypes.cast(libc.strlen, ctypes.c_void_p).value)
    except (OSError, AttributeError, TypeError):    # pragma: no cover - no libc to call
        return None


FLAG_ABORT = _flag_abort()
# llama_get_logits_ith returning the row's address as an int (no pointer object to cast: read right after a decode)
LOGITS_ADDR = ctypes.cast(_L.llama_get_logits_ith, ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int))


def init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        with signals.native():
            _L.llama_log_set(_on_log, ctypes.c_void_p(0))
            _L.llama_backend_init()
        _backend_ready = True


_MIB = r"([0-9]+(?:\.[0-9]+)?) MiB"
_RE_KV_BUF = re.compile(r"KV buffer size\s*=\s*" + _MIB)
_RE_RS_BUF = re.compile(r"RS buffer size\s*=\s*" + _MIB)
_RE_COMPUTE = re.compile(r"compute buffer size\s*=\s*" + _MIB)
_RE_OUTPUT = re.compile(r"output buffer size\s*=\s*" + _MIB)
_RE_MODEL_BUF = re.compile(r"model buffer size\s*=\s*" + _MIB)
_RE_KV_SIZE = re.compile(r"llama_kv_cache: size =\s*" + _MIB + r" \(\s*(\d+) cells,\s*(\d+) layers")


def _mib(text: str) -> int:
    return round(float(text) * MiB)


def parse_memory_log(lines: Sequence[str]) -> dict[str, int]:
    """Buffer sizes llama.cpp logged while loading: bytes by kind (``state``: a hybrid's recurrent state, its
    "RS buffer"), plus ``kv_cells``.

    A compute buffer is logged again each time the scheduler re-reserves; the
    last figure per buffer name is the one in use.
    """
    kv = state = compute = output = mapped = cells = 0
    computes: dict[str, int] = {}
    for line in lines:
        if m := _RE_KV_BUF.search(line):
            kv += _mib(m.group(1))
        elif m := _RE_RS_BUF.search(line):
            state += _mib(m.group(1))
        elif m := _RE_COMPUTE.search(line):
            computes[line.split("compute buffer")[0].split(":", 1)[-1].strip()] = _mib(m.group(1))
        elif m := _RE_OUTPUT.search(line):
            output = _mib(m.group(1))
        elif m := _RE_MODEL_BUF.search(line):
            mapped += _mib(m.group(1))
        elif m := _RE_KV_SIZE.search(line):
            cells += int(m.group(2))
    compute = sum(computes.values())
    return {"kv": kv, "state": state, "compute": compute, "output": output, "model_buffers": mapped,
            "kv_cells": cells}


def ggml_type(name: str, flag: str) -> int:
    """The ggml type id of a KV cache type name such as ``q8_0``."""
    try:
        return int(GGMLQuantizationType[name.upper()])
    except KeyError:
        raise UsageError(f"unknown KV type {name!r}", flag=flag) from None



@contextmanager
def sigint_sets(event: threading.Event) -> Iterator[bool]:
    """While inside, Ctrl-C sets ``event`` instead of raising (main thread only; yields whether it does)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, None):
        yield False
        return
    signal.signal(signal.SIGINT, lambda *_: event.set())
    try:
        yield True
    finally:
        signal.signal(signal.SIGINT, previous)


def check_readable(path) -> str:
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


def last_error() -> str:
    """The most specific error llama.cpp logged (its cause, not the "failed to load" summary)."""
    for words in (("error loading model:",), ("error", "unknown", "failed")):
        for line in reversed(log_lines):
            low = line.lower()
            if any(w in low for w in words):
                text = line.rsplit("error loading model:", 1)[-1] if "error loading model:" in line else line
                return text.split(":", 1)[-1].strip() if text is line and ":" in text else text.strip()
    return "see LOCALINFER_LLAMA_LOG=1 for llama.cpp's log"


LOAD_MODES = {(True, False): "LLAMA_LOAD_MODE_MMAP", (True, True): "LLAMA_LOAD_MODE_MMAP_MLOCK",
              (False, False): "LLAMA_LOAD_MODE_NONE", (False, True): "LLAMA_LOAD_MODE_MLOCK"}


def load_model(path: str, plan: LoadPlan):
    mp = _L.llama_model_default_params()
    mp.n_gpu_layers = plan.n_gpu_layers
    o = plan.options
    if "mmap" in o or "mlock" in o:     # as the fit check assumes (backends/llamacpp/memory.py load_request)
        mp.load_mode = getattr(_L, LOAD_MODES[(bool(o.get("mmap", True)), bool(o.get("mlock")))])
    if not o.get("repack", True):
        mp.use_extra_bufts = False
    keep = split_params(mp, plan)   # --rpc / --tensor-split: the arrays live until the load returns
    from localinfer.backends.llamacpp.buft import override_params

    keep_ot = override_params(mp, plan.options, [d.handle for d in keep[1]] if keep else ())
    stop = threading.Event()
    progress = _L.llama_progress_callback(lambda _fraction, _user: not stop.is_set() and signals.pending() is None)
    mp.progress_callback = progress
    with signals.native():  # SIGTERM stops the load through the progress callback, then raises
        with sigint_sets(stop):
            model = _L.llama_model_load_from_file(path.encode(), mp)
        if stop.is_set() or signals.pending() is not None:
            if model:
                _L.llama_model_free(model)
            raise KeyboardInterrupt
    del keep, keep_ot
    if not model:
        why = last_error()
        hint = ("an RPC worker refused the memory (its --mem, or its device is full): "
                "`localinfer fit --rpc ...` says what fits" if "allocate RPC" in why else
                "check that llama.cpp supports this architecture and quant type, or try another --backend")
        raise UnsupportedModelError(f"llama.cpp could not load {os.path.basename(path)}: {why}", hint=hint,
                                    path=path)
    return model


def local_accelerator() -> bool:
    """Whether llama.cpp sees a GPU here (discrete or integrated).  ``llama_supports_gpu_offload()`` is true on
    a CPU-only machine too once the RPC backend is built in (it counts RPC as offload)."""
    from pathlib import Path

    libdir = Path(_L.__file__).parent / "lib"
    name = next((n for n in ("libggml.so.0", "libggml.0.dylib", "libggml.so", "libggml.dylib")
                 if (libdir / n).exists()), None)
    if name is None:
        return bool(_L.llama_supports_gpu_offload())
    by_type = ctypes.CDLL(str(libdir / name)).ggml_backend_dev_by_type
    by_type.restype, by_type.argtypes = ctypes.c_void_p, [ctypes.c_int]
    return bool(by_type(1) or by_type(2))      # GGML_BACKEND_DEVICE_TYPE_GPU, _IGPU


def split_params(mp, plan: LoadPlan):
    """Devices and split for ``plan.options`` "rpc" (endpoints) and "tensor_split" (weights): what must stay
    alive (the device array, the devices, the shares), or None when neither."""
    endpoints, weights = plan.options.get("rpc"), plan.options.get("tensor_split")
    if not endpoints and not weights:
        return None
    from localinfer.backends.llamacpp import rpc

    devices = rpc.add_servers(endpoints) if endpoints else []
    devices += rpc.local_accelerators()             # llama.cpp's order: RPC devices first, then local GPUs
    keep = [rpc.device_array(devices), devices]
    mp.devices = ctypes.cast(keep[0], ctypes.c_void_p)
    mp.split_mode = _L.LLAMA_SPLIT_MODE_LAYER
    if weights:
        if len(weights) > len(devices):
            raise UsageError(f"--tensor-split has {len(weights)} shares for {len(devices)} devices "
                             f"({', '.join(d.name + ' ' + d.description for d in devices) or 'none'})",
                             flag="--tensor-split", hint="give one share per device, RPC workers first")
        arr = (ctypes.c_float * _L.llama_max_devices())(*weights)
        keep.append(arr)
        mp.tensor_split = ctypes.cast(arr, ctypes.POINTER(ctypes.c_float))
    return keep


def new_context(model, plan: LoadPlan):
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
    cp.n_outputs_max = outputs_cap(plan)
    cp.kv_unified = bool(plan.options.get("kv_unified", cp.kv_unified))  # one KV stream shared by all sequences
    cp.no_perf = True
    with signals.native():
        ctx = _L.llama_init_from_model(model, cp)
        if ctx and signals.pending() is not None:
            _L.llama_free(ctx)  # in the main thread leaving the block raises Terminated instead; elsewhere
            raise KeyboardInterrupt     # (a server's engine thread told to stop, signals.stops_on) this does
    if not ctx:
        raise UnsupportedModelError(f"llama.cpp could not create a context: {last_error()}",
                                    hint="try a smaller --ctx or a quantized KV cache (-ctk q8_0 -ctv q8_0)"
                                         + ("; or fewer parallel sequences" if plan.n_seq > 1 else ""))
    return ctx
