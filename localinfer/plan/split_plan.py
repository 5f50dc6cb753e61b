"""`localinfer plan --split HOSTS`: the planner's speed model and KV budget for a model split across hosts.

:class:`SplitSpeedModel` is a :class:`~localinfer.plan.speed.SpeedModel` whose
steps visit the stages in turn: each stage takes its share of the weights
(``W_i / W``) of the step its own device's profile predicts, and every step
adds the network (:func:`localinfer.plan.split.split_speed`'s terms for the
step's tokens).  The KV budget is what the tightest device leaves: each
device's room after its weights and compute buffer, divided by its share of
the KV cache.  The split is the placement ``fit --devices`` recommends for the workload's requests at its
length (:func:`split_placement`).  Where it keeps weights in host RAM (``--n-cpu-moe``, ``-ot``, layers below
``-ngl``) the host is one more stage (:class:`~localinfer.plan.host_speed.HostWork`: a batch's tokens read the
union of the experts they route to, or from 32 tokens a call with a local GPU the weights they use cross its
link), and the devices' stages lose the bytes and FLOPs the host does; without a host profile to time it, the
default split is planned and the placement only shown.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from localinfer.backends.memory import MAX_PARALLEL, FitRequest
from localinfer.errors import UsageError
from localinfer.model.cost import model_cost
from localinfer.plan.host_speed import HostWork
from localinfer.plan.speed import Estimate, SpeedModel, llamacpp_speed_model
from localinfer.plan.split import RPC_OVERHEAD_S, _token_traffic, fit_split, local_gpu_link
from localinfer.units import ceil_div


class SplitSpeedModel(SpeedModel):
    """Stages in turn, each at its own device's speed model for its share of the weights, plus the network."""

    def __init__(self, spec, setup, sb, req: FitRequest, link=None, label: str = "split", placement=None,
                 host=None):
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
        self.host = None                    # HostWork: the weights in host RAM, a stage of their own
        if sb.host_tensors:
            if host is None:
                raise UsageError("--split: the plan keeps weights in host RAM and no host profile times them",
                                 flag="--split", hint="use device profiles that name their host (host = \"NAME\")")
            self.host = HostWork(spec, sb.host_tensors, host, sb.host_kv / max(sb.n_ctx, 1),
                                 local_gpu_link(setup.profiles, setup.remote))

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
        tokens, h = batch * rows, self.host
        if h is None:
            return self._sum(parts, self._net(tokens, tokens))
        kv_tokens = batch * context * self._kv_scale(kv)
        seconds, memory, compute = h.decode(tokens, kv_tokens)
        if not h.offloaded(tokens):          # the host computes its tensors: the devices do the rest
            parts = [(f, _less(e, h.read_bytes(tokens, kv_tokens), tokens * h.flops)) for f, e in parts]
        elif h.kv_bytes(kv_tokens):          # weights copied to the GPU; the host layers' KV and attention stay
            parts = [(f, _less(e, h.kv_bytes(kv_tokens), 0)) for f, e in parts]
        return _plus(self._sum(parts, self._net(tokens, tokens)), seconds, memory, compute)

    def prefill(self, batch: int, new: int, cached: int = 0) -> Estimate:
        parts = [(f, m.prefill(batch, new, cached)) for f, m in self.stages]
        tokens = batch * new
        calls = ceil_div(tokens, self.ubatch)
        net = calls * self._net(min(self.ubatch, tokens), batch)
        h = self.host
        if h is None:
            return self._sum(parts, net)
        seconds = h.prefill(tokens, self.ubatch)
        if not h.offloaded(min(self.ubatch, tokens)):
            parts = [(f, _less(e, 0, tokens * h.flops)) for f, e in parts]
        return _plus(self._sum(parts, net), seconds, 0.0, seconds)

    def _kv_scale(self, kv) -> float:
        """The KV bytes a token of ``kv`` holds against f16's (the host layers' KV was sized at f16)."""
        cost = model_cost(self.spec)
        f16 = cost.kv_read_bytes(1024, "f16")
        return cost.kv_read_bytes(1024, kv) / f16 if f16 else 1.0


def _less(e: Estimate, nbytes: float, flops: float) -> Estimate:
    """A whole-model estimate without ``nbytes`` read and ``flops`` computed elsewhere (its fixed time kept);
    with ``nbytes`` 0 the memory time shrinks with the FLOPs' share (a prefill's weight reads)."""
    ff = min(1.0, flops / e.flops) if e.flops else 0.0
    fb = (min(1.0, nbytes / e.bytes) if e.bytes else 0.0) if nbytes else ff
    compute, memory = e.compute_s * (1 - ff), e.memory_s * (1 - fb)
    fixed = max(0.0, e.seconds - max(e.compute_s, e.memory_s))
    return Estimate(fixed + max(compute, memory), compute, memory, round(e.flops * (1 - ff)),
                    round(e.bytes * (1 - fb)), e.source)


