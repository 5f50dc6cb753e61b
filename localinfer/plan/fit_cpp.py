"""llama.cpp's ``--fit`` decision (``common/fit.cpp``, ``common_params_fit_impl``), step by step, on one device
or several.

:func:`fit_cpp` (one device) and :func:`fit_cpp_devices` (``nd`` devices in llama.cpp's order, RPC workers
first) replay what llama.cpp does with its dry runs, with any measure of a request's device bytes standing in
for them (localinfer's memory model of a profile, or of ``worker --mem`` devices), so that the decision can be
checked against the real ``llama-fit-params`` on the same devices.  The target of a device is its free memory
− the margin (``-fitt``, 1 GiB).  The steps:

1. the request as given (the train context for an automatic one): no change when every device is within its
   target (``<=``);
2. when the devices together are over their targets and the context is automatic (llama.cpp's default
   ``-c``; an explicit ``-c 0`` sets ``n_ctx_min`` to UINT32_MAX, which turns this off): measure at the
   minimum context (``-fitc``, 4096, × the sequences of a non-unified cache) and, when that is under the
   summed targets (for several devices less ``(nd + 1)`` × a layer's weights / 2 for a dense model, / 6 for a
   MoE one), interpolate the context linearly between minimum and train context, rounded down to 256 ×
   streams; one device: done (the layers are not touched, and not checked again); else carry on at that
   context (at the minimum when even that is over);
3. (``-ngl``, ``-ot`` or, over several devices, ``-ts`` set by the user: fit.cpp gives up, None) dense-only
   layers, back to front over the devices (:func:`localinfer.plan.fit_cpp_steps.fill_dense`);
4. for a MoE model whose dense part fits with every expert on the CPU: full layers front to back, then part
   of one more layer (:func:`localinfer.plan.fit_cpp_steps.fill_full`).

The ``-ot`` list is fit.cpp's, one entry per layer; an entry that names no tensor (the layer index after the
last, which fit.cpp's indexing reaches) is kept in :attr:`FitCpp.overrides` as the tool prints it and left out
of :attr:`FitCpp.request`, where llama.cpp ignores it anyway.  With several devices the layers go by
``-ts`` (:attr:`FitCpp.tensor_split`: the layers of each device), which the measure gets as the shares.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from localinfer.backends.memory import FitRequest
from localinfer.errors import UsageError
from localinfer.plan.fit_cpp_steps import (ALL_EXPERTS, CPU, FRACTIONS, GivesUp, Ngl, entries, fill_dense,
                                           fill_full, layer_overrides, layout, live, merged, parse_override)

__all__ = ["MARGIN", "N_CTX_MIN", "FULL_CTX", "FRACTIONS", "FitCpp", "fit_cpp", "fit_cpp_devices", "fit_cpp_split",
           "parse_override", "layer_overrides", "merged", "state_request", "ctx_request"]

MARGIN = 1 << 30                 # fit.cpp's default target of free memory per device (-fitt 1024)
N_CTX_MIN = 4096                 # common_params::fit_params_min_ctx (-fitc)
FULL_CTX = (1 << 32) - 1         # fit_params_min_ctx after an explicit -c 0: no context reduction
U32 = (1 << 32) - 1

# measure(request, shares): (total, model) bytes of each device; shares None: llama.cpp's default split
Measure = Callable[[FitRequest, "tuple[int, ...] | None"], Sequence[tuple[int, int]]]


@dataclass(frozen=True)
class FitCpp:
    """fit.cpp's answer: its flags, where the experts went and the device bytes it measured for them."""

    request: FitRequest                    # the flags as localinfer applies them (its context included)
    n_gpu_layers: int                      # -ngl as the tool prints it (-1: unchanged)
    overrides: tuple[tuple[str, str], ...]  # -ot as the tool prints it, in its order
    n_full: int                            # layers whose experts stay on a device (fit.cpp's n_full, summed)
    on_host: int                           # layers whose routed experts are all in host memory
    partial: str | None                    # the first partial layer's fraction: "up", "gate", "attn" or None
    device_bytes: int                      # one device: its bytes; several: their sum
    steps: tuple[str, ...] = ()            # what it tried, for the reasons printed
    n_ctx: int = 0                         # -c as the tool prints it (llama.cpp's total context)
    tensor_split: tuple = ()               # -ts: layers per device (several devices only), or the user's shares
    used: tuple[int, ...] = ()             # bytes of each device
    ctx_reduced: bool = False              # step 2 lowered the context

    @property
    def changed(self) -> bool:
        return self.n_gpu_layers != -1 or bool(self.overrides) or self.ctx_reduced

    def line(self) -> str:
        """The tool's answer line (``-c N -ngl N [-ts A,B] [-ot "P=B,..."]``)."""
        ts = list(self.tensor_split)
        while len(ts) > 1 and ts[-1] == 0:     # trailing devices without a share, as the tool trims them
            ts.pop()
        out = f"-c {self.n_ctx} -ngl {self.n_gpu_layers}"
        if len(ts) > 1:                        # each share cast to an unsigned integer, as the tool prints it
            out += " -ts " + ",".join(str(int(x)) for x in ts)
        if self.overrides:
            out += ' -ot "' + ",".join(f"{p}={b}" for p, b in self.overrides) + '"'
        return out


