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
it fits wherever ``--fit``'s plan fits on the host and is never predicted slower.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from localinfer.backends.memory import FitRequest
from localinfer.errors import UsageError
from localinfer.plan.fit_cpp import fit_cpp
from localinfer.plan.host_speed import plan_speed
from localinfer.units import fmt_bytes

# fit.cpp's LAYER_FRACTION_UP/GATE, experts only: fit.cpp's ".*" also sends the layer's router and shared experts
OWN_PARTIAL = {"up": r"\.ffn_(gate|gate_up|down)_(ch|)exps", "gate": r"\.ffn_down_(ch|)exps"}
PARTIAL_WORDS = {"up": "up of one more on the GPU", "gate": "up and gate of one more on the GPU",
                 "attn": "one of them with its router and shared FFN in RAM too"}
KV_GAIN = 1.03    # another KV type than asked is recommended only when predicted this much faster


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

    def flags(self) -> str:
        """llama.cpp's flags for the placement."""
        r = self.request
        out = ["-ngl 999" if r.n_gpu_layers < 0 or r.n_gpu_layers > 900 else f"-ngl {r.n_gpu_layers}"]
        if r.n_cpu_moe:
            out.append(f"--n-cpu-moe {r.n_cpu_moe}")
        if r.override_tensor:
            out.append("-ot '" + ",".join(f"{p}={b}" for p, b in r.override_tensor) + "'")
        if r.type_k != "f16" or r.type_v != "f16":
            out.append(f"-ctk {r.type_k} -ctv {r.type_v} -fa on")
        return " ".join(out)

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


def _kv_choices(spec, req) -> list[tuple[str, str]]:
    out = [(req.type_k, req.type_v)]
    if (req.type_k, req.type_v) == ("f16", "f16"):
        out.append(("q8_0", "q8_0"))
    return out


def moe_plan(spec, device, host, req: FitRequest) -> MoePlan | None:
    """The placement with the fastest predicted decode that fits the device and the host (see the module).

    None when the model has no experts, the device is a CPU or unified memory, or no placement fits."""
    if device.kind == "cpu" or device.unified or not moe_layers(spec):
        return None
    cands: list[MoePlan] = []
    for tk, tv in _kv_choices(spec, req):
        r = replace(req, type_k=tk, type_v=tv, flash_attn=True if tk != "f16" else req.flash_attn)
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
    def rank(c):
        asked = (c.request.type_k, c.request.type_v) == (req.type_k, req.type_v)
        return (c.decode_tok_s * (KV_GAIN if asked else 1.0), (c.speed or {}).get("prefill_tok_s", 0))

    best = max(good, key=rank)
    others = tuple(c for c in good if c is not best)
    return replace(best, why=_why(best, others, ref, req), alternatives=others)


def _why(best: MoePlan, others, ref: MoePlan | None, req) -> str:
    parts = [f"{best.experts_on_host} layers' experts in RAM ({fmt_bytes(best.host_bytes)} of host memory) is the "
             f"fewest that fits {fmt_bytes(best.device_bytes)} on the GPU"]
    if (best.request.type_k, best.request.type_v) != (req.type_k, req.type_v):
        same = [o for o in others if (o.request.type_k, o.request.type_v) == (req.type_k, req.type_v)]
        if same:
            top = max(same, key=lambda o: o.decode_tok_s)
            more = top.experts_on_host - best.experts_on_host
            parts.append(f"KV {best.request.type_k} " + (f"keeps {more} more layers' experts on the GPU" if more > 0
                                                          else "reads fewer bytes per token")
                         + f": {best.decode_tok_s:.1f} tok/s against {top.decode_tok_s:.1f} with KV {req.type_k}")
    else:
        kv = [o for o in others if (o.request.type_k, o.request.type_v) != (req.type_k, req.type_v)]
        if kv:
            top = max(kv, key=lambda o: o.decode_tok_s)
            parts.append(f"KV {top.request.type_k} would give {top.decode_tok_s:.1f} tok/s ({top.flags()}): under "
                         f"{KV_GAIN - 1:.0%} faster, so the KV type asked for stays")
    if best.partial in ("up", "gate"):
        parts.append(f"layer {best.experts_on_host}'s {best.partial}{' and up' if best.partial == 'gate' else ''} "
                     "experts stay on the GPU")
    if ref is not None:
        parts.append(f"--fit's plan: {ref.summary()}, {ref.decode_tok_s:.1f} tok/s"
                     + ("" if ref.fits_host else " (its host part does not fit the host's RAM)"))
    return "; ".join(parts)
