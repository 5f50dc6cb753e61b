"""llama.cpp's RPC backend through ctypes: register remote workers on the client, serve devices as a worker.

llama-cpp-python binds none of ggml's backend-registry calls, so they are
bound here from the libraries it ships (``llama_cpp/lib``): ``libggml``
(the registry), ``libggml-base`` (devices, the abort hook) and ``libggml-rpc``.
:func:`library` checks, once, that every symbol this module calls is exported
and that the registry's "RPC" entry hands out the same ``add_server`` and
``start_server`` as the library exports (the API of llama.cpp's RPC protocol
v3 and later); anything else is refused in one line
(:class:`~localinfer.errors.BackendUnavailableError`).

The workers' devices are handed to each model load (``llama_model_params.devices``)
rather than registered process-wide with ``ggml_backend_register``: a later load
without ``--rpc`` in the same process (a test, a server reloading) must not pick
them up, as llama.cpp's default device selection would.

Every endpoint is probed in Python first (:mod:`.rpc_probe`, with a timeout)
because llama.cpp aborts the process when it cannot connect.  A worker that
dies mid-generation makes llama.cpp abort as well; :func:`on_abort` turns that
into one ``error:`` line naming the endpoint and a clean exit (status 4, as WorkerError) instead
of a core dump: a native abort cannot be unwound into a Python exception.
"""

from __future__ import annotations

import ctypes as C
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from localinfer.backends.llamacpp import rpc_probe
from localinfer.errors import BackendUnavailableError, UsageError

DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU = 0, 1, 2      # enum ggml_backend_dev_type
WORKER_LOST_EXIT = 4               # status after llama.cpp aborts on a lost worker

# library -> {symbol: (restype, argtypes)}
_SIGNATURES = {
    "ggml": {
        "ggml_backend_reg_by_name": (C.c_void_p, [C.c_char_p]),
        "ggml_backend_register": (None, [C.c_void_p]),
        "ggml_backend_device_register": (None, [C.c_void_p]),
        "ggml_backend_dev_count": (C.c_size_t, []),
        "ggml_backend_dev_get": (C.c_void_p, [C.c_size_t]),
        "ggml_backend_dev_by_type": (C.c_void_p, [C.c_int]),
    },
    "ggml-base": {
        "ggml_backend_reg_get_proc_address": (C.c_void_p, [C.c_void_p, C.c_char_p]),
        "ggml_backend_reg_dev_count": (C.c_size_t, [C.c_void_p]),
        "ggml_backend_reg_dev_get": (C.c_void_p, [C.c_void_p, C.c_size_t]),
        "ggml_backend_dev_name": (C.c_char_p, [C.c_void_p]),
        "ggml_backend_dev_description": (C.c_char_p, [C.c_void_p]),
        "ggml_backend_dev_memory": (None, [C.c_void_p, C.POINTER(C.c_size_t), C.POINTER(C.c_size_t)]),
        "ggml_backend_dev_type": (C.c_int, [C.c_void_p]),
        "ggml_set_abort_callback": (C.c_void_p, [C.c_void_p]),
        "ggml_backend_dev_buffer_type": (C.c_void_p, [C.c_void_p]),
        "ggml_backend_buft_name": (C.c_char_p, [C.c_void_p]),
        "ggml_backend_buft_alloc_buffer": (C.c_void_p, [C.c_void_p, C.c_size_t]),
        "ggml_backend_buffer_get_size": (C.c_size_t, [C.c_void_p]),
        "ggml_backend_buffer_get_type": (C.c_void_p, [C.c_void_p]),
        "ggml_backend_buffer_free": (None, [C.c_void_p]),
    },
    "ggml-rpc": {
        "ggml_backend_rpc_add_server": (C.c_void_p, [C.c_char_p]),
        "ggml_backend_rpc_start_server": (None, [C.c_char_p, C.c_char_p, C.c_size_t, C.c_size_t,
                                                 C.POINTER(C.c_void_p)]),
        "ggml_backend_rpc_get_device_memory": (None, [C.c_char_p, C.c_uint32, C.POINTER(C.c_size_t),
                                                      C.POINTER(C.c_size_t)]),
        "ggml_backend_rpc_reg": (C.c_void_p, []),
    },
}
_OLD_API = "ggml_backend_rpc_add_device"     # llama.cpp before RPC protocol v3 (one device per endpoint)
_HINT = "reinstall with ./install.sh (it builds llama-cpp-python with -DGGML_RPC=ON)"