def _plus(e: Estimate, seconds: float, memory: float, compute: float) -> Estimate:
    """``e`` followed by the host's stage."""
    return Estimate(e.seconds + seconds, e.compute_s + compute, e.memory_s + memory, e.flops, e.bytes, e.source)


def split_budget(spec, setup, n_ctx: int, shares=None, request: FitRequest | None = None) -> tuple[int, object]:
    """(KV bytes the split leaves, its breakdown): the tightest device's room over its share of the KV (the host
    layers' KV counts in the whole); ``shares``: a ``-ts`` (default: llama.cpp's, by free memory); ``request``: the
    placement's (its ``--n-cpu-moe``, ``-ot``, ``-ngl``; default: every weight on the devices)."""
    sf = fit_split(spec, setup.devices, request or FitRequest(n_ctx=n_ctx), shares=shares,
                   host_usable=setup.host_usable, cpu_features=setup.host.cpu_features, search=False)
    sb = sf.breakdown
    total_kv = sum(d.kv for d in sb.devices) + sb.host_kv or 1
    rooms = [(d.usable - d.weights - d.compute) * total_kv // d.kv for d in sb.devices if d.kv]
    return (min(rooms) if rooms else 0), sb


@dataclass(frozen=True)
class Placement:
    """``fit --devices``' plan for the workload's f16 requests, ``--fit``'s, and whether the planner plans on it
    (every weight on the devices, or some in host RAM where a host profile times them)."""

    plan: object            # SplitPlan or None: none fits
    ref: object             # SplitPlan or None: --fit gives up
    used: bool
    host: object = None     # HostProfile that times the weights the plan keeps in host RAM
    link: float | None = None   # a local GPU's link (bytes/s), over which calls of 32+ tokens copy host weights

    @property
    def shares(self):
        return self.plan.breakdown.counts() if self.used and self.plan.shares is not None else None

    @property
    def request(self) -> FitRequest | None:
        """The plan's placement (``--n-cpu-moe``, ``-ot``, ``-ngl``, ``-ub``) with an f16 cache, which the planner
        sizes its KV budget on (None: not used, so the default split)."""
        if not self.used:
            return None
        return replace(self.plan.request, type_k="f16", type_v="f16")

    @property
    def in_host_ram(self) -> bool:
        return self.used and bool(self.plan.breakdown.host_tensors)

    def to_dict(self) -> dict:
        return {"plan": None if self.plan is None else self.plan.to_dict(),
                "llamacpp_fit": None if self.ref is None else self.ref.to_dict(), "planned_on": self.used,
                "host": None if self.host is None or not self.in_host_ram else self.host.name}

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
        n = p.request.n_seq if p is not None else 1
        what = "one request" if n == 1 else f"{n} requests"
        speed = "" if n == 1 else " (one request's decode and TTFT; the table times the batch)"
        out = [(f"placement (fit --devices' plan for {what}): " + self.describe(p) + speed) if p is not None else
               "placement: fit --devices finds none that fits the requests at this length; the default split is "
               "planned"]
        if p is not None and not self.used:
            out.append("  it puts weights in host RAM and no host profile times them: the default split is planned")
        elif self.in_host_ram:
            copied = " (from 32 tokens a call, copied over the GPU's link)" if self.link else ""
            union = ", a batch's tokens reading the union of their experts" if p.touched_on_host else ""
            below = " below 32 tokens a call" if self.link else ""
            cores = ("RAM and cores" if self.host.computes else
                     f"RAM (its profile gives no CPU cores or FLOP/s: a prompt's host share{below} has no speed)")
            out.append(f"  planned on it: the weights it keeps in host RAM are timed on {self.host.name}'s "
                       f"{cores}{union}{copied}")
        out.append("llama.cpp --fit: " + ("gives up" if r is None else
                                          self.describe(r) + ("" if r.fits else ", does not fit")))
        return out


def split_placement(spec, setup, n_ctx: int, link=None, n_seq: int = 1) -> Placement:
    """``fit --devices``' plan (:func:`localinfer.plan.split_fit.plan_split`) for ``n_seq`` f16 requests of
    ``n_ctx`` tokens (the workload's) over the setup, and --fit's."""
    from localinfer.plan.split_fit import plan_split, split_env

    env, host_usable = split_env(setup, link)
    # llama.cpp holds at most MAX_PARALLEL sequences: a larger workload is placed for that many
    req = FitRequest(n_ctx=n_ctx, n_seq=min(max(1, n_seq), MAX_PARALLEL))
    _, plan, ref = plan_split(spec, env, req, host_usable)
    timed = env.host is not None and bool(env.host.bandwidth_bytes_per_s)
    used = plan is not None and (not plan.breakdown.host_tensors or timed)
    return Placement(plan, ref, used, env.host if timed else None, local_gpu_link(setup.profiles, setup.remote))
