"""Deadline-aware admission (``SchedulerConfig.deadline_aware``): the scheduler's predictions, from its step model.

A waiting request with a deadline is refused when its predicted finish (this step with its prefill, the prompt
steps running requests still owe, then its decodes beside every running request's) is past it; any newcomer waits
while admitting it would push a running request predicted on time past its own.  Both count the prompt steps that
requests admitted earlier still owe: charged only its own prompt step, each admission of a burst looked on time,
and together they made each other late (at 1 request/s of 300-token prompts on the 2-vCPU VM, a third of the
admitted requests were cut at their deadline; docs/serving.md).

Every path is scaled by :class:`StepErrors`' factor: how much longer than predicted the recent steps took, wall clock
from one step's completion to the next's.  What the step model leaves out (the host's work between steps, compaction,
parking, a drift its fit has not caught up with) shows there; where the predictions run long it admits more.  (Each
request's own finish against its admission's prediction is no such measure: requests admitted after it lengthen its
path, by design and within its deadline -- on a simulated machine the step model predicts exactly, the median
request took 1.3x its admission's prediction.)
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from localinfer.serve.step_model import LinearStepModel, features

if TYPE_CHECKING:
    from localinfer.serve.request import Request
    from localinfer.serve.scheduler import Scheduler as S, StepBatch


# a running request is kept on time with this share of its predicted remaining path to spare: admitted to the edge,
# the requests of a burst at a server's start were cut at the deadline by what the step model had not yet learned
# (5-row decodes predicted at 35 ms took 39) and a compaction's 50 ms (a step log at 1 request/s, 10 s deadlines)
MARGIN = 0.10
# ... and this share where the step with r holds more decode rows than any step the step model has learned from (a
# fitted model: steps completed before its last refit; Scheduler.rows_timed): fitted on one-row decodes and prompts,
# it extrapolates the rows' cost (calibrated at load on rows over a few cells, a
# CPU's 5-row decode over ~2,000 cells was predicted at 26 ms and took 40, and the first burst's requests were cut)
UNSEEN_MARGIN = 0.50
# an idle engine refuses at most this many requests in a row on its step model's word before it admits one anyway:
# a model that no step has confirmed since (calibrated at load while another process held the cores: a 3 s decode)
# would otherwise refuse every deadline forever, as nothing runs to refit it; the probe's steps refit it, and the
# compute it may waste is an idle machine's
PROBE_AFTER = 3


def admission(s: S, r: Request, hit_blocks: list[int], plan: StepBatch, budget: list[int], now: float) -> str | None:
    """"refuse" (r would finish past its deadline), "wait" (admitting r now would make a running request late),
    or None (admit it)."""
    first = first_step(s, r, hit_blocks, plan)
    timed = r.deadline_s is not None or any(x.deadline_s is not None for x in s.running)
    later = prompts_owed(s, plan) if timed else []      # predicted only where a deadline reads it
    f = s.step_errors.factor(s.step_model)
    if r.deadline_s is not None:
        before = owed_before(s, r, hit_blocks, plan, budget, first)
        if r.max_tokens - len(r.output) > 1:      # the owed prompt steps come before r's last token
            before = max(before, sum(later))
        step = decode_step(s, r)
        if now + f * (first + before + (r.max_tokens - len(r.output) - 1) * step) > r.deadline_s:
            if s.running or plan.chunks or s.idle_refusals < PROBE_AFTER:
                s.idle_refusals += int(not s.running and not plan.chunks)
                return "refuse"
            # else a probe: admitted so that steps are timed again (the count is reset by its step)
    return "wait" if makes_late(s, r, now, first, plan, later, f) else None


def first_step(s: S, r: Request, hit_blocks: list[int], plan: StepBatch) -> float:
    """The predicted time of this step with r's prefill (after its cache hit) beside what the step holds
    (decodes, chunks, this step's other admissions)."""
    hit = len(hit_blocks) * s.blocks.block_tokens
    return s.step_model.seconds([*plan.shapes(), (r.n_tokens - hit, hit)])


def makes_late(s: S, r: Request, now: float, first: float, plan: StepBatch, later: list[float] | None = None,
               f: float = 1.0) -> bool:
    """Admitting r now (this step taking ``first`` seconds) would push a running request predicted on time
    past its deadline, or into its margin.  The steps after: the prompt steps running requests still owe
    (``later``, from :func:`prompts_owed`; each gives a decoding request one token), then one decode per running
    request, with and without r's; each path scaled by ``f`` (:class:`StepErrors`), and the path with r by
    ``1 + MARGIN`` too (``1 + UNSEEN_MARGIN`` where its decode steps hold more rows than the step model has learned
    from; a request that is on time only without the margin is still protected: nothing that pushes it is
    admitted, whatever r adds)."""
    timed = [x for x in s.running if x.deadline_s is not None]
    if not timed:
        return False
    model, n, later = s.step_model, r.n_tokens, later or []
    others = [(1, x.n_tokens) for x in s.running]
    margin = MARGIN if len(others) + 1 <= s.rows_timed else UNSEEN_MARGIN
    alone, now_alone = model.seconds(others), model.seconds(plan.shapes())
    with_r = model.seconds([(1, n), *others])
    r_steps = r.max_tokens - len(r.output) - 1
    for x in timed:
        steps = max(0, x.max_tokens - len(x.output) - 1)     # x's steps after this one
        m = min(steps, len(later))                           # ... the first m of them the owed prompts'
        owed, left = sum(later[:m]), steps - m
        shared = min(left, r_steps)
        if (now + f * (1 + margin) * (first + owed + shared * with_r + (left - shared) * alone) > x.deadline_s
                >= now + f * (now_alone + owed + left * alone)):
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


def decode_step(s: S, r: Request) -> float:
    """One of r's decode steps if admitted now, beside every running request's (at r's middle length); after this
    step and the prompt steps ahead of them, r makes all its tokens in such steps (none counted as made in the
    prompt steps: the measured runs cut fewer requests so)."""
    rest = r.max_tokens - len(r.output) - 1
    return s.step_model.seconds([(1, r.n_tokens + rest // 2)] + [(1, x.n_tokens) for x in s.running])


def linear(model) -> LinearStepModel | None:
    """The linear coefficients of a step model (a fitted one's as they now stand), or None."""
    lin = getattr(model, "model", model)
    return lin if isinstance(lin, LinearStepModel) else None


class StepErrors:
    """How long steps took against the step model, wall clock from one step's completion to the next's (the host's
    work between them, compaction and parking included), over the last ``window`` steps taken straight after
    another.  :meth:`factor` is their wall time over what the model *as it now stands* predicts for them (a linear
    model's coefficients applied to the steps' summed features; for another model, the predictions
    made at each step), within [``lo``, ``hi``] once ``least`` are in (1 before); it scales every predicted path.
    Predictions kept from before a refit would go on correcting an error the refitted model no longer makes."""

    def __init__(self, window: int = 256, least: int = 16, lo: float = 0.7, hi: float = 2.0):
        self.least, self.lo, self.hi = least, lo, hi
        self.steps: deque[tuple[float, ...]] = deque(maxlen=window)
        self._sums = [0.0] * 7          # seconds, the step_model.features (5), predicted
        self.seen = 0                   # steps observed in all

    def observe(self, seconds: float, shapes, predicted: float) -> None:
        if seconds < 0 or not shapes:
            return
        row = (seconds, *features(shapes), predicted)
        if len(self.steps) == self.steps.maxlen:
            for i, v in enumerate(self.steps[0]):
                self._sums[i] -= v
        self.steps.append(row)
        for i, v in enumerate(row):
            self._sums[i] += v
        self.seen += 1

    def factor(self, model=None) -> float:
        """The scale, against ``model`` (the scheduler's step model) where it is linear."""
        if len(self.steps) < self.least:
            return 1.0
        seconds, *feats, predicted = self._sums
        lin = linear(model)
        if lin is not None:
            predicted = lin.predict(feats, len(self.steps))
        return min(self.hi, max(self.lo, seconds / predicted)) if predicted > 0 else 1.0
