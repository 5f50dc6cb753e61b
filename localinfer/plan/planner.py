"""Choose a configuration: the most correct answers on time, per GPU-second.

Each candidate (KV type, prefix sharing, a draft source, weight offload) is
checked twice before anything runs: does its KV (plus a draft model) fit the
KV budget, and does the batch finish by the deadline?  Verdicts are
"does not fit", "late" or "on time"; among those on time the one holding the
device for the fewest GPU-seconds per good result wins (joules follow from the
profile's power).  Every loser gets a one-line reason.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from localinfer.errors import UsageError
from localinfer.plan.offload import OffloadPlan, plan_offload
from localinfer.plan.paging import DEFAULT_BLOCK_TOKENS, tokens_held
from localinfer.plan.speculation import Drafting
from localinfer.plan.speed import Estimate, RequestTiming, SpeedModel, Workload
from localinfer.units import ceil_div, fmt_bytes

DEFAULT_OFFLOAD_BUFFERS = 2
NOT_FIT, LATE, ON_TIME, FITS = "does not fit", "late", "on time", "fits"
UNKNOWN = "fits, speed unknown"


@dataclass(frozen=True)
class Config:
    """One way to run the workload."""

    kv: str = "f16"
    share_prefix: bool = False
    drafting: Drafting | None = None
    offload: bool = False
    name: str = ""

    @property
    def label(self) -> str:
        parts = [f"{self.kv} KV", "shared prefix" if self.share_prefix else "independent"]
        if self.drafting:
            parts.append(self.drafting.label)
        if self.offload:
            parts.append("weight offload")
        return ", ".join(parts)


@dataclass(frozen=True)
class Outcome:
    """A configuration's memory, timeline and verdict."""

    config: Config
    memory_bytes: int            # KV (deduplicated) + draft model, what the KV budget must hold
    budget_bytes: int            # the KV budget, plus what offload freed
    timing: RequestTiming
    verdict: str
    offload: OffloadPlan | None = None
    power_w: float | None = None

    @property
    def name(self) -> str:
        return self.config.name or self.config.label

    @property
    def total_s(self) -> float:
        return self.timing.total_s

    @property
    def good_results(self) -> int:
        return self.timing.workload.requests if self.verdict in (ON_TIME, FITS) else 0

    @property
    def gpu_s_per_good(self) -> float:
        """Device time of the whole batch divided by the results that count."""
        g = self.good_results
        return self.timing.prefill.seconds / g + self.timing.decode_s / g if g else math.inf

    @property
    def joules_per_good(self) -> float | None:
        return None if self.power_w is None else self.gpu_s_per_good * self.power_w


@dataclass(frozen=True)
class Plan:
    """Every evaluated configuration, the chosen one (None if nothing is feasible) and why the others lost."""

    workload: Workload
    budget_bytes: int
    outcomes: tuple[Outcome, ...]
    best: Outcome | None
    reasons: dict[str, str] = field(default_factory=dict)


