"""Deadline-aware admission (``SchedulerConfig.deadline_aware``): the scheduler's predictions, from its step model.

A waiting request with a deadline is refused when its predicted finish (this step with its prefill, the prompt
steps running requests still owe, then its decodes beside every running request's) is past it; any newcomer waits
while admitting it would push a running request predicted on time past its own.  Both count the prompt steps that
requests admitted earlier still owe: charged only its own prompt step, each admission of a burst looked on time,
and together they made each other late (at 1 request/s of 300-token prompts on the 2-vCPU VM, a third of the
admitted requests were cut at their deadline; docs/serving.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localinfer.serve.request import Request
    from localinfer.serve.scheduler import Scheduler as S, StepBatch


def admission(s: S, r: Request, hit_blocks: list[int], plan: StepBatch, budget: list[int], now: float) -> str | None:
    """"refuse" (r would finish past its deadline), "wait" (admitting r now would make a running request late),
    or None (admit it)."""
    first = first_step(s, r, hit_blocks, plan)
    timed = r.deadline_s is not None or any(x.deadline_s is not None for x in s.running)
    later = prompts_owed(s, plan) if timed else []      # predicted only where a deadline reads it
    if r.deadline_s is not None:
        before = owed_before(s, r, hit_blocks, plan, budget, first)
        if r.max_tokens - len(r.output) > 1:      # the owed prompt steps come before r's last token
            before = max(before, sum(later))
        if predict_finish(s, r, now, first + before) > r.deadline_s:
            return "refuse"
    return "wait" if makes_late(s, r, now, first, plan, later) else None


def first_step(s: S, r: Request, hit_blocks: list[int], plan: StepBatch) -> float:
    """The predicted time of this step with r's prefill (after its cache hit) beside what the step holds
    (decodes, chunks, this step's other admissions)."""
    hit = len(hit_blocks) * s.blocks.block_tokens
    return s.step_model.seconds([*plan.shapes(), (r.n_tokens - hit, hit)])


def makes_late(s: S, r: Request, now: float, first: float, plan: StepBatch, later: list[float] | None = None) -> bool:
    """Admitting r now (this step taking ``first`` seconds) would push a running request predicted on time
    past its deadline.  The steps after: the prompt steps running requests still owe (``later``, from
    :func:`prompts_owed`; each gives a decoding request one token), then one decode per running request, with
    and without r's."""
    timed = [x for x in s.running if x.deadline_s is not None]
    if not timed:
        return False
    model, n, later = s.step_model, r.n_tokens, later or []
    others = [(1, x.n_tokens) for x in s.running]
    alone, now_alone = model.seconds(others), model.seconds(plan.shapes())
    with_r = model.seconds([(1, n), *others])
    r_steps = r.max_tokens - len(r.output) - 1
    for x in timed:
        steps = max(0, x.max_tokens - len(x.output) - 1)     # x's steps after this one
        m = min(steps, len(later))                           # ... the first m of them the owed prompts'
        owed, left = sum(later[:m]), steps - m
        shared = min(left, r_steps)
        if (now + first + owed + shared * with_r + (left - shared) * alone > x.deadline_s
                >= now + now_alone + owed + left * alone):
            return True
    return False


def prompts_owed(s: S, plan: StepBatch) -> list[float]:
    """The predicted seconds of each prompt step running requests still owe past this step (a prompt longer than
    a step's chunk takes several), each beside the others' decodes.  Charged only its own prompt step, each of a
    burst admitted one by one looked on time and together they made each other late."""
    cfg = s.config
    limit = min(cfg.chunk_tokens, cfg.token_budget or cfg.chunk_tokens) if cfg.policy == "chunked" else None
    owed = _owed_prompts(s, plan)
    decodes = [(1, x.n_tokens) for x in s.running if x.id not in owed]
    steps = []
    for left, done in owed.values():
        while left > 0:
            c = left if not limit else min(left, limit)
            steps.append(s.step_model.seconds([*decodes, (c, done)]))
            left, done = left - c, done + c
    return steps


def owed_before(s: S, r: Request, hit_blocks: list[int], plan: StepBatch, budget: list[int], first: float) -> float:
    """Predicted seconds of the prefill that running requests still owe beyond this step's chunks (a chunk
    held back or cut by the budget): it runs before r's, first come first served -- unless r's whole prompt
    fits what this step has left (a chunk that finishes its prompt is never held), so r's runs now.
    ``first``: :func:`first_step`'s time of this step with r's prefill."""
    hit = len(hit_blocks) * s.blocks.block_tokens
    limit = min(budget[0], s.config.chunk_tokens) if s.config.policy == "chunked" else budget[0]
    if r.n_tokens - hit <= limit:
        return 0.0
    owed = list(_owed_prompts(s, plan).values())
    if not owed:
        return 0.0
    return s.step_model.seconds([*plan.shapes(), (r.n_tokens - hit, hit), *owed]) - first


def _owed_prompts(s: S, plan: StepBatch) -> dict[str, tuple[int, int]]:
    """Running requests' prompt tokens still owed past this step's chunks: id -> (tokens, tokens done by then)."""
    scheduled = {c.request.id: c.n_tokens for c in plan.chunks}     # at most one chunk a request a step
    owed = {}
    for x in s.running:
        done = x.computed + scheduled.get(x.id, 0)
        if x.prefilling and x.n_tokens > done:
            owed[x.id] = (x.n_tokens - done, done)
    return owed


def predict_finish(s: S, r: Request, now: float, first: float) -> float:
    """When r would finish if admitted now: this step and the prompt steps ahead of its decodes (``first``),
    then its decodes beside every running request's (none counted as made in the prompt steps: the measured
    runs cut fewer requests so)."""
    n, rest = r.n_tokens, r.max_tokens - len(r.output) - 1
    step = s.step_model.seconds([(1, n + rest // 2)] + [(1, x.n_tokens) for x in s.running])
    return now + first + rest * step