@dataclass(frozen=True)
class Library:
    ggml: C.CDLL
    base: C.CDLL
    rpc: C.CDLL
    path: Path


_lib: Library | None = None
_lock = threading.Lock()


def lib_dir() -> Path:
    """llama-cpp-python's shared libraries (imports llama_cpp, which loads them)."""
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def check_exports(libs: dict[str, C.CDLL]) -> None:
    """Bind every symbol of :data:`_SIGNATURES`; BackendUnavailableError naming the first missing one."""
    rpc = libs.get("ggml-rpc")
    if rpc is not None and not hasattr(rpc, "ggml_backend_rpc_add_server") and hasattr(rpc, _OLD_API):
        raise BackendUnavailableError("this llama.cpp has the old RPC API (ggml_backend_rpc_add_device, before "
                                      "protocol v3); localinfer needs ggml_backend_rpc_add_server", hint=_HINT)
    for name, symbols in _SIGNATURES.items():
        lib = libs.get(name)
        if lib is None:
            raise BackendUnavailableError(f"llama-cpp-python has no lib{name}.so: it was built without "
                                          "the RPC backend", hint=_HINT)
        for sym, (restype, argtypes) in symbols.items():
            fn = getattr(lib, sym, None)
            if fn is None:
                raise BackendUnavailableError(f"lib{name}.so does not export {sym}: this llama.cpp's RPC "
                                              "API is not the one localinfer binds", hint=_HINT)
            fn.restype, fn.argtypes = restype, argtypes


def library() -> Library:
    """The bound libraries, checked once (BackendUnavailableError when incompatible)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        d = lib_dir()
        libs = {}
        for name in _SIGNATURES:
            # the file libllama loaded (by soname): a wheel ships lib*.so as a second copy, not a symlink, and a
            # second copy of a library has its own registry
            for file in (f"lib{name}.so.0", f"lib{name}.0.dylib", f"lib{name}.so", f"lib{name}.dylib"):
                if (d / file).exists():
                    libs[name] = C.CDLL(str(d / file))    # RTLD_LOCAL: ggml's gguf_* must not shadow mlx's
                    break
        check_exports(libs)
        g, base, rpc = libs["ggml"], libs["ggml-base"], libs["ggml-rpc"]
        reg = g.ggml_backend_reg_by_name(b"RPC")
        if not reg:
            raise BackendUnavailableError("llama.cpp's backend registry has no RPC backend", hint=_HINT)
        for sym in ("ggml_backend_rpc_add_server", "ggml_backend_rpc_start_server"):
            addr = base.ggml_backend_reg_get_proc_address(reg, sym.encode())
            if addr != C.cast(getattr(rpc, sym), C.c_void_p).value:
                raise BackendUnavailableError(f"the registry's RPC backend does not hand out {sym} as "
                                              "libggml-rpc exports it (two llama.cpp builds mixed?)", hint=_HINT)
        _lib = Library(g, base, rpc, d)
        return _lib


# ---- devices --------------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    handle: int          # ggml_backend_dev_t
    name: str            # "RPC0", "CPU", "CUDA0"
    description: str     # the endpoint for RPC devices
    free: int
    total: int


def device(handle: int) -> Device:
    base = library().base
    free, total = C.c_size_t(0), C.c_size_t(0)
    base.ggml_backend_dev_memory(handle, C.byref(free), C.byref(total))
    return Device(handle, base.ggml_backend_dev_name(handle).decode(),
                  base.ggml_backend_dev_description(handle).decode(), free.value, total.value)


def local_devices(kind: int | None = None) -> list[Device]:
    """Devices the process's registry holds (all, or those of one ggml device type)."""
    lib = library()
    out = []
    for i in range(lib.ggml.ggml_backend_dev_count()):
        h = lib.ggml.ggml_backend_dev_get(i)
        if kind is None or lib.base.ggml_backend_dev_type(h) == kind:
            out.append(device(h))
    return out


def local_accelerators() -> list[Device]:
    """This machine's GPUs as llama.cpp's default selection takes them: discrete ones, else integrated ones."""
    gpus = local_devices(DEVICE_GPU)
    return gpus or local_devices(DEVICE_IGPU)


_servers: dict[str, list[Device]] = {}


