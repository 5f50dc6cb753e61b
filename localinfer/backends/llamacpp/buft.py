"""llama.cpp's tensor buffer overrides through the bindings: ``llama_model_params.tensor_buft_overrides``.

llama-cpp-python declares the field (a ``void *``) but not its struct, ``llama_model_tensor_buft_override``
{const char * pattern; ggml_backend_buffer_type_t buft;}, a list terminated by a NULL pattern (llama.h).
Buffer types are found by name as common/arg.cpp ``parse_tensor_buffer_overrides`` finds them: the default
buffer type of every device in ggml's registry (``ggml_backend_dev_buffer_type``, named by
``ggml_backend_buft_name``), plus here the devices this load is handed (RPC workers are given per load, not
registered: :mod:`.rpc`).
"""

from __future__ import annotations

import ctypes as C
from functools import lru_cache

from localinfer.backends.llamacpp.overrides import request_overrides
from localinfer.errors import UsageError


class BuftOverride(C.Structure):
    _fields_ = [("pattern", C.c_char_p), ("buft", C.c_void_p)]


@lru_cache(maxsize=1)
def _libs():
    """libggml (the registry) and libggml-base (devices, buffer types), the copies libllama loaded."""
    from localinfer.backends.llamacpp.rpc import lib_dir

    d = lib_dir()
    out = []
    for name in ("ggml", "ggml-base"):
        file = next((f for f in (f"lib{name}.so.0", f"lib{name}.0.dylib", f"lib{name}.so", f"lib{name}.dylib")
                     if (d / f).exists()), None)
        out.append(C.CDLL(str(d / file)) if file else None)
    g, base = out
    if g is None or base is None:
        return None
    for lib, sym, res, args in ((g, "ggml_backend_dev_count", C.c_size_t, []),
                                (g, "ggml_backend_dev_get", C.c_void_p, [C.c_size_t]),
                                (base, "ggml_backend_dev_buffer_type", C.c_void_p, [C.c_void_p]),
                                (base, "ggml_backend_buft_name", C.c_char_p, [C.c_void_p])):
        fn = getattr(lib, sym)
        fn.restype, fn.argtypes = res, args
    return g, base


def buffer_types(devices=()) -> dict[str, int]:
    """Buffer type name → handle: the registry's devices, then ``devices`` (handles of this load's devices)."""
    libs = _libs()
    if libs is None:
        return {}
    g, base = libs
    handles = [g.ggml_backend_dev_get(i) for i in range(g.ggml_backend_dev_count())] + list(devices)
    out: dict[str, int] = {}
    for h in handles:
        buft = base.ggml_backend_dev_buffer_type(h)
        if buft:
            out.setdefault(base.ggml_backend_buft_name(buft).decode(), buft)
    return out


def override_params(mp, options: dict, devices=()):
    """Set ``mp.tensor_buft_overrides`` from a LoadPlan's options (-ot, --cpu-moe, --n-cpu-moe); returns what
    must stay alive until the load returns (None without overrides).  UsageError naming the flag for a buffer
    name no device here has."""
    overrides = request_overrides(options)
    if not overrides:
        return None
    known = buffer_types(devices)
    for _, buft, flag in overrides:
        if buft not in known:
            raise UsageError(f"{flag}: unknown buffer type {buft!r} (here: {', '.join(known) or 'none'})", flag=flag)
    patterns = [p.encode() for p, _, _ in overrides]
    arr = (BuftOverride * (len(overrides) + 1))(*[BuftOverride(p, known[b]) for p, (_, b, _) in
                                                  zip(patterns, overrides)], BuftOverride(None, None))
    mp.tensor_buft_overrides = C.cast(arr, C.c_void_p)
    return arr, patterns