def kv_memory(speed: SpeedModel, w: Workload, kv: str, share_prefix: bool,
              block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """KV bytes the batch holds once every output is generated (blocks of ``block_tokens``), with a hybrid's
    recurrent state per request (it does not grow with the context and is never shared).

    Each request holds L + G − 1 tokens (the last output is never written).
    With sharing, the prefix's full blocks are held once.
    """
    held = tokens_held(w.input_tokens, w.output_tokens)
    shared = (w.shared_prefix // block_tokens) * block_tokens if share_prefix else 0
    private = ceil_div(held - shared, block_tokens) * block_tokens
    return ((speed.cost.kv_read_bytes(shared, kv) if shared else 0)
            + w.requests * (speed.cost.kv_read_bytes(private, kv) + speed.cost.state_bytes))


def evaluate(speed: SpeedModel, workload: Workload, config: Config, budget_bytes: int, *, spec=None,
             block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Outcome:
    """Memory, timeline and verdict of one configuration."""
    w = dataclasses.replace(workload, shared_prefix=workload.shared_prefix if config.share_prefix else 0)
    d = config.drafting
    memory = kv_memory(speed, w, config.kv, config.share_prefix, block_tokens) + (d.memory_bytes if d else 0)
    if d:
        timing = speed.request(w, config.kv, tokens_per_step=d.expected, rows=d.rows,
                               prefill_factor=d.prefill_factor, step_extra_s=d.round_extra_s)
    else:
        timing = speed.request(w, config.kv)
    budget, off = budget_bytes, None
    if config.offload:
        if spec is None:
            raise UsageError("offload needs the model's tensor table", flag="--offload")
        need = max(memory - budget_bytes, 0)
        off = plan_offload(spec, speed.device, free_bytes=need, buffers=DEFAULT_OFFLOAD_BUFFERS,
                           step_compute_s=timing.step.seconds)
        budget += off.net_bytes
        timing = _with_offload(timing, off, speed.ubatch)
    if memory > budget:
        verdict = NOT_FIT
    elif math.isnan(timing.total_s):
        verdict = UNKNOWN
    elif workload.deadline_s is None:
        verdict = FITS
    else:
        verdict = ON_TIME if timing.total_s <= workload.deadline_s else LATE
    return Outcome(config, memory, budget, timing, verdict, off, getattr(speed.device, "power_w", None))


def _with_offload(t: RequestTiming, off: OffloadPlan, ubatch: int) -> RequestTiming:
    w = t.workload
    calls = ceil_div(w.requests * (w.input_tokens - w.cached_tokens), ubatch)
    copy = calls * off.copy_s_per_step
    p = t.prefill
    pre_s = max(p.seconds, copy) if off.overlapped else p.seconds + copy
    s = t.step
    return dataclasses.replace(
        t, prefill=Estimate(pre_s, p.compute_s, p.memory_s, p.flops, p.bytes, p.source),
        step=Estimate(off.step_s, s.compute_s, s.memory_s, s.flops, s.bytes, s.source))


def choose(outcomes: list[Outcome]) -> tuple[Outcome | None, dict[str, str]]:
    """The feasible outcome with the fewest GPU-seconds per good result, and why each other lost."""
    feasible = [o for o in outcomes if o.verdict in (ON_TIME, FITS)]
    best = min(feasible, key=lambda o: (o.gpu_s_per_good, o.memory_bytes), default=None)
    reasons = {}
    for o in outcomes:
        if o is best:
            continue
        if o.verdict == NOT_FIT:
            reasons[o.name] = (f"does not fit: needs {fmt_bytes(o.memory_bytes)} for KV"
                               f"{' and drafter' if o.config.drafting and o.config.drafting.memory_bytes else ''}, "
                               f"budget {fmt_bytes(o.budget_bytes)}")
        elif o.verdict == UNKNOWN:
            reasons[o.name] = "fits, but its speed is unknown: measure this device with `localinfer bench --json`"
        elif o.verdict == LATE:
            reasons[o.name] = f"late: {o.total_s:.2f} s > {o.timing.workload.deadline_s:g} s deadline"
        else:
            reasons[o.name] = (f"{o.verdict} but slower: {o.total_s:.2f} s vs {best.total_s:.2f} s "
                               f"({o.gpu_s_per_good:.3f} vs {best.gpu_s_per_good:.3f} GPU·s per good result)")
    return best, reasons


def candidate_configs(workload: Workload, *, kv_types=("f16", "q8_0", "q4_0"), drafts: tuple[Drafting, ...] = (),
                      offload: bool = False) -> list[Config]:
    """Every combination worth checking: KV type × prefix sharing × draft source (× offload)."""
    shares = (False, True) if workload.shared_prefix else (False,)
    out = []
    for kv in kv_types:
        for share in shares:
            for d in (None, *drafts):
                out.append(Config(kv, share, d))
                if offload:
                    out.append(Config(kv, share, d, offload=True))
    return out


def plan(speed: SpeedModel, workload: Workload, budget_bytes: int, configs: list[Config], *, spec=None,
         block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Plan:
    """Evaluate ``configs`` and pick the best (offload variants are skipped where offload is impossible)."""
    if budget_bytes < 0:
        raise UsageError("the KV budget is negative: the weights alone do not fit", flag="--kv-budget")
    outcomes, base = [], {}

    def run(c: Config) -> Outcome:
        if not c.name:
            n = len(outcomes)
            c = dataclasses.replace(c, name=chr(65 + n) if n < 26 else f"#{n + 1}")
        return evaluate(speed, workload, c, budget_bytes, spec=spec, block_tokens=block_tokens)

    for c in sorted(configs, key=lambda c: c.offload):
        key = dataclasses.replace(c, offload=False, name="")
        if c.offload:
            plain = base.get(key)
            if plain is not None and plain.verdict != NOT_FIT:
                continue          # offload only buys memory; this one already fits
            try:
                outcomes.append(run(c))
            except UsageError:
                continue          # unified memory, or offloading everything is still not enough
        else:
            base[key] = run(c)
            outcomes.append(base[key])
    best, reasons = choose(outcomes)
    return Plan(workload, budget_bytes, tuple(outcomes), best, reasons)


def lookup_draft_length(speed: SpeedModel, workload: Workload, acceptance: float, longest: int = 16,
                        query_s: float = 1e-4) -> int:
    """Draft length for context lookup by the marginal rule, verified rows padded to graph shapes."""
    from localinfer.plan.speculation import acceptances, choose_draft_length, padded_rows

    w = workload

    def round_s(m: int) -> float:
        rows = padded_rows(m + 1)
        return speed.decode_step(w.requests, w.decode_context, rows=rows).seconds + (query_s if m else 0.0)

    if math.isnan(round_s(0)):
        return 4
    return max(1, choose_draft_length(acceptances(acceptance, longest), round_s, range(1, longest + 1)))


def default_kv_budget(spec, device, n_ctx: int = 4096) -> int:
    """What the device leaves for KV (and a hybrid's recurrent state): usable memory minus weights, compute and
    output buffers.

    The non-KV terms are `localinfer fit`'s breakdown for one ``n_ctx`` sequence.
    """
    from localinfer.backends.memory import FitRequest
    from localinfer.plan.fit import fit_device

    bd = fit_device(spec, device, FitRequest(n_ctx=n_ctx), search=False).breakdown
    return device.usable_bytes - (bd.device_bytes - bd.sum("kv", "device") - bd.sum("state", "device"))


def outcome_dict(o: Outcome) -> dict:
    """One outcome as JSON-ready data (infinities become null)."""
    t = o.timing
    finite = lambda x: None if x is None or not math.isfinite(x) else x
    return {
        "name": o.name, "label": o.config.label, "kv": o.config.kv, "share_prefix": o.config.share_prefix,
        "drafting": None if o.config.drafting is None else dataclasses.asdict(o.config.drafting),
        "offload": None if o.offload is None else {
            "groups": [g.label for g in o.offload.groups], "buffers": o.offload.buffers,
            "net_bytes": o.offload.net_bytes, "copy_s_per_step": o.offload.copy_s_per_step},
        "memory_bytes": o.memory_bytes, "budget_bytes": o.budget_bytes,
        "prefill_s": finite(t.prefill.seconds), "prefill_source": t.prefill.source,
        "decode_steps": t.steps, "step_s": finite(t.step.seconds), "step_source": t.step.source,
        "ttft_s": finite(t.ttft_s), "total_s": finite(t.total_s), "verdict": o.verdict,
        "gpu_s_per_request": finite(t.gpu_s_per_request), "gpu_s_per_good": finite(o.gpu_s_per_good),
        "joules_per_good": finite(o.joules_per_good),
    }


def plan_dict(p: Plan) -> dict:
    """Plan as plain JSON-ready data."""
    return {"workload": dataclasses.asdict(p.workload), "budget_bytes": p.budget_bytes,
            "outcomes": [outcome_dict(o) for o in p.outcomes], "best": p.best.name if p.best else None,
            "reasons": dict(p.reasons)}