def add_servers(endpoints, timeout: float = 5.0) -> list[Device]:
    """The devices of each worker, in order, connected through llama.cpp (probed first: a typed error, not an
    abort, when one is unreachable or speaks another protocol version).  A worker joins once per process."""
    lib = library()
    out: list[Device] = []
    for ep in rpc_probe.parse_endpoints(endpoints):
        if ep not in _servers:
            rpc_probe.probe(ep, timeout=timeout)
            install_abort_hook(_servers.keys() | {ep})
            reg = lib.rpc.ggml_backend_rpc_add_server(ep.encode())
            if not reg:
                raise UsageError(f"RPC worker {ep} offers no devices", flag="--rpc")
            _servers[ep] = [device(lib.base.ggml_backend_reg_dev_get(reg, i))
                            for i in range(lib.base.ggml_backend_reg_dev_count(reg))]
        out.extend(_servers[ep])
    return out


def device_array(devs: list[Device]):
    """A NULL-terminated ``ggml_backend_dev_t`` array for ``llama_model_params.devices`` (keep it alive)."""
    arr = (C.c_void_p * (len(devs) + 1))(*[d.handle for d in devs], None)
    return arr


# ---- a worker lost mid-run ---------------------------------------------------------------

_ABORT_T = C.CFUNCTYPE(None, C.c_char_p)
_hook = None
_endpoints: set[str] = set()
_last_words: list = []     # called with the error before the process exits (serve ends its open replies)


def on_worker_lost(fn) -> None:
    """Call ``fn(message)`` when llama.cpp aborts with RPC workers in use, before this process exits (``fn`` may
    block a few seconds: the server ends its open replies with the message)."""
    _last_words.append(fn)


def install_abort_hook(endpoints) -> None:
    """Route llama.cpp's aborts through :func:`on_abort` while RPC workers are in use."""
    global _hook
    _endpoints.update(endpoints)
    if _hook is None:
        _hook = _ABORT_T(on_abort)
        library().base.ggml_set_abort_callback(C.cast(_hook, C.c_void_p))


def on_abort(message: bytes | None) -> None:
    """llama.cpp is about to abort(): name the worker(s) that went away, then exit with WORKER_LOST_EXIT."""
    text = (message or b"").decode("utf-8", "replace").strip()
    lost: set[str] = set()
    for _ in range(10):       # a killed worker's listening socket may close just after its connection does
        lost |= {ep for ep in _endpoints if not rpc_probe.listening(ep, timeout=0.5)}
        if lost:
            break
        time.sleep(0.1)
    lost = sorted(lost)
    if lost:
        line = f"error: RPC worker {', '.join(lost)} went away ({text.split(': ', 1)[-1]})"
        hint = "hint: restart `localinfer worker` there, or drop it from --rpc"
    else:
        line = f"error: llama.cpp aborted: {text}"
        hint = f"hint: the RPC workers in use were {', '.join(sorted(_endpoints))}"
    try:
        for fn in list(_last_words):
            try:
                fn(line.removeprefix("error: "))
            except BaseException:  # noqa: BLE001 - the process ends either way
                pass
        sys.stderr.write(f"\n{line}\n{hint}\n")
        sys.stderr.flush()
    finally:
        os._exit(WORKER_LOST_EXIT)


# ---- serving devices as a worker ------------------------------------------------------------

def worker_devices() -> list[Device]:
    """What a worker serves, as llama.cpp's rpc-server does: every accelerator, else the CPU."""
    lib = library()
    accel = [d for d in local_devices() if lib.base.ggml_backend_dev_type(d.handle) != DEVICE_CPU]
    return accel or local_devices(DEVICE_CPU)


_DEV_SLOTS, _GET_MEMORY, _INIT_BACKEND, _BUFFER_TYPE = 17, 2, 5, 6   # struct ggml_backend_device: 15-entry
                                                                    # iface, reg, context
_BACKEND_SLOTS, _BACKEND_DEVICE = 19, 17             # struct ggml_backend: guid, 16-entry iface, device, context
_BUFT_SLOTS, _BUFT_ALLOC = 8, 1                      # struct ggml_backend_buffer_type: 6-entry iface, device, context
_BUF_SLOTS, _BUF_FREE, _BUF_TYPE, _BUF_SIZE = 14, 0, 11, 13   # struct ggml_backend_buffer: 11-entry iface, buft,
                                                              # context, size