def ctx_request(req: FitRequest, total: int) -> FitRequest:
    """``req`` at llama.cpp's total context ``total`` (``-c``)."""
    per = max(1, total // req.n_seq)
    return replace(req, n_ctx=per, n_ctx_total=None if per * req.n_seq == total else total)


def state_request(spec, req: FitRequest, n_layer: int, n_part: int, overflow: str = "moe") -> FitRequest:
    """The request fit.cpp measures on one device for ``n_layer`` layers of which ``n_part`` overflow (the first
    of them by ``overflow``), the -ot entries that name a tensor merged per fraction."""
    names = [t.name for t in spec.tensors]
    ents = live(names, layout(spec.n_layers, [Ngl(n_layer, n_part, overflow)], [CPU]))
    return replace(req, n_gpu_layers=n_layer, override_tensor=merged(ents), cpu_moe=False, n_cpu_moe=0)


def fit_cpp(spec, req: FitRequest, device_bytes: Callable[[FitRequest], int], target: int, *,
            ctx_auto: bool = False, n_ctx_min: int = N_CTX_MIN) -> FitCpp | None:
    """llama.cpp ``--fit``'s choice for ``req`` on one device (see the module).

    ``device_bytes(request)``: the device's weights + KV + compute for a request; ``target``: its free memory
    minus the margin; ``ctx_auto``: the context is llama.cpp's automatic one (``req.n_ctx`` is not used).
    None where fit.cpp gives up (``-ngl`` or ``-ot`` set by the user and not fitting)."""
    return fit_cpp_devices(spec, req, lambda r, _: ((device_bytes(r), 0),), (target,), (CPU,),
                           ctx_auto=ctx_auto, n_ctx_min=n_ctx_min)


def _div(a: int, b: int) -> int:
    """C's int64 division (truncated toward zero)."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def fit_cpp_devices(spec, req: FitRequest, measure: Measure, targets: Sequence[int], names: Sequence[str], *,
                    ctx_auto: bool = False, n_ctx_min: int = N_CTX_MIN, split_set: bool = False,
                    user_split: Sequence[float] = ()) -> FitCpp | None:
    """llama.cpp ``--fit``'s choice over ``len(targets)`` devices (see the module).

    ``measure(request, shares)``: (weights + KV + compute, weights) bytes of each device for a request whose
    layers go by ``shares`` (None: llama.cpp's default split, by free memory); ``targets``: each device's free
    memory minus its margin; ``names``: each device's buffer type as llama.cpp names it (``RPC0[host:port]``;
    a device's partial layer may overflow to the next one's); ``split_set``: the user gave ``-ts`` (``measure``
    applies it for shares None), which fit.cpp accepts only where steps 1-2 need no more; ``user_split``: that
    ``-ts``, which an unchanged answer line prints back as llama-fit-params does (each share cast to an unsigned
    integer: ``-ts 0.4,0.6`` comes back ``0,0``).  None where fit.cpp gives up."""
    nd = len(targets)
    if nd == 0 or len(names) != nd:
        raise UsageError(f"fit.cpp's port needs one buffer name per device, got {len(names)} for {nd} devices")
    n = spec.n_layers
    tnames = [t.name for t in spec.tensors]
    moe = spec.n_expert > 0
    steps: list[str] = []
    streams = 1 if req.kv_unified else max(1, req.n_seq)
    n_ctx_max = min(spec.n_ctx_train * streams, U32)
    n_ctx_min_total = min(n_ctx_min * streams, U32)
    total = n_ctx_max if ctx_auto else req.llama_n_ctx
    base = ctx_request(req, total) if ctx_auto else req

    def as_is(reduced: bool) -> FitCpp:
        ts = tuple(user_split) if nd > 1 else ()     # the user's shares as given; line() prints them cast
        return FitCpp(base, base.n_gpu_layers, base.override_tensor, n, 0, None, sum(used) if nd > 1 else used[0],
                      tuple(steps), total, ts, tuple(used), reduced)

    full = measure(base, None)
    used = [t for t, _ in full]
    if all(u <= t for u, t in zip(used, targets)):
        steps.append("the request fits as it is")
        return as_is(False)

    # step 2: a smaller context
    if sum(targets) - sum(used) < 0 and ctx_auto and n_ctx_max > n_ctx_min_total:
        goal = sum(targets)
        if nd > 1:
            per_layer = sum(m for _, m in full) // max(1, min(U32 & base.n_gpu_layers, n))
            goal -= (nd + 1) * per_layer // (6 if moe else 2)
        total = n_ctx_min_total
        at_min = sum(t for t, _ in measure(ctx_request(req, total), None))
        if goal > at_min:                      # then sum(used) > sum(targets) >= goal > at_min
            total += _div((n_ctx_max - n_ctx_min_total) * (goal - at_min), sum(used) - at_min)
            total = max(total - total % (256 * streams), n_ctx_min_total)
            steps.append(f"context lowered from {n_ctx_max} to {total}")
            base = ctx_request(req, total)
            if nd <= 1:                        # fit.cpp stops here; the bytes at that context, for the report
                used = [t for t, _ in measure(base, None)]
                return as_is(True)
        else:
            steps.append(f"context lowered from {n_ctx_max} to its minimum {total}: still over the targets")
            base = ctx_request(req, total)
    if req.n_gpu_layers != -1 or req.overridden or (split_set and nd > 1):
        return None

    memo: dict = {}

    def request(states, bufts) -> FitRequest:
        return replace(base, n_gpu_layers=sum(s.n_layer for s in states), cpu_moe=False, n_cpu_moe=0,
                       override_tensor=merged(live(tnames, layout(n, states, bufts))))

    def mem(states, bufts) -> list[int]:
        key = (tuple(states), tuple(bufts))
        if key not in memo:
            shares = tuple(s.n_layer for s in states) if nd > 1 else None
            memo[key] = [t for t, _ in measure(request(states, bufts), shares)]
        return memo[key]

    surplus = 0
    if moe:
        cm = measure(replace(base, override_tensor=((ALL_EXPERTS, CPU),)), None)
        surplus = sum(t - u for t, (u, _) in zip(targets, cm))
    try:
        cur, used = fill_dense(n, moe, targets, mem, steps)
        bufts = [CPU] * nd
        if moe and surplus > 0:
            cur, bufts, used = fill_full(n, targets, names, cur, used, mem, steps)
        elif moe:
            steps.append("the dense part does not fit with every expert on the CPU")
        ents = layout(n, cur, bufts)
    except GivesUp as exc:
        steps.append(str(exc))
        return None
    exps = {int(x.split(".")[1]) for x in tnames if x.startswith("blk.") and "_exps." in x}
    on_host = sum(1 for il, f, b in ents if b == CPU and f in ("moe", "attn") and il in exps)
    partial = next((s.overflow for s in cur if s.n_part and s.overflow != "moe"), None)
    return FitCpp(request(cur, bufts), sum(s.n_layer for s in cur), entries(ents), sum(s.n_full for s in cur),
                  on_host, partial, sum(used) if nd > 1 else used[0], tuple(steps), total,
                  tuple(s.n_layer for s in cur) if nd > 1 else (), tuple(used), total != n_ctx_max and ctx_auto)


def fit_cpp_split(spec, devices, req: FitRequest, *, ctx_auto: bool = False, n_ctx_min: int = N_CTX_MIN,
                  margin: int = MARGIN, cpu_features: tuple[str, ...] = (), shares=None) -> FitCpp | None:
    """:func:`fit_cpp_devices` over ``devices`` (SplitDevice, llama.cpp's order, named as its buffer types),
    measured by localinfer's split model as llama.cpp's dry run sizes it (no mmap: the dry run reads nothing);
    the target of a device is its free memory − ``margin`` (``-fitt``); ``shares``: the user's ``-ts``."""
    from localinfer.backends.llamacpp.split import split_breakdown

    devices = tuple(devices)
    user = tuple(shares) if shares is not None and any(shares) else None

    def measure(r: FitRequest, at):
        sb = split_breakdown(spec, devices, replace(r, mmap=False), user if at is None else at,
                             cpu_features=cpu_features, dry_run=True)
        return [(d.weights + d.kv + d.compute, d.weights) for d in sb.devices]

    return fit_cpp_devices(spec, req, measure, [d.free - margin for d in devices], [d.name for d in devices],
                           ctx_auto=ctx_auto, n_ctx_min=n_ctx_min, split_set=user is not None, user_split=user or ())
