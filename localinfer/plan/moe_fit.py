"""Where a MoE model's experts go when it does not fit whole on one GPU: llama.cpp's ``--fit`` and ours.

:func:`llamacpp_fit` is llama.cpp's ``--fit`` decision (``common/fit.cpp``, ported step by step in
:mod:`localinfer.plan.fit_cpp`) over localinfer's memory model of the device: all layers on the device when
that fits; else every layer's dense part there with the experts on the CPU, experts back front to back while
the device stays under its target (free memory − the 1 GiB margin, here the profile's usable bytes), then part
of the next layer (its ``up``, then ``up`` and ``gate``; or, when ``up`` does not fit, that layer's whole FFN,
router and shared experts included, on the CPU).  ``benchmarks/moe_fit_vs_llamacpp.py --llama-fit-params``
checks the port against the real tool over a ``worker --mem`` device.

``--fit`` maximises what sits on the GPU; it never changes the KV type, never checks host RAM and has no
speed objective.  :func:`moe_plan` searches ``--n-cpu-moe N`` (whole layers' experts, the fewest that fit)
for the request's KV type and for q8_0, checks the host part against the host's RAM, includes ``--fit``'s
own choice as a candidate, and keeps the fastest predicted decode (:mod:`localinfer.plan.host_speed`), so
it fits wherever ``--fit``'s plan fits on the host and is never predicted slower.  The search's pieces (the
KV types and -ub tried, the objective's order, the words for a change of KV type) are shared with the search
over several devices (:mod:`localinfer.plan.split_fit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from localinfer.backends.memory import FitRequest
from localinfer.errors import UsageError
from localinfer.model.kv import row_bytes
from localinfer.plan.fit_cpp import fit_cpp
from localinfer.plan.host_speed import plan_speed
from localinfer.units import fmt_bytes, fmt_duration

# fit.cpp's LAYER_FRACTION_UP/GATE, experts only: fit.cpp's ".*" also sends the layer's router and shared experts
OWN_PARTIAL = {"up": r"\.ffn_(gate|gate_up|down)_(ch|)exps", "gate": r"\.ffn_down_(ch|)exps"}
PARTIAL_WORDS = {"up": "up of one more on the GPU", "gate": "up and gate of one more on the GPU",
                 "attn": "one of them with its router and shared FFN in RAM too"}
KV_GAIN = 1.03    # another KV type or -ub than asked is recommended only when predicted this much better
OBJECTIVES = ("decode", "ttft")
UB_CHOICES = (1024, 2048, 4096)   # -ub tried for the TTFT objective, up to the request's -b


@dataclass(frozen=True)
class MoePlan:
    """One placement of a MoE model on a GPU and its host, with its bytes and predicted speed."""

    by: str                      # "localinfer" or "llama.cpp --fit"
    request: FitRequest
    experts_on_host: int         # layers whose experts are all in host RAM
    partial: str | None          # "up" / "gate": one more layer keeps these experts on the GPU; "attn" (--fit
                                 # only): one more layer's router and shared experts in host RAM too
    device_bytes: int
    host_bytes: int
    fits_device: bool
    fits_host: bool
    speed: dict | None
    why: str = ""
    alternatives: tuple = field(default=(), compare=False)

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def decode_tok_s(self) -> float:
        return (self.speed or {}).get("decode_tok_s") or 0.0

    @property
    def ttft_s(self) -> float:
        return (self.speed or {}).get("ttft_s") or float("inf")

    def flags(self) -> str:
        """llama.cpp's flags for the placement."""
        return request_flags(self.request)

    def summary(self) -> str:
        """A short form: the -ngl and how many layers' experts are in RAM (a long -ot list in words)."""
        ngl = self.flags().split(" -")[0]
        kv = f", KV {self.request.type_k}" if self.request.type_k != "f16" else ""
        part = f" + {PARTIAL_WORDS[self.partial]}" if self.partial else ""
        return f"{ngl}, {self.experts_on_host} layers' experts in RAM{part}{kv}"

    def to_dict(self) -> dict:
        return {"by": self.by, "flags": self.flags(), "n_gpu_layers": self.request.n_gpu_layers,
                "n_cpu_moe": self.request.n_cpu_moe, "override_tensor": [list(p) for p in self.request.override_tensor],
                "type_k": self.request.type_k, "type_v": self.request.type_v,
                "experts_on_host": self.experts_on_host, "partial": self.partial,
                "device_bytes": self.device_bytes, "host_bytes": self.host_bytes, "fits_device": self.fits_device,
                "fits_host": self.fits_host, "fits": self.fits, "speed": self.speed, "why": self.why,
                "summary": self.summary(),
                "alternatives": [a.to_dict() for a in self.alternatives]}


def _measure(spec, device, host, req, by, on_host, partial=None) -> MoePlan:
    from localinfer.plan.fit import breakdown

    bd, _ = breakdown(spec, device, req)
    fits_dev = bd.device_bytes <= device.usable_bytes
    fits_host = host is None or bd.host_bytes <= host.usable_bytes
    return MoePlan(by, req, on_host, partial, bd.device_bytes, bd.host_bytes, fits_dev, fits_host,
                   plan_speed(spec, device, host, req))


