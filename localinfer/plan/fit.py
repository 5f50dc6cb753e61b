"""Will a model fit on a device, and how: the per-device verdict behind ``localinfer fit``.

``fit_device(spec, device, request)`` assembles every memory term the way the
backend allocates it (see :mod:`localinfer.plan.memory`, :mod:`localinfer.backends.llamacpp.placement`,
:mod:`localinfer.backends.llamacpp.compute_buffer`), checks it against the device's usable
memory, and answers the questions people ask next: the largest context at this
parallelism, the most parallel requests at this context, the best KV type that
fits, how many layers to keep on the accelerator, and the llama.cpp command
line that realises the plan.  Nothing here imports torch, llama_cpp or mlx.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from localinfer.plan.memory import (
    BACKENDS,
    LlamaCells,
    MemoryBreakdown,
    Term,
    backend_device,
    check_kv_type,
    check_weight_dtype,
    kv_bytes,
    kv_bytes_from_layer,
    llama_cells,
    output_bytes,
    resident_weights,
)
from localinfer.backends.llamacpp.compute_buffer import compute_estimate
from localinfer.devices.profiles import DeviceProfile
from localinfer.errors import UsageError
from localinfer.backends.llamacpp.placement import gpu_layer_start, weight_placement
from localinfer.model.spec import ModelSpec
from localinfer.units import fmt_bytes

MAX_PARALLEL = 256           # llama.cpp's LLAMA_MAX_SEQ
KV_PREFERENCE = ("f16", "q8_0", "q4_0")   # most faithful first
CTX_STEP = 256


@dataclass(frozen=True)
class FitRequest:
    """What the user asked for.  ``n_ctx`` is tokens per sequence; llama.cpp gets ``n_ctx × n_seq``."""

    n_ctx: int = 4096
    n_seq: int = 1
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool | None = None      # None: llama.cpp's auto (on where supported)
    n_gpu_layers: int = -1              # -1: every layer on the accelerator
    n_batch: int = 2048
    n_ubatch: int = 512
    n_outputs_max: int | None = None    # None: llama.cpp's default (n_batch)
    backend: str = "llama.cpp"
    mmap: bool = True
    kv_unified: bool = False
    swa_full: bool = False              # llama.cpp CLI default; its C API (and llama-cpp-python) default to True
    n_ctx_total: int | None = None      # exact llama.cpp -c when it is not n_ctx × n_seq (check_load)
    dtype: str | None = None            # torch/mlx weight dtype; None: the engine's default where it runs
    packed: bool = False                # torch: q8_0/q4_0 matrices kept as GGUF blocks

    def __post_init__(self):
        if not isinstance(self.n_ctx, int) or isinstance(self.n_ctx, bool) or self.n_ctx <= 0:
            raise UsageError(f"context must be a positive integer, got {self.n_ctx!r}", flag="--ctx",
                             hint="e.g. --ctx 8192")
        if not isinstance(self.n_seq, int) or not 1 <= self.n_seq <= MAX_PARALLEL:
            raise UsageError(f"parallel sequences must be 1..{MAX_PARALLEL}, got {self.n_seq!r}", flag="--parallel")
        check_kv_type(self.type_k, "-ctk")
        check_kv_type(self.type_v, "-ctv")
        if self.flash_attn is False and self.type_v not in ("f32", "f16", "bf16"):
            raise UsageError(f"a {self.type_v} V cache needs flash attention", flag="--flash-attn",
                             hint="use --flash-attn on, or -ctv f16")
        if not isinstance(self.n_gpu_layers, int) or self.n_gpu_layers < -1:
            raise UsageError(f"--gpu-layers must be -1 (all) or a count >= 0, got {self.n_gpu_layers!r}",
                             flag="--gpu-layers")
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown backend {self.backend!r}", flag="--backend", hint="use " + ", ".join(BACKENDS))
        if self.n_batch <= 0 or self.n_ubatch <= 0:
            raise UsageError("batch sizes must be positive", flag="--batch")
        check_weight_dtype(self.dtype)

    @property
    def llama_n_ctx(self) -> int:
        return self.n_ctx_total or self.n_ctx * self.n_seq

    @property
    def flash_attn_on(self) -> bool:
        return self.flash_attn is not False


@dataclass(frozen=True)
class Offload:
    """Partial offload that fits: layers kept on the accelerator and what the host must hold."""

    gpu_layers: int        # value for -ngl
    device_bytes: int
    host_bytes: int


@dataclass(frozen=True)
class FitResult:
    spec_name: str
    device: DeviceProfile
    request: FitRequest
    breakdown: MemoryBreakdown
    cells: LlamaCells | None
    usable_bytes: int
    fits: bool
    reason: str
    suggestions: tuple[str, ...] = ()
    max_ctx: int | None = None          # largest n_ctx per sequence that fits at this parallelism
    max_parallel: int | None = None     # most sequences that fit at this context
    kv_type: str | None = None          # most faithful KV type (K = V) that fits at this context
    ubatch: int | None = None           # a smaller -ub that fits when the compute buffer tips it over
    offload: Offload | None = None
    command: str = ""
    warnings: tuple[str, ...] = field(default=())
    supported: bool = True              # False: the backend cannot use this device (see budget.backend_device)

    @property
    def free_bytes(self) -> int:
        return self.usable_bytes - self.breakdown.device_bytes

    @property
    def needed(self) -> int:
        """Bytes the device (or, on unified memory, the machine) must hold."""
        return self.breakdown.device_bytes

    @property
    def available(self) -> int:
        return self.usable_bytes

    def to_dict(self) -> dict:
        d = self.device
        return {
            "model": self.spec_name,
            "device": {"name": d.name, "display_name": d.display_name, "kind": d.kind, "unified": d.unified,
                       "memory_bytes": d.memory_bytes, "reserve": d.reserve, "reserve_bytes": d.reserve_bytes,
                       "working_set_cap_bytes": d.working_set_cap_bytes, "usable_bytes": self.usable_bytes,
                       "usable_formula": _usable_formula(d)},
            "request": dict(self.request.__dict__),
            "cells": None if self.cells is None else dict(self.cells.__dict__),
            "fits": self.fits, "free_bytes": self.free_bytes, "reason": self.reason,
            "breakdown": self.breakdown.to_dict(),
            "max_ctx": self.max_ctx, "max_parallel": self.max_parallel, "kv_type": self.kv_type,
            "ubatch": self.ubatch,
            "offload": None if self.offload is None else dict(self.offload.__dict__),
            "suggestions": list(self.suggestions), "command": self.command, "warnings": list(self.warnings),
            "supported": self.supported,
        }


def _usable_formula(d: DeviceProfile) -> str:
    text = f"memory {d.memory_bytes} − reserve {d.reserve} ({d.reserve_bytes})"
    if d.working_set_cap_bytes is not None:
        text = f"min({text}, working-set cap {d.working_set_cap_bytes})"
    return text


# ---- the breakdown ----------------------------------------------------------------

def _pool(kind: str, on_device: bool) -> str:
    return "device" if kind == "cpu" or on_device else "host"


def breakdown(spec: ModelSpec, device: DeviceProfile, req: FitRequest) -> tuple[MemoryBreakdown, LlamaCells]:
    """Every memory term of ``req`` on ``device`` as llama.cpp allocates it, with its formula."""
    if req.backend != "llama.cpp":
        return _other_backend(spec, device, req), None
    kind = device.kind
    ngl = 0 if kind == "cpu" else req.n_gpu_layers
    cells = llama_cells(spec, req.llama_n_ctx, req.n_seq, n_ubatch=req.n_ubatch, kv_unified=req.kv_unified,
                        swa_full=req.swa_full)
    n_batch = min(cells.n_ctx, req.n_batch)
    n_ubatch = min(n_batch, req.n_ubatch)
    if n_ubatch != req.n_ubatch:
        cells = llama_cells(spec, req.llama_n_ctx, req.n_seq, n_ubatch=n_ubatch, kv_unified=req.kv_unified,
                            swa_full=req.swa_full)
    n_outputs = min(n_ubatch, n_batch if req.n_outputs_max is None else req.n_outputs_max)
    terms: list[Term] = []
    wp = weight_placement(spec, kind, ngl, mmap=req.mmap, cpu_features=device.cpu_features)
    for name, nbytes in wp.buffers.items():
        on_dev = name in wp.device_buffers
        formula = ("file range from the first to the last byte of the mapped tensors" if "Mapped" in name else
                   "Σ matmul weights repacked for this CPU (a second copy)" if "REPACK" in name else
                   "Σ tensor bytes, padded and aligned")
        counted = nbytes
        if not on_dev and not device.unified and kind != "cpu" and wp.tensor_bytes[name] != nbytes:
            counted = wp.tensor_bytes[name]
            formula = "Σ bytes of the tensors kept on the host (the mapping spans more, read once at load)"
        terms.append(Term("weights", f"weights ({name.split()[0]})", counted, _pool(kind, on_dev), formula, name,
                          reported=nbytes if counted != nbytes else None))
    start = spec.n_layers if (kind == "cpu" or ngl == 0) else gpu_layer_start(spec.n_layers, ngl)
    kv_dev = kv_bytes_from_layer(spec, start, cells, req.type_k, req.type_v)
    kv_host = kv_bytes_from_layer(spec, 0, cells, req.type_k, req.type_v) - kv_dev
    kv_formula = (f"Σ layers (row_bytes({req.type_k}, n_head_kv·{spec.head_dim_k}) + row_bytes({req.type_v}, "
                  f"n_head_kv·{spec.head_dim_v})) × cells; cells = pad(n_ctx {req.llama_n_ctx}, 256) → "
                  f"{cells.n_stream} stream(s) × {cells.cells_base}"
                  + (f" ({cells.cells_swa} in sliding-window layers)" if spec.has_swa else ""))
    dev = {"cuda": "CUDA0", "metal": "Metal"}.get(kind, "CPU")
    if kv_dev:
        terms.append(Term("kv", "KV cache", kv_dev, "device", kv_formula, f"{dev} KV"))
    if kv_host:
        terms.append(Term("kv", "KV cache (CPU layers)", kv_host, _pool(kind, False), kv_formula, "CPU KV"))
    terms.append(Term("output", "output buffer (logits)", output_bytes(spec, req.n_seq), _pool(kind, False),
                      f"n_vocab {spec.vocab_size} × n_seq {req.n_seq} × 4 B (float32 logits)", "CPU output"))
    gpu_layers = 0 if start >= spec.n_layers else spec.n_layers - start
    ce = compute_estimate(spec, n_kv=cells.cells_base, n_ubatch=n_ubatch, n_outputs=n_outputs,
                          flash_attn=req.flash_attn_on, kind=kind, gpu_layers=gpu_layers,
                          type_k=req.type_k, type_v=req.type_v, n_kv_swa=cells.cells_swa)
    terms.append(Term("compute", "compute buffer", ce.device, "device", ce.formula, f"{dev} compute"))
    if ce.host:
        terms.append(Term("compute", "compute buffer (host)", ce.host, "host", ce.host_formula, "CPU compute"))
    unified = device.unified or kind == "cpu"
    notes: list[str] = []
    mapped = sum(t.bytes for t in terms if t.key == "weights")
    if unified and mapped > wp.physical_bytes:
        terms.append(Term("weights", "weights mapped twice (counted once)", wp.physical_bytes - mapped, "device",
                          "overlap of the Metal and CPU mapped file ranges", None))
    if wp.repacked:
        notes.append(f"llama.cpp repacks {len(wp.repacked)} weight tensors for this CPU "
                     f"({', '.join(device.cpu_features)}): CPU_REPACK is a second copy beside the mapping")
    return MemoryBreakdown(tuple(terms), unified, tuple(notes)), cells


def _other_backend(spec: ModelSpec, device: DeviceProfile, req: FitRequest) -> MemoryBreakdown:
    """torch / mlx: weights as the engine holds them once loaded, KV as its caches allocate it.

    Where the engine cannot use the device (torch on Metal, mlx on CUDA) it runs
    on the CPU: in a unified machine's memory, or in a discrete device's host.
    """
    rw = resident_weights(spec, req.backend, device.kind, req.dtype, packed=req.packed)
    pool = "host" if rw.runs_on == "cpu" and device.kind != "cpu" and not device.unified else "device"
    kv = kv_bytes(spec, req.n_ctx, req.type_k, req.type_v, backend=req.backend, n_seq=req.n_seq)
    block = "16-token blocks" if req.backend == "torch" else "256-token steps (mlx-lm)"
    terms = (Term("weights", f"weights ({rw.dtype})", rw.bytes, pool, rw.formula, None),
             Term("kv", "KV cache", kv, pool, f"{req.backend} KV: n_seq × tokens in {block} × bytes/token", None))
    notes = ([rw.note] if rw.note and pool == "device" else []) + [f"{req.backend}: activations and work areas are not counted"]
    return MemoryBreakdown(terms, device.unified or device.kind == "cpu", tuple(notes))


def unsupported(device: DeviceProfile, req: FitRequest) -> str | None:
    """Why ``req.backend`` cannot run on this discrete device at all (mlx on CUDA), else None."""
    if req.backend == "llama.cpp":
        return None
    runs_on, note = backend_device(req.backend, device.kind)
    if runs_on == "cpu" and device.kind != "cpu" and not device.unified:
        return f"not supported: {note}, so this device's memory is not used; use --backend torch or llama.cpp here"
    return None


# ---- verdicts and searches ---------------------------------------------------------

def _fits(spec: ModelSpec, device: DeviceProfile, req: FitRequest) -> bool:
    """Whether req fits; only reached for supported (device, backend) pairs (fit_device returns first)."""
    bd, _ = breakdown(spec, device, req)
    if bd.device_bytes > device.usable_bytes:
        return False
    return device.host_memory_bytes is None or bd.host_bytes <= device.host_memory_bytes


def _trained_ctx(spec: ModelSpec) -> int:
    return spec.n_ctx_train or 1 << 20


def max_context(spec: ModelSpec, device: DeviceProfile, req: FitRequest) -> int | None:
    """Largest per-sequence context (a multiple of 256, up to the trained length) that fits."""
    hi = max(1, _trained_ctx(spec) // CTX_STEP)
    if not _fits(spec, device, replace(req, n_ctx=CTX_STEP, n_ctx_total=None)):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(spec, device, replace(req, n_ctx=mid * CTX_STEP, n_ctx_total=None)):
            lo = mid
        else:
            hi = mid - 1
    best = lo * CTX_STEP
    if best == (_trained_ctx(spec) // CTX_STEP) * CTX_STEP and spec.n_ctx_train:
        best = spec.n_ctx_train if _fits(spec, device, replace(req, n_ctx=spec.n_ctx_train, n_ctx_total=None)) else best
    return best


def max_parallel(spec: ModelSpec, device: DeviceProfile, req: FitRequest) -> int | None:
    """Most sequences of ``req.n_ctx`` tokens each that fit (up to llama.cpp's 256)."""
    if not _fits(spec, device, replace(req, n_seq=1, n_ctx_total=None)):
        return None
    lo, hi = 1, MAX_PARALLEL
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(spec, device, replace(req, n_seq=mid, n_ctx_total=None)):
            lo = mid
        else:
            hi = mid - 1
    return lo


def best_kv_type(spec: ModelSpec, device: DeviceProfile, req: FitRequest) -> str | None:
    """The most faithful KV type (f16, then q8_0, then q4_0, K = V) that fits this request."""
    for t in KV_PREFERENCE:
        if _fits(spec, device, replace(req, type_k=t, type_v=t, flash_attn=True if t != "f16" else req.flash_attn)):
            return t
    return None


def max_ubatch(spec: ModelSpec, device: DeviceProfile, req: FitRequest) -> int | None:
    """Largest llama.cpp -ub below the requested one that makes the plan fit (a smaller compute buffer)."""
    ub = req.n_ubatch // 2
    while ub >= 32:
        if _fits(spec, device, replace(req, n_ubatch=ub)):
            return ub
        ub //= 2
    return None


def offload_plan(spec: ModelSpec, device: DeviceProfile, req: FitRequest) -> Offload | None:
    """Most layers to keep on the accelerator (-ngl) when everything does not fit; None if none fits."""
    if device.kind == "cpu" or device.unified or not _fits(spec, device, replace(req, n_gpu_layers=0)):
        return None
    lo, hi = 0, spec.n_layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(spec, device, replace(req, n_gpu_layers=mid)):
            lo = mid
        else:
            hi = mid - 1
    bd, _ = breakdown(spec, device, replace(req, n_gpu_layers=lo))
    return Offload(lo, bd.device_bytes, bd.host_bytes)


def llama_command(spec: ModelSpec, req: FitRequest, cells: LlamaCells | None, device: DeviceProfile,
                  n_gpu_layers: int | None = None) -> str:
    """The llama.cpp command line that realises this plan."""
    path = spec.path if " " not in spec.path else f'"{spec.path}"'
    tool = "llama-server" if req.n_seq > 1 else "llama-cli"
    parts = [tool, "-m", path, "-c", str(cells.n_ctx if cells else req.llama_n_ctx)]
    if req.n_seq > 1:
        parts += ["-np", str(req.n_seq)]
    if device.kind != "cpu":
        ngl = req.n_gpu_layers if n_gpu_layers is None else n_gpu_layers
        parts += ["-ngl", "999" if ngl < 0 else str(ngl)]
    else:
        parts += ["-ngl", "0"]
    if (req.type_k, req.type_v) != ("f16", "f16"):
        parts += ["-ctk", req.type_k, "-ctv", req.type_v]
    parts += ["-fa", "on" if req.flash_attn_on else "off"]
    if req.n_batch != 2048:
        parts += ["-b", str(req.n_batch)]
    if req.n_ubatch != 512:
        parts += ["-ub", str(req.n_ubatch)]
    if req.kv_unified:
        parts.append("-kvu")
    if req.swa_full and spec.has_swa:
        parts.append("--swa-full")
    if not req.mmap:
        parts.append("--no-mmap")
    return " ".join(parts)


def _reason(bd: MemoryBreakdown, usable: int, device: DeviceProfile) -> str:
    need = bd.device_bytes
    where = "this machine" if device.kind == "cpu" or device.unified else "the device"
    cap = ""
    if device.working_set_cap_bytes is not None and usable == device.working_set_cap_bytes:
        cap = " (the GPU working-set cap)"
    parts = ", ".join(f"{k} {fmt_bytes(bd.sum(k, None if bd.unified else 'device'))}"
                      for k in ("weights", "kv", "compute", "output") if bd.sum(k, None if bd.unified else 'device'))
    if need <= usable:
        return f"fits: {fmt_bytes(need)} of {fmt_bytes(usable)} usable on {where}{cap}, {fmt_bytes(usable - need)} left"
    return (f"needs {fmt_bytes(need)} on {where} but {fmt_bytes(usable)} is usable{cap}: "
            f"{fmt_bytes(need - usable)} over ({parts})")


def fit_device(spec: ModelSpec, device: DeviceProfile, request: FitRequest | None = None, *,
               search: bool = True) -> FitResult:
    """The verdict for one device: fits or not, the breakdown, and what would fit instead.

    ``search=False`` skips the searches (largest context, most sequences, KV
    type, offload) for callers that only need the verdict.
    """
    req = request or FitRequest()
    warnings = []
    if spec.n_ctx_train and req.n_ctx > spec.n_ctx_train:
        warnings.append(f"--ctx {req.n_ctx} is beyond the model's trained context {spec.n_ctx_train}"
                        + (f" (RoPE scaling {spec.rope_scaling} is declared)" if spec.rope_scaling else ""))
    warnings += list(spec.missing)
    bd, cells = breakdown(spec, device, req)
    usable = device.usable_bytes
    fits = bd.device_bytes <= usable
    host_over = device.host_memory_bytes is not None and bd.host_bytes > device.host_memory_bytes
    reason = _reason(bd, usable, device)
    if host_over:
        fits = False
        reason = (f"the device part fits but the host needs {fmt_bytes(bd.host_bytes)} of "
                  f"{fmt_bytes(device.host_memory_bytes)}")
    why = unsupported(device, req)
    if why:
        fits, reason = False, why
    result = FitResult(spec.name, device, req, bd, cells, usable, fits, reason,
                       command=llama_command(spec, req, cells, device) if req.backend == "llama.cpp" else "",
                       warnings=tuple(warnings), supported=why is None)
    if not search or why:
        return result
    mctx = max_context(spec, device, req)
    mpar = max_parallel(spec, device, req) if mctx and mctx >= req.n_ctx else (None if not mctx else 0)
    kvt = best_kv_type(spec, device, req)
    llama = req.backend == "llama.cpp"
    off = None if fits or not llama else offload_plan(spec, device, req)
    ub = None if fits or not llama else max_ubatch(spec, device, req)
    suggestions: list[str] = []
    if not fits:
        if ub:
            suggestions.append(f"--ubatch {ub}")
        if mctx:
            suggestions.append(f"--ctx {mctx}")
        if kvt and kvt != req.type_k:
            suggestions.append(f"-ctk {kvt} -ctv {kvt}")
        if req.n_seq > 1 and mpar:
            suggestions.append(f"--parallel {mpar}")
        if off is not None:
            suggestions.append(f"--gpu-layers {off.gpu_layers}")
    command = result.command
    if not fits and off is not None and req.backend == "llama.cpp":
        command = llama_command(spec, req, cells, device, off.gpu_layers)
    return replace(result, max_ctx=mctx, max_parallel=mpar, kv_type=kvt, offload=off, ubatch=ub,
                   suggestions=tuple(suggestions), command=command)


def _cpu_view(dev: DeviceProfile) -> DeviceProfile:
    """The CPU side of a device: the same memory when unified, the host RAM when known, else unchanged."""
    if dev.kind == "cpu":
        return dev
    if dev.unified:
        return replace(dev, kind="cpu", working_set_cap_bytes=None)
    if dev.host_memory_bytes is None:
        return dev
    from localinfer.devices.profiles import DEFAULT_LOCAL_RESERVE

    return replace(dev, display_name=f"{dev.display_name} (host CPU)", kind="cpu", memory_bytes=dev.host_memory_bytes,
                   reserve=DEFAULT_LOCAL_RESERVE, unified=True, host_memory_bytes=None)


def check_load(spec: ModelSpec, plan, device: DeviceProfile | None = None, backend: str = "llama.cpp") -> FitResult:
    """Would ``plan`` (a :class:`localinfer.backends.engine.LoadPlan`) fit?  For ``chat``/``run`` before loading.

    ``plan.n_ctx`` is llama.cpp's total context (shared by ``plan.n_seq``
    sequences).  The device defaults to this machine (probing CUDA for the
    torch backend).  torch and mlx are checked where the engine will compute:
    on the CPU when the plan asks for it or the backend cannot use the device.
    The result's ``reason`` and ``suggestions`` are what to print when refusing.
    """
    from localinfer.devices.profiles import local_device

    on_cpu = backend != "llama.cpp" and ((plan.device or "").lower() == "cpu"
                                         or (backend == "torch" and plan.n_gpu_layers == 0))
    dev = device or local_device(probe_cuda=backend == "torch" and not on_cpu)
    if backend != "llama.cpp":
        dev = _cpu_view(dev) if on_cpu or backend_device(backend, dev.kind)[0] == "cpu" else dev
    outputs = plan.options.get("n_outputs_max")
    if outputs is None and backend == "llama.cpp":
        import sys

        mod = sys.modules.get("localinfer.backends.llamacpp.engine")
        outputs = getattr(mod, "DEFAULT_OUTPUTS_MAX", None)
    req = FitRequest(
        n_ctx=max(1, -(-plan.n_ctx // plan.n_seq)), n_seq=plan.n_seq, type_k=plan.type_k, type_v=plan.type_v,
        flash_attn=plan.flash_attn, n_gpu_layers=plan.n_gpu_layers, n_batch=plan.n_batch,
        n_ubatch=min(plan.n_ubatch, plan.n_batch), n_outputs_max=outputs, backend=backend,
        mmap=bool(plan.options.get("mmap", True)), swa_full=bool(plan.options.get("swa_full", True)),
        n_ctx_total=plan.n_ctx, dtype=plan.dtype if backend != "llama.cpp" else None,
        packed=bool(plan.options.get("packed")) and backend == "torch")
    return fit_device(spec, dev, req)
