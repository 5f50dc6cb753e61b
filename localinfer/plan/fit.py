"""Will a model fit on a device, and how: the per-device verdict behind ``localinfer fit``.

``fit_device(spec, device, request)`` asks the backend's memory model (from the
registry: :mod:`localinfer.backends.llamacpp.memory`, ``cuda_backend.memory``,
:mod:`localinfer.backends.mlx.memory`, or a plugin's) for every memory term of
the request, checks it against the device's usable memory, and answers the
questions people ask next: the largest context at this parallelism, the most
parallel requests at this context, the best KV type that fits, how many layers
to keep on the accelerator, and the command line that realises the plan.
Nothing here imports torch, llama_cpp or mlx, and no backend is named.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from localinfer.backends.memory import MAX_PARALLEL, BackendMemory, FitRequest, MemoryBreakdown
from localinfer.backends.registry import DEFAULT_BACKEND, canonical, memory_model
from localinfer.devices.profiles import DeviceProfile
from localinfer.model.spec import ModelSpec
from localinfer.errors import UsageError
from localinfer.units import fmt_bytes

__all__ = ["MAX_PARALLEL", "ESTIMATE", "FitRequest", "FitResult", "LoadOption", "Offload", "backend_memory",
           "breakdown", "check_load", "fit_device", "mapped_note", "max_context", "max_parallel", "with_breakdown"]

KV_PREFERENCE = ("f16", "q8_0", "q4_0")   # most faithful first
CTX_STEP = 256
ESTIMATE = "estimate"          # FitResult.source of the backend memory model's own terms
GENERIC_TERMS = ("kv", "compute")   # what follows generic rules when no family claims the architecture


@dataclass(frozen=True)
class Offload:
    """Partial offload that fits: layers kept on the accelerator and what the host must hold."""

    gpu_layers: int        # value for -ngl
    device_bytes: int
    host_bytes: int


@dataclass(frozen=True)
class LoadOption:
    """One way to load the same plan (a llama.cpp load mode, repacking off) and the memory it takes."""

    label: str             # the backend's flags for it
    changes: dict          # FitRequest fields it sets
    needed: int            # what the verdict would use: resident, or the load peak when larger
    resident: int
    mapped: int
    load_peak: int
    fits: bool
    current: bool          # this is the request as given


@dataclass(frozen=True)
class FitResult:
    spec_name: str
    device: DeviceProfile
    request: FitRequest
    breakdown: MemoryBreakdown
    cells: Any                          # the backend's cache geometry (llama.cpp: LlamaCells), or None
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
    supported: bool = True              # False: the backend cannot use this device (see BackendMemory.runs_on)
    load_options: tuple[LoadOption, ...] = ()   # other load modes compared (memory the CPU shares only)
    source: str = ESTIMATE              # where the breakdown comes from ("llama.cpp dry run": measured here)
    generic_terms: tuple[str, ...] = ()  # terms of the estimate that follow generic rules (an unknown arch)
    estimate: MemoryBreakdown | None = None   # the estimate, when the breakdown comes from elsewhere
    measured: dict | None = None        # the source's own record as JSON (llama.cpp: its dry run's buffers)

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
            "resident_bytes": self.breakdown.resident_bytes, "mapped_bytes": self.breakdown.mapped_bytes,
            "load_peak_bytes": self.breakdown.load_peak,
            "load_options": [dict(o.__dict__) for o in self.load_options],
            "source": self.source, "generic_terms": list(self.generic_terms),
            "estimate": None if self.estimate is None else self.estimate.to_dict(),
            "measured": self.measured,
        }


def _usable_formula(d: DeviceProfile) -> str:
    text = f"memory {d.memory_bytes} − reserve {d.reserve} ({d.reserve_bytes})"
    if d.working_set_cap_bytes is not None:
        text = f"min({text}, working-set cap {d.working_set_cap_bytes})"
    return text


# ---- the breakdown ----------------------------------------------------------------

def backend_memory(backend: str) -> tuple[BackendMemory, str | None]:
    """The backend's memory model, and a note when it has none (then llama.cpp's rules stand in)."""
    model = memory_model(backend)
    if model is None:
        return memory_model(DEFAULT_BACKEND), f"{backend}: no memory model; fit shows llama.cpp's"
    return model, None


def breakdown(spec: ModelSpec, device: DeviceProfile, req: FitRequest) -> tuple[MemoryBreakdown, Any]:
    """Every memory term of ``req`` on ``device`` as its backend allocates it, and its cache geometry."""
    return backend_memory(req.backend)[0].breakdown(spec, device, req)


def unsupported(device: DeviceProfile, req: FitRequest) -> str | None:
    """Why ``req.backend`` cannot use this discrete device at all (it would run on the host CPU), else None."""
    runs_on, note = backend_memory(req.backend)[0].runs_on(device.kind)
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
    def at(n: int) -> FitRequest:
        return replace(req, n_seq=n, n_ctx_total=None)

    if not _fits(spec, device, at(1)):
        return None
    return _largest(spec, device, at, MAX_PARALLEL)


def _largest(spec: ModelSpec, device: DeviceProfile, at, cap: int) -> int:
    """The largest k in 1..cap whose request ``at(k)`` fits, given that ``at(1)`` does.

    Memory grows almost linearly in k (KV cells, logits rows), so the sizes at 1 and 2 give a guess; a
    galloping search from it finds what a bisection of 1..cap finds (fits is monotone in k either way) in
    a few breakdowns instead of log2(cap)."""
    def fits(k: int) -> bool:
        return _fits(spec, device, at(k))

    if cap < 2 or not fits(2):
        return 1
    b1 = breakdown(spec, device, at(1))[0].device_bytes
    b2 = breakdown(spec, device, at(2))[0].device_bytes
    guess = max(2, min(cap, 1 + (device.usable_bytes - b1) // max(b2 - b1, 1)))
    if fits(guess):                       # gallop up: lo fits, hi does not (or is past the cap)
        lo, step = guess, 1
        while lo + step <= cap and fits(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, cap + 1)
    else:                                 # gallop down
        hi, step = guess, 1
        while hi - step > 2 and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(hi - step, 2)
    while hi - lo > 1:                    # lo fits, hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def best_kv_type(spec: ModelSpec, device: DeviceProfile, req: FitRequest) -> str | None:
    """The most faithful KV type (f16, then q8_0, then q4_0, K = V) that fits this request."""
    for t in KV_PREFERENCE:
        try:
            if _fits(spec, device, replace(req, type_k=t, type_v=t, flash_attn=True if t != "f16" else req.flash_attn)):
                return t
        except UsageError:          # a type this model cannot cache (its head size), as llama.cpp refuses it
            continue
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


def _reason(bd: MemoryBreakdown, usable: int, device: DeviceProfile) -> str:
    need = bd.device_bytes
    where = "this machine" if device.kind == "cpu" or device.unified else "the device"
    cap = ""
    if device.working_set_cap_bytes is not None and usable == device.working_set_cap_bytes:
        cap = " (the GPU working-set cap)"
    pool = None if bd.unified else "device"
    parts = ", ".join(f"{k} {fmt_bytes(bd.sum(k, pool, resident=True))}"
                      for k in ("weights", "kv", "state", "compute", "output") if bd.sum(k, pool, resident=True))
    what = "resident " if bd.mapped_bytes != bd.resident_bytes else ""
    if bd.load_peak > bd.resident_bytes:
        what = f"at the load peak ({fmt_bytes(bd.resident_bytes)} resident after it) "
    if need <= usable:
        return (f"fits: {fmt_bytes(need)} {what}of {fmt_bytes(usable)} usable on {where}{cap}, "
                f"{fmt_bytes(usable - need)} left")
    return (f"needs {fmt_bytes(need)} {what}on {where} but {fmt_bytes(usable)} is usable{cap}: "
            f"{fmt_bytes(need - usable)} over ({parts})")


def mapped_note(bd: MemoryBreakdown) -> str | None:
    """The mapped total beside the resident figure, when they differ (information: the verdict uses resident)."""
    extra = bd.mapped_bytes - bd.resident_bytes
    if extra <= 0:
        return None
    return (f"mapped {fmt_bytes(bd.mapped_bytes)}: a process monitor shows up to this much before memory pressure; "
            f"{fmt_bytes(extra)} of it are clean file pages the kernel reclaims (read once, at load, to repack, "
            "or a row per token: the token embeddings)")


def load_options(spec: ModelSpec, device: DeviceProfile, req: FitRequest, model: BackendMemory
                 ) -> tuple[LoadOption, ...]:
    """The request under each load mode the backend offers (with the request's own first)."""
    out = []
    for label, changes in model.load_variants(spec, device, req):
        alt = replace(req, **changes)
        bd, _ = breakdown(spec, device, alt)
        out.append(LoadOption(label, dict(changes), bd.device_bytes, bd.resident_bytes, bd.mapped_bytes,
                              bd.load_peak, bd.device_bytes <= device.usable_bytes, alt == req))
    return tuple(sorted(out, key=lambda o: not o.current))


def fit_device(spec: ModelSpec, device: DeviceProfile, request: FitRequest | None = None, *,
               search: bool = True) -> FitResult:
    """The verdict for one device: fits or not, the breakdown, and what would fit instead.

    ``search=False`` skips the searches (largest context, most sequences, KV
    type, offload) for callers that only need the verdict.
    """
    req = request or FitRequest()
    model, note = backend_memory(req.backend)
    warnings = [note] if note else []
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
    why = model.refuses(spec) or unsupported(device, req)
    if why:
        fits, reason = False, why
    result = FitResult(spec.name, device, req, bd, cells, usable, fits, reason,
                       command=model.command(spec, req, cells, device),
                       warnings=tuple(warnings), supported=why is None,
                       generic_terms=GENERIC_TERMS if spec.rules_generic else ())
    if not search or why:
        return result
    mctx = max_context(spec, device, req)
    mpar = max_parallel(spec, device, req) if mctx and mctx >= req.n_ctx else (None if not mctx else 0)
    kvt = best_kv_type(spec, device, req)
    off = None if fits or not model.offload else offload_plan(spec, device, req)
    ub = None if fits or not model.offload else max_ubatch(spec, device, req)
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
    options = load_options(spec, device, req, model)
    cheaper = [o for o in options if not o.current and o.fits]
    if not fits and cheaper:
        suggestions.append(min(cheaper, key=lambda o: o.needed).label)
    command = result.command
    if not fits and off is not None:
        command = model.command(spec, req, cells, device, off.gpu_layers)
    return replace(result, max_ctx=mctx, max_parallel=mpar, kv_type=kvt, offload=off, ubatch=ub,
                   suggestions=tuple(suggestions), command=command, load_options=options)


def with_breakdown(spec: ModelSpec, result: FitResult, bd: MemoryBreakdown, source: str, *,
                   measured: dict | None = None, warnings: tuple[str, ...] | None = None) -> FitResult:
    """The same request judged on another breakdown of the same device (llama.cpp's own dry run of this
    machine): the verdict, reason and command follow it; the searches (largest context, most sequences, KV
    type, load options) stay the estimate's, and the estimate is kept beside it for comparison."""
    dev, usable = result.device, result.usable_bytes
    fits = bd.device_bytes <= usable and (dev.host_memory_bytes is None or bd.host_bytes <= dev.host_memory_bytes)
    if not result.supported:
        fits = False
    changes: dict = {}
    if fits:
        model = backend_memory(result.request.backend)[0]
        changes = {"suggestions": (), "offload": None, "ubatch": None,
                   "command": model.command(spec, result.request, result.cells, dev)}
    reason = _reason(bd, usable, dev) if result.supported else result.reason
    return replace(result, breakdown=bd, fits=fits, reason=reason, source=source, generic_terms=(),
                   estimate=result.breakdown, measured=measured,
                   warnings=result.warnings if warnings is None else warnings, **changes)


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


def check_load(spec: ModelSpec, plan, device: DeviceProfile | None = None, backend: str = DEFAULT_BACKEND
               ) -> FitResult:
    """Would ``plan`` (a :class:`localinfer.backends.engine.LoadPlan`) fit?  For ``chat``/``run`` before loading.

    ``plan.n_ctx`` is the total context (shared by ``plan.n_seq`` sequences).
    The device defaults to this machine (probing CUDA when the backend would
    use it).  The plan is checked where the engine will compute: on the CPU
    when the plan asks for it or the backend cannot use the device.  The
    result's ``reason`` and ``suggestions`` are what to print when refusing.
    """
    from localinfer.devices.profiles import local_device

    model, _ = backend_memory(canonical(backend))
    dev = device or local_device(probe_cuda=model.probes_cuda(plan))
    if model.computes_on_cpu(plan, dev.kind):
        dev = _cpu_view(dev)
    req = FitRequest(
        n_ctx=max(1, -(-plan.n_ctx // plan.n_seq)), n_seq=plan.n_seq, type_k=plan.type_k, type_v=plan.type_v,
        flash_attn=plan.flash_attn, n_gpu_layers=plan.n_gpu_layers, n_batch=plan.n_batch,
        n_ubatch=min(plan.n_ubatch, plan.n_batch), backend=canonical(backend), n_ctx_total=plan.n_ctx,
        **model.load_request(plan))
    return fit_device(spec, dev, req)