def _device_bytes(spec, device, req) -> int:
    from localinfer.plan.fit import breakdown

    return breakdown(spec, device, req)[0].device_bytes


def _fits_device(spec, device, req) -> bool:
    return _device_bytes(spec, device, req) <= device.usable_bytes


def moe_layers(spec) -> list[int]:
    """Layers that hold routed experts (``ffn_*_exps``)."""
    return sorted({int(t.name.split(".")[1]) for t in spec.tensors if t.name.startswith("blk.") and "_exps." in t.name})


def llamacpp_fit(spec, device, host, req: FitRequest) -> MoePlan | None:
    """llama.cpp ``--fit``'s choice for this request on one device (:func:`localinfer.plan.fit_cpp.fit_cpp` over
    localinfer's memory model of the device, target = its usable bytes: memory − the 1 GiB margin); None for a
    dense model, or where fit.cpp gives up (-ngl or -ot already set)."""
    if not moe_layers(spec):
        return None
    choice = fit_cpp(spec, req, lambda r: _device_bytes(spec, device, r), device.usable_bytes)
    if choice is None:
        return None
    plan = _measure(spec, device, host, choice.request, "llama.cpp --fit", choice.on_host, choice.partial)
    return replace(plan, why="; ".join(choice.steps) + " (--fit keeps the most on the GPU under the 1 GiB margin; "
                                                         "it has no speed objective)")


def _fewest_on_host(spec, device, req) -> int | None:
    """Smallest ``--n-cpu-moe N`` (with every layer on the device) that fits the device, or None."""
    n = spec.n_layers
    base = replace(req, n_gpu_layers=-1, override_tensor=(), cpu_moe=False)
    if not _fits_device(spec, device, replace(base, n_cpu_moe=n)):
        return None
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits_device(spec, device, replace(base, n_cpu_moe=mid)):
            hi = mid
        else:
            lo = mid + 1
    return lo


def kv_choices(req) -> list[tuple[str, str]]:
    """K and V types to try: the request's; for f16 also q8_0 (half the KV bytes, so more weights on the GPU)."""
    out = [(req.type_k, req.type_v)]
    if (req.type_k, req.type_v) == ("f16", "f16"):
        out.append(("q8_0", "q8_0"))
    return out


def ub_choices(req, objective: str) -> list[int]:
    """Micro-batches to try: the request's; for TTFT also larger ones up to -b (each copies the host experts over
    the link once, so fewer copies per prompt, for a larger compute buffer)."""
    if objective != "ttft":
        return [req.n_ubatch]
    return [req.n_ubatch] + [u for u in UB_CHOICES if req.n_ubatch < u <= req.n_batch]


def check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise UsageError(f"--objective takes {' or '.join(OBJECTIVES)}, not {objective!r}", flag="--objective")


def variants(req, objective: str, other_kv: bool = True) -> list:
    """The request with each KV type (:func:`kv_choices`; only its own without ``other_kv``) and -ub
    (:func:`ub_choices`) a placement search tries, the request's own first (flash attention on for a quantized
    KV type, as llama.cpp needs)."""
    check_objective(objective)
    kvs = kv_choices(req) if other_kv else [(req.type_k, req.type_v)]
    return [replace(req, type_k=tk, type_v=tv, flash_attn=True if tk != "f16" else req.flash_attn, n_ubatch=ub)
            for tk, tv in kvs for ub in ub_choices(req, objective)]


def request_flags(r: FitRequest, shares=None) -> str:
    """llama.cpp's flags for a request's placement: -ngl, --n-cpu-moe, -ot, -ts (``shares`` of several devices),
    another KV type, another -ub."""
    out = ["-ngl 999" if r.n_gpu_layers < 0 or r.n_gpu_layers > 900 else f"-ngl {r.n_gpu_layers}"]
    if r.n_cpu_moe:
        out.append(f"--n-cpu-moe {r.n_cpu_moe}")
    if r.override_tensor:
        out.append("-ot '" + ",".join(f"{p}={b}" for p, b in r.override_tensor) + "'")
    if shares is not None and len(shares) > 1:
        out.append("-ts " + ",".join(f"{s:g}" for s in shares))
    if r.type_k != "f16" or r.type_v != "f16":
        out.append(f"-ctk {r.type_k} -ctv {r.type_v} -fa on")
    if r.n_ubatch != FitRequest.n_ubatch:
        out.append(f"-ub {r.n_ubatch}")
    return " ".join(out)


def score(c, objective: str) -> float:
    """Higher is better: decode tok/s, or prompts per second (1 / TTFT); ``c``: a MoePlan or a SplitPlan."""
    return c.decode_tok_s if objective == "decode" else 1.0 / c.ttft_s


def asked(c, req) -> bool:
    """Whether a plan keeps the KV types and -ub of the request."""
    r = c.request
    return (r.type_k, r.type_v, r.n_ubatch) == (req.type_k, req.type_v, req.n_ubatch)


