"""`localinfer plan --split HOSTS`: the planner's speed model and KV budget for a model split across hosts.

:class:`SplitSpeedModel` is a :class:`~localinfer.plan.speed.SpeedModel` whose
steps visit the stages in turn: each stage takes its share of the weights
(``W_i / W``) of the step its own device's profile predicts, and every step
adds the network (:func:`localinfer.plan.split.split_speed`'s terms for the
step's tokens).  The KV budget is what the tightest device leaves: each
device's room after its weights and compute buffer, divided by its share of
the KV cache.  The split is the placement ``fit --devices`` recommends for one request of the workload's
length (:func:`split_placement`) where it keeps every weight on the devices (llama.cpp's default ``-ts`` or one
that fits); the planner does not time weights in host RAM, so where that placement puts experts there the
default split is planned and the placement is only shown.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from localinfer.backends.memory import FitRequest
from localinfer.model.cost import model_cost
from localinfer.plan.speed import Estimate, SpeedModel, llamacpp_speed_model
from localinfer.plan.split import RPC_OVERHEAD_S, _token_traffic, fit_split
from localinfer.units import ceil_div


class SplitSpeedModel(SpeedModel):
    """Stages in turn, each at its own device's speed model for its share of the weights, plus the network."""

    def __init__(self, spec, setup, sb, req: FitRequest, link=None, label: str = "split", placement=None):
        used = [i for i, d in enumerate(sb.devices) if d.layers or d.output]
        total = sum(sb.devices[i].weights for i in used) or 1
        cost = model_cost(spec)
        first = setup.profiles[used[0]]
        super().__init__(cost, first, None, req.n_ubatch)
        self.device = replace(first, name=label, display_name=f"split over {label}", power_w=None)
        # each stage at its device's model for the whole model (llama.cpp's kernels, or the roofline), scaled by
        # its share of the weights
        self.stages = [(sb.devices[i].weights / total, llamacpp_speed_model(spec, setup.profiles[i], None, req.n_ubatch))
                       for i in used]
        self.spec, self.sb, self.req, self.link, self.remote = spec, sb, req, link, list(setup.remote)
        self.remote_used = any(self.remote[i] for i in used)
        self.placement = placement          # Placement: fit --devices' plan for the split, shown beside the plan

    def _net(self, tokens: int, rows: int) -> float:
        if self.link is None:
            return 0.0
        nbytes, trips = _token_traffic(self.spec, self.sb, self.req, self.remote, tokens, rows)
        return self.link.transfer_s(nbytes, trips) + (RPC_OVERHEAD_S if self.remote_used else 0.0)

    def _sum(self, parts, net: float) -> Estimate:
        seconds = sum(f * e.seconds for f, e in parts) + net
        compute = sum(f * e.compute_s for f, e in parts)
        memory = sum(f * e.memory_s for f, e in parts) + net
        source = parts[0][1].source if parts else "unknown"
        return Estimate(seconds, compute, memory, sum(e.flops for _, e in parts) // max(len(parts), 1),
                        sum(e.bytes for _, e in parts) // max(len(parts), 1), source)

    def decode_step(self, batch: int = 1, context: int = 1, kv="f16", rows: int = 1,
                    shared_prefix: int = 0) -> Estimate:
        parts = [(f, m.decode_step(batch, context, kv, rows, shared_prefix)) for f, m in self.stages]
        return self._sum(parts, self._net(batch * rows, batch * rows))

    def prefill(self, batch: int, new: int, cached: int = 0) -> Estimate:
        parts = [(f, m.prefill(batch, new, cached)) for f, m in self.stages]
        calls = ceil_div(batch * new, self.ubatch)
        return self._sum(parts, calls * self._net(min(self.ubatch, batch * new), batch))


def split_budget(spec, setup, n_ctx: int, shares=None) -> tuple[int, object]:
    """(KV bytes the split leaves, its breakdown): the tightest device's room over its share of the KV;
    ``shares``: a ``-ts`` (default: llama.cpp's, by free memory)."""
    sf = fit_split(spec, setup.devices, FitRequest(n_ctx=n_ctx), shares=shares, host_usable=setup.host_usable,
                   cpu_features=setup.host.cpu_features, search=False)
    sb = sf.breakdown
    total_kv = sum(d.kv for d in sb.devices) or 1
    rooms = [(d.usable - d.weights - d.compute) * total_kv // d.kv for d in sb.devices if d.kv]
    return (min(rooms) if rooms else 0), sb


@dataclass(frozen=True)
class Placement:
    """``fit --devices``' plan for one f16 request of the workload's length, ``--fit``'s, and whether the planner
    plans on it (every weight on the devices)."""

    plan: object            # SplitPlan or None: none fits
    ref: object             # SplitPlan or None: --fit gives up
    used: bool

    @property
    def shares(self):
        return self.plan.breakdown.counts() if self.used and self.plan.shares is not None else None

    def to_dict(self) -> dict:
        return {"plan": None if self.plan is None else self.plan.to_dict(),
                "llamacpp_fit": None if self.ref is None else self.ref.to_dict(), "planned_on": self.used}

    @staticmethod
    def describe(p) -> str:
        """A plan's flags (and the split where llama.cpp's default makes it) and its predicted speeds."""
        from localinfer.plan.moe_fit import speeds

        split = "" if p.shares is not None or p.line else \
            f", llama.cpp's default split ({','.join(map(str, p.breakdown.counts()))} layers)"
        return f"{p.flags()}{split}: {'predicted ' + speeds(p) if p.speed is not None else 'no predicted speed'}"

    def lines(self) -> list[str]:
        """The placement and --fit's, each with its predicted speed, for the text output."""
        p, r = self.plan, self.ref
        out = [("placement (fit --devices' plan for one request): " + self.describe(p)) if p is not None else
               "placement: fit --devices finds none that fits one request at this length; the default split is planned"]
        if p is not None and not self.used:
            out.append("  it puts weights in host RAM, which plan --split does not time: the default split is planned")
        out.append("llama.cpp --fit: " + ("gives up" if r is None else
                                          self.describe(r) + ("" if r.fits else ", does not fit")))
        return out


def split_placement(spec, setup, n_ctx: int, link=None) -> Placement:
    """``fit --devices``' plan (:func:`localinfer.plan.split_fit.plan_split`) for one f16 request of ``n_ctx``
    tokens over the setup, and --fit's."""
    from localinfer.plan.split_fit import plan_split, split_env

    env, host_usable = split_env(setup, link)
    _, plan, ref = plan_split(spec, env, FitRequest(n_ctx=n_ctx), host_usable)
    used = plan is not None and not plan.breakdown.host_tensors
    return Placement(plan, ref, used)