_GET_MEMORY_T = C.CFUNCTYPE(None, C.c_void_p, C.POINTER(C.c_size_t), C.POINTER(C.c_size_t))
_INIT_T = C.CFUNCTYPE(C.c_void_p, C.c_void_p, C.c_char_p)
_BUFT_T = C.CFUNCTYPE(C.c_void_p, C.c_void_p)
_ALLOC_T = C.CFUNCTYPE(C.c_void_p, C.c_void_p, C.c_size_t)
_FREE_T = C.CFUNCTYPE(None, C.c_void_p)
_keep: list = []     # capped devices and their callbacks live as long as the process


class _Budget:
    """What a capped device's buffers hold, within ``mem`` bytes (the RPC server's allocations go through it)."""

    def __init__(self, mem: int, name: str):
        self.mem, self.name, self.used = mem, name, 0
        self.frees: dict[int, tuple[int, int]] = {}      # buffer -> (its own free_buffer, its size)
        self.lock = threading.Lock()


def capped_device(handle: int, mem: int) -> int:
    """A copy of device ``handle`` that offers ``mem`` bytes (what rpc-server's ``-m`` did) and holds to them.

    The RPC server answers a client's memory query from its backend's device and allocates from that device's
    buffer type, so the copy's ``init_backend`` points the backend it creates at the copy, its memory is ``mem``
    less what its buffers hold, and its buffer type refuses an allocation past ``mem`` (the client is told the
    allocation failed, as when a device is full); the copy hands every other call to the real device's functions.
    """
    real = (C.c_void_p * _DEV_SLOTS).from_address(handle)
    check_device_layout(handle, real)
    budget = _Budget(mem, device(handle).name)
    copy = (C.c_void_p * _DEV_SLOTS)(*real)
    real_init = _INIT_T(real[_INIT_BACKEND])
    buft = capped_buffer_type(library().base.ggml_backend_dev_buffer_type(handle), budget)

    def get_memory(_dev, free, total) -> None:
        total[0] = mem
        free[0] = max(0, mem - budget.used)

    def init_backend(_dev, params):
        backend = real_init(handle, params)
        if backend:
            slots = (C.c_void_p * _BACKEND_SLOTS).from_address(backend)
            if slots[_BACKEND_DEVICE] == handle:
                slots[_BACKEND_DEVICE] = C.addressof(copy)
        return backend

    callbacks = (_GET_MEMORY_T(get_memory), _INIT_T(init_backend), _BUFT_T(lambda _dev: buft))
    copy[_GET_MEMORY] = C.cast(callbacks[0], C.c_void_p)
    copy[_INIT_BACKEND] = C.cast(callbacks[1], C.c_void_p)
    copy[_BUFFER_TYPE] = C.cast(callbacks[2], C.c_void_p)
    _keep.extend((copy, real_init, budget, *callbacks))
    return C.addressof(copy)


def capped_buffer_type(real_buft: int, budget: _Budget) -> int:
    """A copy of buffer type ``real_buft`` whose ``alloc_buffer`` keeps the buffers' bytes within ``budget``: each
    buffer it makes has its ``free_buffer`` wrapped to give its bytes back."""
    check_buffer_layout(real_buft)
    real = (C.c_void_p * _BUFT_SLOTS).from_address(real_buft)
    copy = (C.c_void_p * _BUFT_SLOTS)(*real)
    real_alloc = _ALLOC_T(real[_BUFT_ALLOC])

    def free(buf) -> None:
        with budget.lock:
            own, n = budget.frees.pop(buf, (0, 0))
            budget.used -= n
        if own:
            _FREE_T(own)(buf)

    free_cb = _FREE_T(free)

    def alloc(_buft, size):
        with budget.lock:
            if budget.used + size > budget.mem:
                sys.stderr.write(f"worker: refused a buffer of {size:,} B on {budget.name}: {budget.used:,} of the "
                                 f"{budget.mem:,} B offered (--mem) are in use\n")
                sys.stderr.flush()
                return None
            buf = real_alloc(real_buft, size)
            if not buf:
                return None
            slots = (C.c_void_p * _BUF_SLOTS).from_address(buf)
            n = slots[_BUF_SIZE] or 0
            budget.frees[buf] = (slots[_BUF_FREE] or 0, n)
            budget.used += n
            slots[_BUF_FREE] = C.cast(free_cb, C.c_void_p)
            return buf

    alloc_cb = _ALLOC_T(alloc)
    copy[_BUFT_ALLOC] = C.cast(alloc_cb, C.c_void_p)
    _keep.extend((copy, real_alloc, free_cb, alloc_cb))
    return C.addressof(copy)