def rank(c, req, objective: str) -> tuple:
    """The search's order (higher is better): the objective, a plan as asked counted :data:`KV_GAIN` better, then
    the other objective."""
    other = "ttft" if objective == "decode" else "decode"
    return score(c, objective) * (KV_GAIN if asked(c, req) else 1.0), score(c, other)


def speeds(c) -> str:
    """Both predicted speeds of a plan: decode tok/s and the TTFT of a prompt filling the context."""
    return f"{c.decode_tok_s:.1f} tok/s, TTFT {fmt_duration(c.ttft_s)}"


def changed(best, top, req, more: int, unit: str, where: str) -> str:
    """Why ``best`` (another KV type or -ub than asked) beats ``top`` (the best as asked): what it changes, the
    ``more`` ``unit`` it keeps on ``where`` (negative: puts in RAM), and ``top``'s speeds."""
    what = []
    if (best.request.type_k, best.request.type_v) != (req.type_k, req.type_v):
        kv = lambda r: row_bytes(r.type_k, 256) + row_bytes(r.type_v, 256)      # noqa: E731
        what.append(f"KV {best.request.type_k} (each token reads {kv(best.request) / kv(req):.2f}x the KV bytes)")
    if best.request.n_ubatch != req.n_ubatch:
        what.append(f"-ub {best.request.n_ubatch} (host experts copied over the link "
                    f"{-(-req.n_ctx // best.request.n_ubatch)} times a prompt, not "
                    f"{-(-req.n_ctx // req.n_ubatch)})")
    return (" and ".join(what) + (f" keeps {more} more {unit} on {where}" if more > 0 else
                                  f" puts {-more} more {unit} in RAM" if more < 0 else
                                  f" keeps as many {unit} on {where}")
            + f": against {speeds(top)} as asked")


def moe_plan(spec, device, host, req: FitRequest, objective: str = "decode") -> MoePlan | None:
    """The placement with the best predicted ``objective`` (``decode``: tok/s; ``ttft``: the time to the first
    token of a prompt filling the context) that fits the device and the host (see the module).

    None when the model has no experts, the device is a CPU or unified memory, or no placement fits."""
    check_objective(objective)
    if device.kind == "cpu" or device.unified or not moe_layers(spec):
        return None
    cands: list[MoePlan] = []
    for r in variants(req, objective):
        try:
            n = _fewest_on_host(spec, device, r)
        except UsageError:           # a KV type this model cannot cache
            continue
        if n is None:
            continue
        r = replace(r, n_gpu_layers=-1, override_tensor=(), cpu_moe=False, n_cpu_moe=n)
        cands.append(_measure(spec, device, host, r, "localinfer", n))
        if n > 0 and (n - 1) in moe_layers(spec):
            for part, pattern in OWN_PARTIAL.items():   # part of one more layer's experts back on the GPU
                p = replace(r, n_cpu_moe=n - 1, override_tensor=((f"blk\\.{n - 1}{pattern}", "CPU"),))
                if not _fits_device(spec, device, p):
                    break
                cands.append(_measure(spec, device, host, p, "localinfer", n - 1, part))
    ref = llamacpp_fit(spec, device, host, req)
    if ref is not None:
        cands.append(replace(ref, by="localinfer (as --fit)"))
    good = [c for c in cands if c.fits]
    if not good:
        return None
    best = max(good, key=lambda c: rank(c, req, objective))
    others = tuple(c for c in good if c is not best)
    return replace(best, why=_why(best, others, ref, req, objective), alternatives=others)


def _why(best: MoePlan, others, ref: MoePlan | None, req, objective: str = "decode") -> str:
    goal = "decode" if objective == "decode" else f"TTFT of a {req.n_ctx:,}-token prompt"
    parts = [f"{best.experts_on_host} layers' experts in RAM ({fmt_bytes(best.host_bytes)} of host memory) is the "
             f"fewest that fits {fmt_bytes(best.device_bytes)} on the GPU"
             + (f" at -ub {best.request.n_ubatch}" if best.request.n_ubatch != req.n_ubatch else "")
             + f": {speeds(best)} (best predicted {goal})"]
    if not asked(best, req):
        same = [o for o in others if asked(o, req)]
        if same:
            top = max(same, key=lambda o: score(o, objective))
            parts.append(changed(best, top, req, top.experts_on_host - best.experts_on_host, "layers' experts",
                                 "the GPU"))
    else:
        alt = [o for o in others if not asked(o, req)]
        if alt:
            top = max(alt, key=lambda o: score(o, objective))
            parts.append(f"{top.flags()} would give {speeds(top)}: under {KV_GAIN - 1:.0%} better, so the KV type "
                         "and -ub asked for stay")
    if best.partial in ("up", "gate"):
        parts.append(f"layer {best.experts_on_host}'s {best.partial}{' and up' if best.partial == 'gate' else ''} "
                     "experts stay on the GPU")
    if ref is not None:
        parts.append(f"--fit's plan: {ref.summary()}, {speeds(ref)}"
                     + ("" if ref.fits_host else " (its host part does not fit the host's RAM)"))
    return "; ".join(parts)
