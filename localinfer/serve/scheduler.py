"""The step scheduler: which tokens of which requests the next batch computes.

Each step, in this order:

1. every running request with one token to compute (a decode) gets it;
2. every running request still prefilling gets one chunk, in admission order:
   its whole remainder (``fixed``, ``continuous``) or at most ``chunk_tokens``
   (``chunked``; or the largest chunk whose predicted step time stays under
   ``itl_target_s``; with ``max_gap_s``, while requests decode, the largest that keeps the step
   within that bound), all within ``token_budget`` new tokens per step; with
   ``partial_slack`` a chunk that does not finish its prompt waits for the next
   step when this one already finishes a prompt and the chunk would make it more
   than that fraction longer;
3. arrived waiting requests are admitted, first come first served, while fewer
   than ``max_running`` hold a slot (``fixed``: only when none is running, so a
   group starts after the previous one finished), and get their first chunk; a
   request whose prompt shares blocks a running request is still prefilling
   waits until they are in the cache (requests behind it go ahead; not under
   ``fixed``, whose group is admitted together), so a common prefix is computed once.

With ``decode_share`` a step that computes prompt tokens is followed, while
requests decode, by decode-only steps (2 and 3 wait): the nearest whole number of
them to that fraction of its predicted time less its decodes'.

Why ``partial_slack``, ``decode_share`` and ``max_gap_s``, with what each costs: docs/serving.md.

Admission ``reserve`` takes the blocks of input + max output − 1 tokens up front
(a request never runs out); ``on_demand`` takes blocks as tokens are written and,
when none is left, preempts the newest running request (its KV is dropped and
recomputed later).  ``deadline_aware`` (deadlines.py) refuses, at admission, a request whose
predicted finish (prefill + (G − 1) decode steps at the current batch) is past
its deadline, and holds it in the queue while admitting it would push a running
request predicted on time past its own (so overload makes the newcomers wait or
be refused, not everyone late); ``drop_late`` finishes (reason deadline) a request still
unfinished past its deadline at the next step boundary.  ``cancel`` stops scheduling a request at once; its blocks return
to the pool when the step in flight completes.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from localinfer.errors import UsageError
from localinfer.plan.paging import request_blocks, tokens_held
from localinfer.serve import deadlines
from localinfer.serve.block_manager import BlockCopy, BlockManager
from localinfer.serve.request import FinishReason, Request, State
from localinfer.serve.speculation import Drafter, check_draft_max
from localinfer.serve.step_model import StepModel, chunk_for_target

class Policy(enum.StrEnum):
    FIXED = "fixed"
    CONTINUOUS = "continuous"
    CHUNKED = "chunked"


class Admission(enum.StrEnum):
    RESERVE = "reserve"
    ON_DEMAND = "on_demand"


POLICIES = tuple(Policy)
ADMISSIONS = tuple(Admission)


@dataclass(frozen=True)
class SchedulerConfig:
    policy: Policy = Policy.CONTINUOUS
    max_running: int = 8
    chunk_tokens: int = 512              # chunked: most prompt tokens of one request per step
    token_budget: int | None = None      # most new tokens per step (None: no limit)
    itl_target_s: float | None = None    # chunked: the chunk is the largest predicted to keep the step under this
    max_gap_s: float | None = None       # chunked: a step that gives a running stream its next token is predicted to
                                         # take at most this; prompt chunks are cut to fit (None: no bound)
    admission: Admission = Admission.RESERVE
    deadline_aware: bool = False
    drop_late: bool = False              # finish a request past its deadline at the next step boundary
    draft_max: int = 0                   # prompt-lookup drafts per decoding request and step (0: none)
    wait_for_prefix: bool = True         # hold a request whose prefix a running request is still computing
    partial_slack: float | None = None   # chunked: most a non-finishing chunk may lengthen a step that finishes a
                                         # prompt, as a fraction of that step's time (None: no limit)
    decode_share: float = 0.0            # decode-only time owed after a step with prompt tokens, as a fraction of its
                                         # predicted time less its decodes' (0: none)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise UsageError(f"unknown policy {self.policy!r}", flag="--policy", hint="use " + "|".join(POLICIES))
        if self.admission not in ADMISSIONS:
            raise UsageError(f"unknown admission {self.admission!r}", hint="use " + " or ".join(ADMISSIONS))
        object.__setattr__(self, "policy", Policy(self.policy))
        object.__setattr__(self, "admission", Admission(self.admission))
        for name, flag in (("max_running", "--max-running"), ("chunk_tokens", "--chunk"),
                           ("token_budget", "--token-budget")):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise UsageError(f"{flag} must be a whole number ≥ 1, got {v!r}", flag=flag)
        if self.draft_max:
            check_draft_max(self.draft_max)
        if self.itl_target_s is not None and not self.itl_target_s > 0:
            raise UsageError(f"the ITL target must be positive, got {self.itl_target_s!r}")
        if self.max_gap_s is not None and not self.max_gap_s > 0:
            raise UsageError(f"the largest token gap must be positive, got {self.max_gap_s!r}", flag="--max-gap",
                             hint="e.g. --max-gap 150 (milliseconds), or leave it out for no bound")
        if self.partial_slack is not None and not self.partial_slack >= 0:
            raise UsageError(f"partial_slack must be a fraction >= 0, got {self.partial_slack!r}")
        if isinstance(self.decode_share, bool) or not 0 <= self.decode_share <= 100:
            raise UsageError(f"decode_share must be a number in 0..100, got {self.decode_share!r}",
                             hint="e.g. 0.05, or 0 for none")


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int          # position of the first new token
    n_tokens: int       # new tokens, drafts included
    draft: tuple[int, ...] = ()     # speculative tokens after the request's last one (verified by this step)

    @property
    def tokens(self) -> tuple[int, ...]:
        own = self.request.view()[self.start:self.start + self.n_tokens - len(self.draft)]
        return tuple(own) + self.draft if self.draft else own

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so the step yields its next output token (or more)."""
        return self.start + self.n_tokens - len(self.draft) == self.request.n_tokens


