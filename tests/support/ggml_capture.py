"""llama.cpp's intermediate tensors, by name, through its graph-evaluation callback.

``capture(model_path, [tokens, ...])`` runs one ``llama_decode`` per token list
on a fresh CPU context with ``cb_eval`` set and returns, per decode, every F32
or F16 tensor the graph computed (``{"Qcur-0": [arrays in graph order], ...}``,
numpy float32 in ggml's ne-reversed shape).  Used to check the torch backend's
llama.cpp emulation kernel by kernel.  The ``ggml_tensor`` layout below is the
one in llama-cpp-python 0.3.x's ggml.h; ``layout_ok`` says whether it reads
sensible names and shapes from the running library.
"""

from __future__ import annotations

import ctypes as C

import numpy as np

from localinfer.backends.engine import LoadPlan
from localinfer.backends.llamacpp import native

_L = native._L


class _Tensor(C.Structure):
    _fields_ = [("type", C.c_int), ("buffer", C.c_void_p), ("ne", C.c_int64 * 4), ("nb", C.c_size_t * 4),
                ("op", C.c_int), ("op_params", C.c_int32 * 16), ("flags", C.c_int32), ("src", C.c_void_p * 10),
                ("view_src", C.c_void_p), ("view_offs", C.c_size_t), ("data", C.c_void_p), ("name", C.c_char * 64),
                ("extra", C.c_void_p), ("padding", C.c_char * 8)]


_DTYPES = {0: np.float32, 1: np.float16}       # GGML_TYPE_F32, GGML_TYPE_F16


def _read(t: _Tensor) -> np.ndarray:
    ne = [t.ne[i] for i in range(4)]
    nb = [t.nb[i] for i in range(4)]
    dt = np.dtype(_DTYPES[t.type])
    size = sum((n - 1) * s for n, s in zip(ne, nb)) + dt.itemsize
    flat = np.frombuffer(bytes((C.c_char * size).from_address(t.data)), dtype=dt)
    return np.lib.stride_tricks.as_strided(flat, shape=ne[::-1], strides=nb[::-1]).astype(np.float32)


def capture(model_path: str, batches: list[list[int]], *, n_ctx: int = 256, threads: int = 1,
            flash_attn: bool = True, type_k: str = "f16", type_v: str = "f16",
            names: tuple[str, ...] | None = None, all_logits: bool = False) -> list[dict[str, list[np.ndarray]]]:
    """The F32/F16 tensors of each decode of ``batches`` (one llama_decode per list):
    all of them, or those whose name is in ``names``.  ``all_logits`` asks for logits at
    every position (otherwise only the last), so the last layer keeps all its rows."""
    seen: dict[str, list[np.ndarray]] = {}

    def on_tensor(ptr, ask, _user):
        t = _Tensor.from_address(ptr)
        name = t.name.decode(errors="replace")
        if ask:
            return names is None or name in names
        if (names is None or name in names) and t.type in _DTYPES and t.data:
            seen.setdefault(name, []).append(_read(t))
        return True

    callback = _L.ggml_backend_sched_eval_callback(on_tensor)
    plan = LoadPlan(model_path, n_ctx=n_ctx, n_threads=threads, flash_attn=flash_attn, type_k=type_k,
                    type_v=type_v)
    model = native.load_model(model_path, plan)
    cp = _L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_ctx, n_ctx
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = _L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else _L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k, cp.type_v = native.ggml_type(type_k, "-ctk"), native.ggml_type(type_v, "-ctv")
    cp.cb_eval, cp.cb_eval_user_data = callback, None
    ctx = _L.llama_init_from_model(model, cp)
    out = []
    batch = _L.llama_batch_init(max(map(len, batches), default=1), 0, 1)
    start = 0
    try:
        for tokens in batches:
            seen = {}
            for i, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            if _L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            start += len(tokens)
            out.append(seen)
    finally:
        _L.llama_batch_free(batch)
        _L.llama_free(ctx)
        _L.llama_model_free(model)
    return out


def layout_ok(step: dict[str, list[np.ndarray]], n_tokens: int, n_embd: int) -> bool:
    """True when the capture found the layer-0 tensors with the shapes a llama graph has."""
    x = step.get("attn_norm-0")
    return bool(x) and x[0].reshape(-1).size == n_tokens * n_embd and np.isfinite(x[0]).all()
