"""Deadline-aware admission learns how far its step predictions run short or long (deadlines.StepErrors)."""

import random
from dataclasses import replace

import pytest

from localinfer.serve.block_manager import BlockManager
from localinfer.serve.deadlines import StepErrors
from localinfer.serve.engine import StepEngine
from localinfer.serve.http.config import SERVE_SCHEDULER
from localinfer.serve.request import Request
from localinfer.serve.scheduler import Scheduler
from localinfer.serve.simulated import SimulatedExecutor
from localinfer.serve.step_model import LinearStepModel

CPU_STEP = LinearStepModel(0.005, 0.0036, 0.0, 0.0029)     # a CPU's shape: a prompt ~1.1 s, a decode row 6.5 ms


def test_the_factor_is_wall_time_over_what_the_model_now_predicts_within_its_bounds():
    model = LinearStepModel(0.010, 0.0, 0.0, 0.0)        # 10 ms a step
    e = StepErrors(window=8, least=4, lo=0.7, hi=2.0)
    decode = [(1, 100)]
    for _ in range(3):
        e.observe(0.012, decode, 0.010)
    assert e.factor(model) == 1.0 and len(e.steps) == 3     # too few yet
    e.observe(0.028, [(1, 100)] * 4, 0.010)                 # a long step counts by its length
    assert e.factor(model) == pytest.approx(0.064 / 0.040)
    refitted = LinearStepModel(0.004, 0.0, 0.0, 0.006)     # a refit that learned the rows' cost: 10 ms a row
    assert e.factor(refitted) == pytest.approx(0.064 / (4 * 0.004 + 7 * 0.006))
    assert e.factor() == pytest.approx(0.064 / 0.040)       # no linear model: the predictions made at the time
    for _ in range(8):
        e.observe(0.030, decode, 0.010)                     # the window forgets the old steps: 3x, at the bound
    assert e.factor(model) == 2.0
    for _ in range(8):
        e.observe(0.001, decode, 0.010)
    assert e.factor(model) == 0.7 and e.seen == 20


def test_idle_time_between_steps_is_not_a_step():
    """The engine idles once nothing runs: the next step's time counts from its own start, not from the last
    step before the idle."""
    model = LinearStepModel(0.01, 0.0, 0.0, 0.0)
    s = Scheduler(replace(SERVE_SCHEDULER, max_running=2), BlockManager(64, 16), model)
    ex = SimulatedExecutor(model, n_slots=2)
    e = StepEngine(ex, s)
    e.add_request(Request("a", tuple(range(40)), 4, arrival_s=0.0, deadline_s=50.0))
    e.run()
    ex.idle_until(100.0)                             # nothing waits meanwhile: an idle spell of ~100 s
    e.add_request(Request("b", tuple(range(100, 140)), 4, arrival_s=100.0, deadline_s=150.0))
    e.run()
    assert len(s.step_errors.steps) >= 4 and s.step_errors.factor(model) == pytest.approx(1.0)   # no 100 s step


def _poisson_run(seed: int, true_model: LinearStepModel, learn: bool):
    rng, t, arrivals = random.Random(seed), 0.0, []
    for _ in range(40):
        arrivals.append(t)
        t += rng.expovariate(1.0)
    s = Scheduler(replace(SERVE_SCHEDULER, max_running=8, token_budget=512), BlockManager(256, 16), CPU_STEP)
    if not learn:
        s.step_errors.least = 10**9
    e = StepEngine(SimulatedExecutor(true_model, n_slots=8), s)
    base = seed * 10**6
    rs = [e.add_request(Request(f"r{i}", tuple(range(base + i * 1000, base + i * 1000 + 300)), 128, arrival_s=a,
                                deadline_s=a + 10.0)) for i, a in enumerate(arrivals)]
    e.run()
    admitted = [r for r in rs if r.first_token_s is not None]
    return sum(not r.on_time for r in admitted), sum(r.on_time for r in rs), s.step_errors.factor(s.step_model)


