"""A split's plan beside llama.cpp ``--fit``'s over the same devices (issue 41's rule, several devices).

:func:`llamacpp_split_fit` is ``--fit``'s choice over the split's devices
(:func:`localinfer.plan.fit_cpp.fit_cpp_split`: fit.cpp's steps over localinfer's model of llama.cpp's dry
run; a device's target is its free memory − the 1 GiB margin, for a profile its usable bytes, as
:func:`localinfer.plan.moe_fit.llamacpp_fit` takes it on one device), its flags line, its bytes per device
as the load allocates them and its predicted decode (:func:`localinfer.plan.split.split_speed`, the host CPU
one more stage).

:func:`split_plan` is localinfer's: the request as asked when it fits, else the ``-ts`` that fits
(:func:`localinfer.plan.split.fit_split`'s suggestion); when none does and the user left ``-ngl`` and the
tensor placement to it, the fewest ``--n-cpu-moe N`` (and part of one more layer's experts back on a device)
whose ``-ts`` fits, for a dense model the most ``-ngl``.  ``--fit``'s own plan is a candidate too
("localinfer (as --fit)"), judged on the devices' usable bytes and the host's RAM, and the fastest predicted
decode wins (a tie: the one keeping the least on the host), so localinfer's plan fits wherever ``--fit``'s
does and is never predicted slower; where ``--fit``'s wins it is adopted and the reasons say so.  As on one
device (:mod:`localinfer.plan.moe_fit`, whose search pieces it shares), that search also tries q8_0 KV for an
f16 request and, for ``objective="ttft"`` (the time to the first token of a prompt filling the context), larger
``-ub``; another KV type or ``-ub`` than asked wins only when predicted :data:`~localinfer.plan.moe_fit.KV_GAIN`
better, and the reasons give both plans' speeds.  On unified memory (this machine's devices and its host share
one pool) localinfer puts no weights in host RAM, and a plan that does is judged on the pool: its host part and
this machine's devices together.  ``fit --devices``, ``plan --split`` and ``report --split`` all take their plan
from :func:`plan_split` in a :func:`split_env`.

``--fit`` works at the ``-c`` it is given; only when ``-c`` is left out does llama.cpp start from the train
context and let fit.cpp's step 2 lower it: ``ctx_auto`` shows that choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from localinfer.backends.memory import FitRequest
from localinfer.backends.registry import memory_model
from localinfer.backends.split import SplitBreakdown
from localinfer.errors import UsageError
from localinfer.plan.fit_cpp import MARGIN, fit_cpp_split
from localinfer.plan.moe_fit import (KV_GAIN, OWN_PARTIAL, asked, changed, check_objective, moe_layers, rank,
                                     request_flags, score, speeds, variants)
from localinfer.plan.split import SplitSpeed, fit_split, split_speed
from localinfer.units import fmt_bytes

AS_FIT = "localinfer (as --fit)"
AS_ASKED = "the request as asked"


@dataclass(frozen=True)
class SplitEnv:
    """The devices of a split and what judges and times a plan on them."""

    devices: tuple                      # SplitDevice, llama.cpp's order
    profiles: tuple = ()                # one per device (None: unknown), for the speed
    remote: tuple = ()
    link: object = None                 # Link, for the speed
    host: object = None                 # HostProfile: the host part's speed
    host_usable: int | None = None      # the host's RAM a plan may use (None: not judged)
    cpu_features: tuple[str, ...] = ()
    margin: int = MARGIN                # --fit's target: free − margin (0 for profiles: usable is free − 1 GiB)


def split_env(setup, link=None, host_name: str | None = None, rpc: bool = False) -> tuple[SplitEnv, int | None]:
    """(the SplitEnv ``fit``, ``plan`` and ``report`` judge and time a split's plans in, the host RAM its verdict
    judges) for a SplitSetup (:mod:`localinfer.plan.split_devices`); ``host_name``: ``--host``; ``rpc``: running
    workers, whose free memory --fit's target takes the 1 GiB margin from (a profile's usable bytes already do)."""
    from localinfer.devices.hosts import host_for

    host = host_for(setup.host, host_name)
    # --host names the RAM the verdict judges; the plans' search always judges the host's RAM where it is known
    verdict = setup.host_usable if not host_name or host is None or host.unified else host.usable_bytes
    judged = verdict if verdict is not None or host is None or host.unified else host.usable_bytes
    return SplitEnv(setup.devices, setup.profiles, setup.remote, link, host, judged, setup.host.cpu_features,
                    MARGIN if rpc else 0), verdict


def plan_split(spec, env: SplitEnv, req: FitRequest, host_usable: int | None = None, *, shares=None,
               objective: str = "decode", other_kv: bool = True):
    """(the request's SplitFit, localinfer's plan, ``--fit``'s): :func:`~localinfer.plan.split.fit_split`'s verdict
    (``host_usable``: the host RAM it judges) and :func:`split_plan` over it, as ``fit --devices`` shows them."""
    sf = fit_split(spec, env.devices, req, shares=shares, host_usable=host_usable, cpu_features=env.cpu_features,
                   profiles=env.profiles or None, link=env.link, remote=env.remote or None, host=env.host)
    return (sf, *split_plan(spec, env, req, sf, shares=shares, objective=objective, other_kv=other_kv))


@dataclass(frozen=True)
class SplitPlan:
    """One placement over a split: its flags, bytes per device and on the host, and predicted speed."""

    by: str                             # "localinfer", "llama.cpp --fit" or "localinfer (as --fit)"
    request: FitRequest
    shares: tuple | None                # -ts (None: llama.cpp's default, by free memory)
    breakdown: SplitBreakdown
    fits_host: bool
    speed: SplitSpeed | None
    line: str = ""                      # --fit's answer line (its own flags, -c included)
    steps: tuple[str, ...] = ()
    dry_run: tuple[int, ...] = ()       # --fit: each device's bytes as its dry run measures them
    targets: tuple[int, ...] = ()       # --fit: each device's target
    experts_on_host: int = 0            # layers whose routed experts are all in host RAM
    touched_on_host: int = 0            # layers with any routed expert in host RAM
    host_usable: int | None = None      # the host RAM it was judged on
    host_need: int = 0                  # what was judged against it (on unified memory: this machine's devices too)
    what: str = ""                      # localinfer's: which candidate (AS_ASKED, "the -ts that fits", ...)
    why: str = ""
    alternatives: tuple = field(default=(), compare=False)

    @property
    def fits_devices(self) -> bool:
        return self.breakdown.fits

    @property
    def fits(self) -> bool:
        return self.fits_devices and self.fits_host

    @property
    def decode_tok_s(self) -> float:
        return self.speed.decode_tok_s if self.speed is not None else 0.0

    @property
    def ttft_s(self) -> float:
        """Seconds to the first token of a prompt filling the context (inf without a speed)."""
        sp = self.speed
        return sp.context / sp.prefill_tok_s if sp is not None and sp.prefill_tok_s else float("inf")

    @property
    def layers_on_devices(self) -> int:
        return sum(len(d.layers) for d in self.breakdown.devices)

    def flags(self) -> str:
        """llama.cpp's flags for the placement (``--fit``'s: its answer line)."""
        if self.line:
            return self.line
        return request_flags(self.request, self.shares)

    def summary(self) -> str:
        """A short form for a table: whose plan (as asked, ``-ngl``/``-ts`` or ``--fit``'s), what is in host RAM,
        another KV type or -ub."""
        r = self.request
        if self.line:
            bits = ["--fit's"]
        elif self.what == AS_ASKED:
            bits = ["as asked"]
        else:
            ngl = [] if r.n_gpu_layers < 0 or r.n_gpu_layers > 900 else [f"-ngl {r.n_gpu_layers}"]
            bits = [" ".join(ngl + ["-ts " + ",".join(str(c) for c in self.breakdown.counts())])]
        if self.experts_on_host:
            bits.append(f"{self.experts_on_host} layers' experts in RAM")
        if r.type_k != "f16" or r.type_v != "f16":
            bits.append(f"KV {r.type_k}" + (f"/{r.type_v}" if r.type_v != r.type_k else ""))
        if r.n_ubatch != FitRequest.n_ubatch:
            bits.append(f"-ub {r.n_ubatch}")
        return ", ".join(bits)

    def to_dict(self) -> dict:
        return {"by": self.by, "flags": self.flags(), "n_ctx": self.request.n_ctx, "n_seq": self.request.n_seq,
                "n_gpu_layers": self.request.n_gpu_layers, "n_cpu_moe": self.request.n_cpu_moe,
                "type_k": self.request.type_k, "type_v": self.request.type_v, "n_ubatch": self.request.n_ubatch,
                "override_tensor": [list(p) for p in self.request.override_tensor],
                "tensor_split": None if self.shares is None else list(self.shares),
                "split": self.breakdown.to_dict(), "host_total": self.breakdown.host_total,
                "experts_on_host": self.experts_on_host, "touched_on_host": self.touched_on_host,
                "fits_devices": self.fits_devices,
                "host_usable": self.host_usable, "host_need": self.host_need, "fits_host": self.fits_host,
                "fits": self.fits,
                "speed": None if self.speed is None else self.speed.to_dict(), "steps": list(self.steps),
                "dry_run_bytes": list(self.dry_run), "targets": list(self.targets), "what": self.what, "why": self.why,
                "summary": self.summary(),
                "alternatives": [a.to_dict() for a in self.alternatives]}


def measure(spec, env: SplitEnv, req: FitRequest, shares, by: str, *, sb=None, speed=None, **kw) -> SplitPlan:
    """``req`` split by ``shares`` over ``env``'s devices, judged and timed (``sb``, ``speed``: that breakdown and
    its speed where the caller has them already, as fit_split made them over ``env``)."""
    if sb is None:
        sb = memory_model(req.backend).split(spec, env.devices, req, shares, cpu_features=env.cpu_features)
        speed = split_speed(spec, sb, req, env.profiles or None, env.link, env.remote or None, host=env.host)
    host = sb.host_total
    if sb.host_tensors and env.host is not None and env.host.unified:   # this machine's devices share its memory
        host += sum(d.total for d, dev in zip(sb.devices, env.devices) if not dev.remote)
    fits_host = env.host_usable is None or host <= env.host_usable
    exps: dict[int, list[bool]] = {}
    for t in spec.tensors:
        if t.name.startswith("blk.") and "_exps." in t.name:
            exps.setdefault(int(t.name.split(".")[1]), []).append(t.name in sb.host_tensors)
    return SplitPlan(by, req, None if shares is None else tuple(shares), sb, fits_host, speed,
                     experts_on_host=sum(all(v) for v in exps.values()),
                     touched_on_host=sum(any(v) for v in exps.values()), host_usable=env.host_usable, host_need=host,
                     **kw)


def llamacpp_split_fit(spec, env: SplitEnv, req: FitRequest, *, shares=None,
                       ctx_auto: bool = False) -> SplitPlan | None:
    """llama.cpp ``--fit``'s choice over ``env``'s devices (``shares``: the user's ``-ts``), measured as the load
    allocates it; None where fit.cpp gives up (``-ngl``, ``-ot`` or ``-ts`` set and the request not fitting)."""
    c = fit_cpp_split(spec, env.devices, req, ctx_auto=ctx_auto, margin=env.margin,
                      cpu_features=env.cpu_features, shares=shares)
    if c is None:
        return None
    ts = shares if shares is not None else (tuple(c.tensor_split) or None)    # with a -ts, fit.cpp only keeps it
    return measure(spec, env, c.request, ts, "llama.cpp --fit", line=c.line(), steps=c.steps, dry_run=c.used,
                   targets=tuple(d.free - env.margin for d in env.devices))


def _search(ok, lo: int, hi: int, smallest: bool):
    """(k, result) of the smallest (else largest) k in [lo, hi] where ``ok(k)`` is not None, assumed monotone."""
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        r = ok(mid)
        if r is not None:
            found = (mid, r)
            hi, lo = (mid - 1, lo) if smallest else (hi, mid + 1)
        else:
            lo, hi = (mid + 1, hi) if smallest else (lo, mid - 1)
    return found


def _own(spec, env: SplitEnv, req: FitRequest) -> list[SplitPlan]:
    """localinfer's placements with weights in host RAM whose ``-ts`` fits the devices (see the module)."""
    model = memory_model(req.backend)
    n = spec.n_layers

    def split_of(r):
        sb = model.fitting_split(spec, env.devices, r, cpu_features=env.cpu_features)
        return None if sb is None else sb.counts()

    out = []
    moe_at = set(moe_layers(spec))
    moe = bool(moe_at)
    if moe:
        base = replace(req, n_gpu_layers=-1, override_tensor=(), cpu_moe=False)
        hit = _search(lambda k: split_of(replace(base, n_cpu_moe=k)), 0, n, smallest=True)
        if hit is not None:
            k, counts = hit
            r = replace(base, n_cpu_moe=k)
            out.append(measure(spec, env, r, counts, "localinfer",
                               what="the fewest layers' experts in RAM (--n-cpu-moe) whose -ts fits" if k else
                                    "every expert on the devices with the -ts that fits"))
            if k > 0 and (k - 1) in moe_at:
                for part, pattern in OWN_PARTIAL.items():   # part of one more layer's experts back on a device
                    p = replace(r, n_cpu_moe=k - 1, override_tensor=((f"blk\\.{k - 1}{pattern}", "CPU"),))
                    counts = split_of(p)
                    if counts is None:
                        break
                    out.append(measure(spec, env, p, counts, "localinfer",
                                       what=f"the fewest experts in RAM whose -ts fits, layer {k - 1}'s "
                                           f"{'up' if part == 'up' else 'up and gate'} experts on a device"))
            return out
    base = replace(req, n_cpu_moe=n) if moe else req
    hit = _search(lambda k: split_of(replace(base, n_gpu_layers=k)), 1, n, smallest=False)
    if hit is not None:
        k, counts = hit
        out.append(measure(spec, env, replace(base, n_gpu_layers=k), counts, "localinfer",
                           what="the most layers on the devices (-ngl) whose -ts fits"
                               + (", every expert in RAM" if moe else "")))
    return out


def _key(req: FitRequest, objective: str):
    """The order of the candidates: :func:`~localinfer.plan.moe_fit.rank`, then the KV type and -ub asked, then the
    least in host RAM (so without speeds: the plan as asked keeping the least there)."""
    return lambda c: (*rank(c, req, objective), asked(c, req), -c.breakdown.host_total)


def split_plan(spec, env: SplitEnv, req: FitRequest, sf, *, shares=None, objective: str = "decode",
               other_kv: bool = True) -> tuple[SplitPlan | None, SplitPlan | None]:
    """(localinfer's plan, ``--fit``'s) for ``req`` over ``env``'s devices; ``sf``: the request's SplitFit (its
    breakdown and the ``-ts`` that fits); ``shares``: the user's ``-ts``; ``objective``: decode or ttft;
    ``other_kv``: the search may try q8_0 KV for an f16 request (``report``'s rows, one per KV type, do not).
    Either None: nothing fits / fit.cpp gives up."""
    check_objective(objective)
    ref = llamacpp_split_fit(spec, env, req, shares=shares)
    cands = [measure(spec, env, req, shares, "localinfer", sb=sf.breakdown, speed=sf.speed, what=AS_ASKED)]
    if sf.suggestion is not None:
        cands.append(measure(spec, env, req, sf.suggestion.counts(), "localinfer", what="the -ts that fits"))
    unified = env.host is not None and env.host.unified    # host RAM is this machine's device memory: no gain
    if not any(c.fits for c in cands) and req.n_gpu_layers == -1 and not req.overridden and not unified:
        for i, r in enumerate(variants(req, objective, other_kv)):
            try:
                cands += _own(spec, env, r)
            except UsageError:
                if i == 0:             # the request's own KV type: its error stands
                    raise
    if ref is not None:
        cands.append(replace(ref, by=AS_FIT))
    good = [c for c in cands if c.fits]
    if not good:
        return None, ref
    best = max(good, key=_key(req, objective))  # the first of equals: localinfer's own before --fit's
    others = tuple(c for c in good if c is not best)
    why = _why(best, others, ref, req, objective, gives_up(req, shares))
    return replace(best, why=why, alternatives=others), ref


def gives_up(req: FitRequest, shares) -> str:
    """Why fit.cpp gives up on ``req`` (it does not fit as asked)."""
    if req.n_gpu_layers != -1 or req.overridden or shares is not None:
        return "--fit gives up: -ngl, -ot or -ts set by the user"
    return "--fit gives up: no layout of its own fits"


def over(p: SplitPlan) -> str:
    """What of a plan does not fit, in words ("" when it fits)."""
    bits = [f"{d.name} needs {fmt_bytes(d.total)} of {fmt_bytes(d.usable)}" for d in p.breakdown.devices if not d.fits]
    if not p.fits_host:
        mine = "" if p.host_need == p.breakdown.host_total else " with this machine's devices"
        bits.append(f"the host needs {fmt_bytes(p.host_need)} of RAM{mine}, of {fmt_bytes(p.host_usable or 0)}")
    return "; ".join(bits)


def _speed(p: SplitPlan) -> str:
    return (f"predicted {speeds(p)}" if p.speed is not None else
            "no predicted speed (a device's or the host's profile lacks bandwidth or FLOP/s)")


def _more(best: SplitPlan, top: SplitPlan) -> tuple[int, str]:
    """(how many more layers' experts, or layers, ``best`` keeps on the devices than ``top``, the unit)."""
    if best.touched_on_host or top.touched_on_host:
        return top.touched_on_host - best.touched_on_host, "layers' experts"
    return best.layers_on_devices - top.layers_on_devices, "layers"


def _why(best: SplitPlan, others, ref: SplitPlan | None, req, objective: str, no_ref: str) -> str:
    own = [o for o in others if o.by == "localinfer"]
    key = _key(req, objective)
    if best.by == AS_FIT:
        if not own:
            return f"localinfer adopts --fit's plan: none of its own fits these devices ({_speed(best)})"
        top = max(own, key=key)
        if best.speed is None:
            how = "neither has a speed; --fit's keeps less in host RAM"
        elif score(top, objective) > score(best, objective):      # another KV type or -ub, under KV_GAIN better
            mine = [o for o in own if asked(o, req)]
            how = (f"{_speed(best)}; {top.flags()} would give {speeds(top)}: under {KV_GAIN - 1:.0%} better, so the "
                   "KV type and -ub asked for stay" + (f"; its own best as asked, {max(mine, key=key).flags()}, is "
                                                   f"{_speed(max(mine, key=key))}" if mine else ""))
        else:
            how = f"its own best, {top.flags()}, is {_speed(top)} against {speeds(best)}"
        return f"localinfer adopts --fit's plan: {how}"
    goal = "" if objective == "decode" else f" (best predicted TTFT of a {req.n_ctx:,}-token prompt)"
    parts = [f"{best.what}: {_speed(best)}{goal}, {fmt_bytes(best.breakdown.host_total)} on the host"]
    same = [o for o in others if asked(o, req)]
    alt = [o for o in others if not asked(o, req) and score(o, objective) > score(best, objective)]
    if not asked(best, req) and same and best.speed is not None:
        top = max(same, key=key)
        parts.append(changed(best, top, req, *_more(best, top), "the devices"))
    elif asked(best, req) and alt:
        top = max(alt, key=key)
        parts.append(f"{top.flags()} would give {speeds(top)}: under {KV_GAIN - 1:.0%} better, so the KV type "
                     "and -ub asked for stay")
    if ref is None:
        parts.append(no_ref)
    elif not ref.fits:
        parts.append(f"--fit's plan does not fit: {over(ref)}")
    else:
        parts.append(f"--fit's plan: {_speed(ref).removeprefix('predicted ')}")
    return "; ".join(parts)