@dataclass
class StepBatch:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    refused: list[Request] = field(default_factory=list)     # finished at this boundary (deadline, too large)
    copies: list[BlockCopy] = field(default_factory=list)
    trims: list[tuple[Request, int]] = field(default_factory=list)  # after complete: drop KV from here (drafts)

    @property
    def new_tokens(self) -> int:
        return sum(c.n_tokens for c in self.chunks)

    def shapes(self) -> list[tuple[int, int]]:
        return [(c.n_tokens, c.start) for c in self.chunks]


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, step_model: StepModel | None = None):
        if (config.itl_target_s is not None or config.max_gap_s is not None or config.deadline_aware
                or config.decode_share) and step_model is None:
            raise UsageError("an ITL target, a gap bound, a decode share or deadline-aware admission needs a step-time "
                             "model",
                             hint="give --step-model or --device with --model")
        self.config = config
        self.blocks = blocks
        self.step_model = step_model
        self.drafter = Drafter(config.draft_max) if config.draft_max else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.admissions = 0          # requests seated, each time (a preempted request is admitted again)
        self.preemptions = 0
        self._decode_owed = 0.0      # seconds of decode-only steps still owed after a prompt step (decode_share)
        self.peak_running = 0
        self.step_errors = deadlines.StepErrors()     # steps' wall time against the step model (deadline_aware)
        self._last_end: float | None = None     # when the last step completed, while requests still ran
        self.rows_timed = 0                     # the most decode rows the step model has learned (deadline_aware)
        self._rows_pending, self._fits = 0, None
        self.idle_refusals = 0                  # deadline refusals in a row, nothing running (deadlines.PROBE_AFTER)
        self._deadlines = False                 # a request with a deadline has come

    # ---- requests ------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.id in self.requests:
            raise UsageError(f"duplicate request id {request.id!r}", hint="give every request its own id")
        self.requests[request.id] = request
        self._deadlines = self._deadlines or request.deadline_s is not None
        i = len(self.waiting)
        while i and self.waiting[i - 1].arrival_s > request.arrival_s:
            i -= 1
        self.waiting.insert(i, request)

    def cancel(self, request_id: str, now: float, error: str | None = None) -> Request | None:
        """Stop scheduling at once; the blocks return after the step in flight.  None if unknown or finished.
        With ``error`` the request finishes with reason error (and that message) instead of cancelled."""
        r = self.requests.get(request_id)
        if r is None or r.finished:
            return None
        self.finish(r, FinishReason.CANCELLED if error is None else FinishReason.ERROR, now, error)
        return r

    @property
    def unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def next_arrival(self) -> float | None:
        return min((r.arrival_s for r in self.waiting), default=None)

    # ---- one step ------------------------------------------------------------
    def schedule(self, now: float) -> StepBatch:
        """The next batch; the block manager treats it as in flight until ``complete``."""
        cfg, plan = self.config, StepBatch()
        budget = [cfg.token_budget if cfg.token_budget is not None else 1 << 62]
        if cfg.drop_late:
            for r in [*self.running, *self.waiting]:
                if r.deadline_s is not None and r.arrival_s <= now and now > r.deadline_s:
                    self.finish(r, FinishReason.DEADLINE, now)
                    plan.refused.append(r)
        group_start = not self.running
        for r in [r for r in self.running if not r.prefilling]:
            if r in self.running and budget[0] >= 1:
                self._add_chunk(plan, r, 1, budget)
        decodes_only = self._decode_owed > 0 and bool(plan.chunks) and self._owes_a_step(plan)
        if not decodes_only:
            for r in [r for r in self.running if r.prefilling]:
                if r in self.running:
                    self._prefill_chunk(plan, r, budget)
            if cfg.policy is not Policy.FIXED or group_start:
                self._admit(plan, now, budget)
        if self.drafter is not None:
            self._draft(plan, budget)
        if cfg.decode_share:
            self._owe_decodes(plan)
        self.peak_running = max(self.peak_running, len(self.running))
        self.blocks.begin_step()
        return plan

    def complete(self, plan: StepBatch, sampled: Mapping[str, int | Sequence[int]], now: float) -> list[Request]:
        """The step finished at ``now`` with these output tokens (a list for a chunk that verified a draft:
        the accepted drafts and the next token); the requests it finished.  A draft not wholly kept leaves
        ``plan.trims``: (request, position) from which its slot's KV is to be dropped."""
        self.blocks.end_step()
        done = []
        for ch in plan.chunks:
            r = ch.request
            if r.state is not State.RUNNING or r.computed != ch.start:
                continue    # cancelled or preempted while the step ran
            if not ch.samples:
                r.computed += ch.n_tokens
                self.blocks.commit(r.id, r.view(r.computed), r.prefix_hashes(self.blocks.block_tokens))
                continue
            got = sampled[r.id]
            reason, kept = None, 0
            for tok in ([got] if isinstance(got, int) else got):
                kept += 1
                reason = r.append(tok, now)
                if reason is not None:
                    break
            if self.drafter is not None:
                self.drafter.observe(r, r.output[len(r.output) - kept:])
            # KV holds the chunk's own tokens and the kept drafts; the last token kept is the next pending one
            r.computed = ch.start + ch.n_tokens - len(ch.draft) - 1 + kept
            self.blocks.commit(r.id, r.view(r.computed), r.prefix_hashes(self.blocks.block_tokens))
            if kept < len(ch.draft) + 1:
                plan.trims.append((r, r.computed))
                if self.config.admission is Admission.ON_DEMAND:     # reserved blocks stay: they are the request's own
                    self.blocks.shrink(r.id, r.computed)
            if reason is not None:
                self.finish(r, reason, now)
                done.append(r)
        if self.config.deadline_aware:
            self._time_step(plan, now)
        return done

    def _time_step(self, plan: StepBatch, now: float) -> None:
        """A step's wall time, from the last one's completion to this one's (its host work between included), for
        :class:`~localinfer.serve.deadlines.StepErrors`, where the engine went straight on to this step (requests
        were still running) and once a deadline has come to read it; and the decode rows the step model has learned
        (``rows_timed``: a fitted model's, once a refit has come after such a step)."""
        if not plan.chunks:
            self._last_end = None
            return
        self.idle_refusals = 0
        self._rows_pending = max(self._rows_pending, sum(1 for c in plan.chunks if c.n_tokens == 1))
        shapes = plan.shapes()
        predicted = None
        if self._last_end is not None and self._deadlines:      # a linear model's is recomputed at each read
            predicted = 0.0 if deadlines.linear(self.step_model) else self.step_model.seconds(shapes)
        fits = getattr(self.step_model, "fits", None)
        if fits is None or fits != self._fits:
            self._fits, self.rows_timed = fits, max(self.rows_timed, self._rows_pending)
        if predicted is not None:
            self.step_errors.observe(now - self._last_end, shapes, predicted)
        self._last_end = now if self.running else None

    def finish(self, r: Request, reason: FinishReason, now: float, error: str | None = None) -> None:
        """The one way a request ends (stop, length, cancel, deadline, refusal, error): it leaves the queue or the
        batch, its blocks go back (after the step in flight), the drafter forgets it, and the request releases what
        it holds itself (``Request.finish``)."""
        if self.drafter is not None:
            self.drafter.forget(r.id)
        if r in self.running:
            self.running.remove(r)
            self.blocks.free(r.id)
        elif r in self.waiting:
            self.waiting.remove(r)
        r.finish(reason, now, error)

    # ---- internals -----------------------------------------------------------
    def _owe_decodes(self, plan: StepBatch) -> None:
        """``decode_share``: a step with prompt tokens owes that share of its predicted time less its decodes' (all
        of it with none) in decode-only steps, held only while requests decode; a decode-only step pays its time off."""
        decodes = [(c.n_tokens, c.start) for c in plan.chunks if not c.request.prefilling]
        if len(decodes) < len(plan.chunks):
            model = self.step_model
            self._decode_owed = self.config.decode_share * (model.seconds(plan.shapes()) - model.seconds(decodes))
        elif decodes and self._decode_owed > 0:      # nothing owed (most steps): no prediction to make
            self._decode_owed -= self.step_model.seconds(decodes)

    def _owes_a_step(self, plan: StepBatch) -> bool:
        """Whether the debt is at least half this decode-only step's predicted time: the gaps are the nearest
        whole number of decode steps to the share, not the next one up (a debt just over one step is one)."""
        if self._decode_owed >= 0.5 * self.step_model.seconds(plan.shapes()):
            return True
        self._decode_owed = 0.0
        return False

    def _chunk_limit(self, plan: StepBatch, r: Request, budget: list[int]) -> int:
        cfg, n = self.config, r.remaining
        if cfg.policy is not Policy.CHUNKED:
            return n if n <= budget[0] or not plan.chunks else 0
        n = min(n, cfg.chunk_tokens, budget[0])
        if cfg.itl_target_s is not None:
            fit = chunk_for_target(self.step_model, cfg.itl_target_s, plan.shapes(), r.computed, n)
            n = fit if fit or plan.chunks else 1
        if cfg.max_gap_s is not None and any(c.samples and not c.request.prefilling for c in plan.chunks):
            n = self._within_gap(plan, r, n)
        if n < r.remaining and cfg.partial_slack is not None and self._holds_partial(plan, r.computed, n):
            return 0
        return n

    def _within_gap(self, plan: StepBatch, r: Request, n: int) -> int:
        """``max_gap_s``: the largest chunk of r (at most n) that keeps this step, which gives running streams their
        next token, within the bound.  When the step's decodes alone reach it, the oldest prompt still moves by a
        block a step (no prompt waits for ever behind a batch of decodes too large for the bound)."""
        fit = chunk_for_target(self.step_model, self.config.max_gap_s, plan.shapes(), r.computed, n)
        if fit or any(c.request.prefilling for c in plan.chunks):
            return fit
        return min(n, self.blocks.block_tokens)

    def _holds_partial(self, plan: StepBatch, start: int, n: int) -> bool:
        """A chunk of n tokens after ``start`` that leaves its prompt unfinished would lengthen this step, which
        finishes another prompt, by more than ``partial_slack`` of its time (by token count without a step model)."""
        if not any(c.samples and c.request.prefilling for c in plan.chunks):   # computed moves at complete()
            return False
        shapes = plan.shapes()
        if self.step_model is None:
            base, more = sum(c for c, _ in shapes), n
        else:
            base = self.step_model.seconds(shapes)
            more = self.step_model.seconds([*shapes, (n, start)]) - base
        return more > self.config.partial_slack * base

    def _prefill_chunk(self, plan: StepBatch, r: Request, budget: list[int]) -> None:
        n = self._chunk_limit(plan, r, budget)
        snaps = self.blocks.snapshots
        if n > 0 and snaps is not None:      # a chunk ends where the recurrent state is to be saved
            b = next((x for x in snaps.policy.request_points(r, self.blocks.block_tokens) if x > r.computed), None)
            if b is not None and b < r.computed + n:
                n = b - r.computed
        if n > 0:
            self._add_chunk(plan, r, n, budget)

    def _add_chunk(self, plan: StepBatch, r: Request, n: int, budget: list[int]) -> bool:
        """Schedule n tokens of r, taking blocks (preempting the newest on demand); False if r was preempted."""
        while self.blocks.grow_needed(r.id, r.computed + n) > self.blocks.num_free:
            victim = max(self.running, key=lambda x: x.seq)
            self._preempt(plan, victim, budget)
            if victim is r:
                return False
        plan.copies += self.blocks.grow(r.id, r.computed + n)
        plan.chunks.append(ScheduledChunk(r, r.computed, n))
        budget[0] -= n
        return True

    def _draft(self, plan: StepBatch, budget: list[int]) -> None:
        """Lengthen decode chunks with prompt-lookup drafts, from what the step leaves: free blocks and budget."""
        model, bm = self.step_model, self.blocks
        shapes = plan.shapes()                # kept current as chunks grow, so later drafts see earlier ones
        for i, ch in enumerate(plan.chunks):
            r = ch.request
            if ch.n_tokens != 1 or not ch.samples or not r.output:
                continue
            room = min(budget[0], r.max_tokens - len(r.output) - 1)
            if room <= 0:
                continue
            draft = self.drafter.propose(r, room, None if model is None else _step_with(model, shapes, i))
            if not draft or bm.grow_needed(r.id, r.computed + 1 + len(draft)) > bm.num_free:
                continue
            plan.copies += bm.grow(r.id, r.computed + 1 + len(draft))
            plan.chunks[i] = ScheduledChunk(r, ch.start, 1 + len(draft), draft)
            shapes[i] = (1 + len(draft), ch.start)
            budget[0] -= len(draft)

    def _preempt(self, plan: StepBatch, r: Request, budget: list[int]) -> None:
        for ch in [c for c in plan.chunks if c.request is r]:
            plan.chunks.remove(ch)
            budget[0] += ch.n_tokens
        self.running.remove(r)
        self.blocks.free(r.id)
        r.preempt()
        self.preemptions += 1
        self.waiting.appendleft(r)
        plan.preempted.append(r)

    def _admit(self, plan: StepBatch, now: float, budget: list[int]) -> None:
        cfg, bm = self.config, self.blocks
        waits_for_prefix = cfg.wait_for_prefix and bm.prefix_cache and cfg.policy is not Policy.FIXED
        i = 0     # requests before i wait for a prefix in flight; the others keep their order
        while (i < len(self.waiting) and len(self.running) < cfg.max_running
               and self.waiting[i].arrival_s <= now + 1e-12):
            r = self.waiting[i]
            if r in plan.preempted:
                break    # not in the step that preempted it
            reserve = tokens_held(len(r.prompt), r.max_tokens)
            whole = request_blocks(len(r.prompt), r.max_tokens, bm.block_tokens)
            if whole > bm.capacity:
                self.finish(r, FinishReason.ERROR, now, f"needs {whole} KV blocks, the pool has {bm.capacity}")
                plan.refused.append(r)
                continue
            tokens = r.view()
            hit, cut = bm.match_cut(tokens, r.prefix_hashes(bm.block_tokens))
            if waits_for_prefix and self._prefix_in_flight(r, len(hit)):
                i += 1   # waits: a running request is computing more of r's prefix; r takes it from the cache
                continue
            if cfg.deadline_aware:
                verdict = deadlines.admission(self, r, hit, plan, budget, now)
                if verdict == "refuse":
                    self.finish(r, FinishReason.DEADLINE, now)
                    plan.refused.append(r)
                    continue
                if verdict == "wait":
                    break    # waits: it would make a running request miss its deadline (refused once it is late)
            held = reserve if cfg.admission is Admission.RESERVE else None
            if not bm.can_allocate(tokens, held, hit):
                break
            del self.waiting[i]
            r.admit(bm.allocate(r.id, tokens, held, hit), self.admissions, now, cut * bm.block_tokens)
            if cut:
                bm.snapshots.recomputed += cut * bm.block_tokens
            self.admissions += 1
            self.running.append(r)
            plan.admitted.append(r)
            self._prefill_chunk(plan, r, budget)

    def _prefix_in_flight(self, r: Request, hit_blocks: int) -> bool:
        """A running request shares whole blocks of r's prompt past r's cache hit that it has not computed yet.

        Admitting r now would compute them a second time (and hold a second copy); waiting the steps until
        they are committed turns them into a hit.  Several requests with one new system prompt arriving
        together thus compute it once: the first one prefills it, the others follow from the cache.
        """
        p, prompt = self.blocks.block_tokens, r.prompt
        for x in self.running:
            n = min(len(prompt), len(x.prompt)) // p      # whole blocks both prompts could share
            b = hit_blocks
            while b < n and prompt[b * p:(b + 1) * p] == x.prompt[b * p:(b + 1) * p]:
                b += 1
            if b > hit_blocks and x.computed < b * p:
                return True
        return False


def _step_with(model: StepModel, shapes: list[tuple[int, int]], i: int):
    """The predicted step time with chunk i verifying m tokens instead of its one: m -> seconds (read when
    called, from the shapes as they are then)."""
    h = shapes[i][1]
    return lambda m: model.seconds([*shapes[:i], (m, h), *shapes[i + 1:]])