@pytest.mark.parametrize("scale", [1.3, 0.7])
def test_the_factor_learns_a_machine_slower_or_faster_than_its_step_model(scale):
    """The executor's steps take ``scale`` times what the scheduler's model says (a slower stretch of the host, or
    work the model leaves out; or the other way).  1.3x: unscaled, admissions look on time and are cut at their
    deadline; with the learned factor they are refused at arrival instead.  0.7x: the learned factor admits
    requests the unscaled prediction refused, and more finish on time."""
    machine = LinearStepModel(*(scale * v for v in (CPU_STEP.fixed_s, CPU_STEP.per_token_s, CPU_STEP.per_pair_s,
                                                    CPU_STEP.per_seq_s)))
    runs = {learn: [_poisson_run(seed, machine, learn) for seed in range(4)] for learn in (False, True)}
    assert all(f == pytest.approx(scale, abs=0.02) for _, _, f in runs[True]), runs[True]
    cut = {k: sum(r[0] for r in v) for k, v in runs.items()}
    served = {k: sum(r[1] for r in v) for k, v in runs.items()}
    if scale > 1:
        assert cut[True] < cut[False] / 2, cut
    else:
        assert served[True] > served[False] and cut[True] <= 2, (served, cut)


@pytest.mark.parametrize("rows_timed, admitted", [(1, False), (2, True)])
def test_a_step_of_more_rows_than_any_timed_keeps_a_wider_margin(rows_timed, admitted):
    """A running request on time by ~30%: a newcomer making its decode steps two rows waits while the server has
    timed only one-row steps (the step model extrapolates: UNSEEN_MARGIN), and is admitted once it has timed two."""
    from localinfer.serve.scheduler import SchedulerConfig

    flat = LinearStepModel(0.01, 0.0, 0.0, 0.0)      # every step 10 ms
    s = Scheduler(SchedulerConfig(deadline_aware=True, max_running=4), BlockManager(1000, 16), flat)
    x = Request("x", tuple(range(10)), 101, deadline_s=1.33)
    s.add(x)
    now = 0.0
    for _ in range(2):                               # x's prompt, then one decode: one row timed
        plan = s.schedule(now)
        now += flat.seconds(plan.shapes())
        s.complete(plan, {c.request.id: 5 for c in plan.chunks if c.samples}, now)
    assert s.rows_timed == 1 and s.step_errors.factor() == 1.0
    s.rows_timed = rows_timed
    newcomer = Request("r", tuple(range(100, 110)), 20, arrival_s=now)
    s.add(newcomer)
    plan = s.schedule(now)          # x's path with r: 10 ms + 98 decodes of 10 ms = 0.99 s; 0.33 s to spare
    assert (plan.admitted == [newcomer]) == admitted


def test_an_idle_engine_whose_model_refuses_everything_admits_a_probe():
    """A step model that says 3 s a step (calibrated while another process held the cores): on an idle engine every
    deadline is refused on its word, and nothing would ever run to refit it; the request after PROBE_AFTER refusals
    in a row is admitted.  A step that runs resets the count."""
    from localinfer.serve.deadlines import PROBE_AFTER
    from localinfer.serve.scheduler import SchedulerConfig

    stale = LinearStepModel(3.0, 0.0, 0.0, 0.0)
    s = Scheduler(SchedulerConfig(deadline_aware=True, max_running=4), BlockManager(1000, 16), stale)
    clock = iter(range(100))

    def offer(rid, deadline=True):
        t = float(next(clock))
        r = Request(rid, tuple(range(len(s.requests) * 100, len(s.requests) * 100 + 10)), 128 if deadline else 1,
                    arrival_s=t, deadline_s=t + 10.0 if deadline else None)
        s.add(r)
        plan = s.schedule(t)
        if plan.chunks:
            s.complete(plan, {c.request.id: 5 for c in plan.chunks if c.samples}, t + 0.01)
        return "admitted" if plan.admitted == [r] else "refused" if plan.refused == [r] else "?"

    assert [offer(f"a{i}") for i in range(PROBE_AFTER - 1)] == ["refused"] * (PROBE_AFTER - 1)
    assert offer("plain", deadline=False) == "admitted"      # one token, no deadline: a step ran
    assert s.idle_refusals == 0 and not s.running
    got = [offer(f"b{i}") for i in range(PROBE_AFTER + 1)]
    assert got == ["refused"] * PROBE_AFTER + ["admitted"]
    late = Request("busy", tuple(range(9000, 9010)), 128, arrival_s=50.0, deadline_s=60.0)
    s.add(late)
    plan = s.schedule(50.0)          # the probe runs: a newcomer the model says is late is refused as before
    assert plan.refused == [late] and s.idle_refusals == 0