def check_buffer_layout(buft: int) -> None:
    """The buffer type and its buffers are laid out as :func:`capped_buffer_type` assumes: the type's first slot
    names it, a buffer it makes holds the type and its size where ggml's accessors find them."""
    base = library().base
    slots = (C.c_void_p * _BUFT_SLOTS).from_address(buft)
    name = C.CFUNCTYPE(C.c_char_p, C.c_void_p)(slots[0])(buft)
    ok = (name or b"") == (base.ggml_backend_buft_name(buft) or b"")
    if ok:
        buf = base.ggml_backend_buft_alloc_buffer(buft, 4096)
        if buf:
            b = (C.c_void_p * _BUF_SLOTS).from_address(buf)
            ok = b[_BUF_TYPE] == base.ggml_backend_buffer_get_type(buf) and \
                b[_BUF_SIZE] == base.ggml_backend_buffer_get_size(buf)
            base.ggml_backend_buffer_free(buf)
    if not ok:
        raise BackendUnavailableError("--mem: this llama.cpp's buffer structures are not the ones localinfer "
                                      "patches", hint="drop --mem, or reinstall with ./install.sh")


def check_device_layout(handle: int, slots) -> None:
    """The device struct is laid out as this module assumes: its first slot names it, its memory slot reports
    what ``ggml_backend_dev_memory`` does (BackendUnavailableError otherwise, before anything is patched)."""
    dev = device(handle)
    name = C.CFUNCTYPE(C.c_char_p, C.c_void_p)(slots[0])(handle)
    free, total = C.c_size_t(0), C.c_size_t(0)
    _GET_MEMORY_T(slots[_GET_MEMORY])(handle, C.byref(free), C.byref(total))
    if (name or b"").decode() != dev.name or total.value != dev.total:
        raise BackendUnavailableError("--mem: this llama.cpp's device structure is not the one localinfer "
                                      "patches", hint="drop --mem, or reinstall with ./install.sh")


def start_server(endpoint: str, threads: int, cache_dir: str | None = None, mem: int | None = None) -> None:
    """Serve this machine's devices at ``endpoint`` (blocks for ever: run it in a child process); ``mem``: report
    that many bytes per device instead of what the device says."""
    lib = library()
    devs = worker_devices()
    handles = [capped_device(d.handle, mem) if mem else d.handle for d in devs]
    if mem and all(lib.base.ggml_backend_dev_type(d.handle) == DEVICE_CPU for d in devs):
        limit_messages(mem)
    arr = (C.c_void_p * len(devs))(*handles)
    lib.rpc.ggml_backend_rpc_start_server(endpoint.encode(), cache_dir.encode() if cache_dir else None,
                                          threads, len(devs), arr)


MESSAGE_SLACK = 256 << 20


def limit_messages(mem: int) -> None:
    """Bound this process's heap (RLIMIT_DATA) to what it holds now, ``mem`` for the buffers and ``mem`` more for
    one message in flight: the server makes room for whatever size a message claims, and a claim past that is now
    refused (llama.cpp logs it and drops that client) instead of taking the machine's memory.  CPU workers only: an
    accelerator's driver maps more than it uses."""
    import resource

    try:
        with open("/proc/self/status") as f:
            now = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    except (OSError, StopIteration, ValueError):
        return
    cap = now + 2 * mem + MESSAGE_SLACK
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard == resource.RLIM_INFINITY or cap <= hard:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent (the `localinfer worker` command) dies."""
    try:
        import signal

        C.CDLL(None).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":   # the worker's child process: python -m ... ENDPOINT THREADS [CACHE_DIR|- [MEM]]
    _die_with_parent()
    cache = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    try:
        start_server(sys.argv[1], int(sys.argv[2]), cache, int(sys.argv[4]) if len(sys.argv) > 4 else None)
    except BackendUnavailableError as exc:
        sys.stderr.write(f"error: {exc}\nhint: {exc.hint}\n")
        sys.exit(2)
    sys.exit(1)   # start_server returns only when it could not serve (its reason is on stderr)
