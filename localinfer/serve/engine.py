"""The step-level serving engine: a scheduler and a block manager driving any Executor.

One ``step``: the scheduler picks the batch (decodes, prompt chunks, admissions);
newly admitted requests get a sequence slot, and a prefix-cache hit whose blocks
another running request holds becomes ``executor.copy`` of those positions (no
recompute); preempted and finished requests' slots are dropped; the executor
computes the batch in one call; each request asking for a token samples it with
its own sampler.  Each token, and each finish, becomes a ``StreamChunk`` on that
request's stream.

An executor that can bring back a cached prefix no running request holds
declares ``restores_cached_prefix = True`` and ``restore(slot, n_tokens)`` (the
simulator); with any other, the block manager must be built with ``pool_hits=False``.

Parking (``park_slots`` > 0: sequence slots beyond ``max_running``, for an
executor that keeps KV only in its sequences, llama.cpp): a request that
finishes or is cancelled keeps its slot, cut to its kept prefix (the whole
committed blocks the prefix cache names, ``BlockManager.free`` with
``parking``); those blocks stay in the cache as evictable, and a later request
whose prompt matches them is seated by ``executor.copy`` from the parked slot,
as from a running request.  The block manager's eviction of such a block drops
the parked slot's positions from that block on (``executor.drop(slot,
start)``), so KV cells and blocks agree (``BlockManager.tokens_held``); when all
``park_slots`` are parked, one gives its slot up whole: the least recently used
one whose prompt another parked request was sent too, else the least recently
used.  A preempted request, or one that failed, is not parked.  An executor
that ``parks_in_host`` (llama.cpp's with ``park_host``) moves a parked
slot's KV out of its cells (``executor.park``): a hit then shares the running
holder's positions first and has the rest written back from the parked slot,
so the cells are the running requests' blocks (``tokens_in_use``), and a
write-back that finds no free cells is computed instead (``copy`` returns
what it shared).  When host memory is full (``park`` returns False) parked
requests give theirs up, chosen as for a slot; one that fits alone neither is
not parked.  Of two parked requests where one's kept blocks begin the other's
(a hit), only the longer keeps its slot, so two ids never hold one conversation.

Every chunk carries its request's block table from the block manager
(``Chunk.blocks``), so a paging executor (the torch one, built with
``external_blocks=True``) writes and reads exactly the blocks the manager
counts; an executor that declares ``block_size`` must use the manager's.
Executors that keep KV their own way (llama.cpp) ignore the tables.

Copy-on-write block copies are bookkeeping only here: a backend whose KV cells
carry several sequence ids (llama.cpp) writes a new cell for the new token and
never overwrites a shared one; a paging executor sees a table entry change
under positions it holds and copies that block itself.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

from localinfer.backends.executor import Chunk, Executor
from localinfer.generation.sampling import SamplingParams
from localinfer.serve.masks import fill_step_masks
from localinfer.serve.request import GREEDY, FinishReason, Request, State
from localinfer.serve.scheduler import Scheduler, StepPlan


@dataclass(frozen=True)
class StreamChunk:
    """One event of a request's stream: a new token, or its finish (token None)."""

    request_id: str
    token: int | None
    time_s: float
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass(frozen=True)
class StepRecord:
    """What one step computed: (request id, start, new tokens) per chunk, and when."""

    start_s: float
    end_s: float
    chunks: tuple[tuple[str, int, int], ...]


class Engine:
    def __init__(self, executor: Executor, scheduler: Scheduler, *, record: bool = False, park_slots: int = 0):
        if scheduler.config.max_running > executor.n_slots:
            raise ValueError(f"max_running {scheduler.config.max_running} exceeds the executor's "
                             f"{executor.n_slots} slots")
        if park_slots and not 0 < park_slots <= executor.n_slots - scheduler.config.max_running:
            raise ValueError(f"{park_slots} parked slots and max_running {scheduler.config.max_running} exceed the "
                             f"executor's {executor.n_slots} slots")
        if park_slots and scheduler.blocks.pool_hits:
            raise ValueError("parking is for executors that keep KV only in sequences: build the BlockManager "
                             "with pool_hits=False")
        if scheduler.blocks.pool_hits and not getattr(executor, "restores_cached_prefix", False):
            raise ValueError("this executor keeps KV only in live sequences: build the BlockManager with "
                             "pool_hits=False, so that every prefix hit is a copy from a running request")
        if scheduler.drafter is not None and not getattr(executor, "verifies_drafts", False):
            raise ValueError("this executor returns one logits row per chunk: it cannot verify lookup drafts "
                             "(it declares verifies_drafts = True when it honours Chunk.n_logits)")
        size = getattr(executor, "block_size", None)
        if size is not None and size != scheduler.blocks.block_tokens:
            raise ValueError(f"the executor's KV blocks hold {size} tokens, the block manager's "
                             f"{scheduler.blocks.block_tokens}: one block size for both")
        self.executor = executor
        self.scheduler = scheduler
        self.blocks = scheduler.blocks
        self._free_slots = deque(range(executor.n_slots))
        self.slot_of: dict[str, int] = {}
        self._streams: dict[str, deque[StreamChunk]] = {}
        self._holding: set[str] = set()     # requests whose slot holds the positions their blocks say
        self.records: list[StepRecord] | None = [] if record else None
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._in_step = False
        self._after_step: list[Request] = []     # cancelled during the step in flight: slots dropped after it
        self.park_slots = park_slots
        self._parked: OrderedDict[str, int] = OrderedDict()   # parked request id -> slot, least recently used first
        self._prompt_of: dict[str, int] = {}        # parked request id -> hash of its prompt
        self.blocks.parking = bool(park_slots)
        self.blocks.on_evict = self._evicted if park_slots else None

    # ---- requests ------------------------------------------------------------
    def add_request(self, request: Request) -> Request:
        self.scheduler.add(request)
        self._streams[request.id] = deque()
        return request

    def submit(self, prompt, max_tokens: int, *, sampling: SamplingParams = GREEDY, stop=(),
               stop_tokens=frozenset(), deadline_s: float | None = None, request_id: str | None = None) -> Request:
        """A new request arriving now (on the executor's clock); ``deadline_s`` is absolute on that clock."""
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            return self.add_request(Request(rid, tuple(prompt), max_tokens, arrival_s=self.executor.clock(),
                                            deadline_s=deadline_s, sampling=sampling, stop=tuple(stop),
                                            stop_tokens=frozenset(stop_tokens)))

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record and unread stream (a long-running server calls this per request)."""
        with self._lock:
            r = self.scheduler.requests.get(request_id)
            if r is not None and not r.finished:
                raise ValueError(f"request {request_id!r} has not finished")
            self.scheduler.requests.pop(request_id, None)
            self._streams.pop(request_id, None)

    def cancel(self, request_id: str, error: str | None = None) -> bool:
        """Stop the request now (any thread); its slot and KV are freed after the step in flight.  With
        ``error`` it finishes with reason error and that message (its KV is dropped, not parked)."""
        with self._lock:
            r = self.scheduler.cancel(request_id, self.executor.clock(), error)
            if r is None:
                return False
            if self._in_step:
                self._after_step.append(r)
            else:
                self._release(r)
            self._emit_finish(r)
            return True

    @property
    def unfinished(self) -> bool:
        return self.scheduler.unfinished

    # ---- steps ---------------------------------------------------------------
    def step(self) -> list[StreamChunk]:
        """One batch; the events it produced (tokens and finishes)."""
        ex, sched = self.executor, self.scheduler
        events: list[StreamChunk] = []
        with self._lock:
            start = ex.clock()
            plan = sched.schedule(start)
            for r in plan.preempted + plan.refused:
                self._release(r)
            events += [self._emit_finish(r) for r in plan.refused]
            try:
                for r in plan.admitted:
                    self._seat(r)
            except Exception as exc:     # a prefix copy or its compute failed: this step's requests end in error
                self._fail(plan, exc)
                raise
            if not plan.chunks:
                sched.complete(plan, {}, start)
                return events
            chunks = [self._chunk(c.request, c.tokens, c.start, c.samples, 1 + len(c.draft)) for c in plan.chunks]
            self._in_step = True
        try:
            rows = ex.step(chunks)
        except Exception as exc:
            with self._lock:
                self._end_step()
                self._fail(plan, exc)
            raise
        with self._lock:
            self._end_step()
            sampled, before = {}, {}
            fill_step_masks(plan.chunks)      # the grammar masks of every constrained row, before any is sampled
            for c, ch in zip(plan.chunks, chunks):
                r = c.request
                if c.samples and r.state is State.RUNNING:    # not cancelled meanwhile
                    before[r.id] = (r, len(r.output))
                    sampled[r.id] = (sched.drafter.verify(r, rows[ch.slot], c.draft) if c.draft
                                     else r.sampler.sample(rows[ch.slot], r.view()))
            end = ex.clock()
            done = sched.complete(plan, sampled, end)
            for r, position in plan.trims:     # drafts the step did not keep
                if r.id in self.slot_of:
                    ex.drop(self.slot_of[r.id], position)
            self._holding.update(c.request.id for c in plan.chunks)
            if self.records is not None:
                self.records.append(StepRecord(start, end, tuple((c.request.id, c.start, c.n_tokens)
                                                                 for c in plan.chunks)))
            for rid, (r, n) in before.items():
                for tok in r.output[n:]:
                    ev = StreamChunk(rid, tok, end)
                    self._streams[rid].append(ev)
                    events.append(ev)
            for r in done:
                self._release(r)
                events.append(self._emit_finish(r))
            return events

    def _end_step(self) -> None:
        self._in_step = False
        pending, self._after_step = self._after_step, []
        for r in pending:
            self._release(r)

    def run(self) -> None:
        """Step until every request has finished, idling until arrivals when nothing is ready."""
        while self.unfinished:
            if not self.step() and not self.scheduler.running:
                self._idle()

    def stream(self, request_id: str) -> Iterator[StreamChunk]:
        """The request's events as they come, stepping the engine (every request advances) while it runs."""
        q = self._streams[request_id]
        while True:
            while q:
                ev = q.popleft()
                yield ev
                if ev.finish_reason is not None:
                    return
            if not self.unfinished:
                return
            if not self.step() and not self.scheduler.running:
                self._idle()

    # ---- internals -----------------------------------------------------------
    def _seat(self, r: Request) -> None:
        """A slot for r; its cached prefix copied from a running or parked request holding it, the rest restored
        from the pool."""
        slot = self._free_slots.popleft()
        self.slot_of[r.id] = slot
        if r.id in self._parked:      # an earlier request of the same id is parked: it gives its slot up now
            self._unpark(r.id)
        if not r.cached:
            return
        p, have, src, append = self.blocks.block_tokens, 0, None, False
        for other, k in self.blocks.sharers(r.id):
            if other in self._holding:
                have, src = min(k * p, r.cached), self.slot_of[other]
                break
        for other, k in self.blocks.parked_sharers(r.id):
            if other in self._parked:
                if min(k * p, r.cached) > have:
                    if self._host_parking() and src is not None:   # the running holder's cells, then the rest
                        self.executor.copy(src, slot, have)
                        append = True
                    have, src = min(k * p, r.cached), self._parked[other]
                    self._parked.move_to_end(other)     # used: the last to give its slot up
                break
        if src is not None:
            got = self.executor.copy(src, slot, have, append=True) if append else self.executor.copy(src, slot, have)
            if self._host_parking():    # a write-back from host memory that found no cells shares less
                have = got
        if have < r.cached:
            if getattr(self.executor, "restores_cached_prefix", False):
                self.executor.restore(slot, r.cached)
            else:   # the hit spans blocks of several requests: compute what no single one can give
                self.executor.step([self._chunk(r, r.view()[have:r.cached], have, False)])
        self._holding.add(r.id)

    def _chunk(self, r: Request, tokens, start: int, logits: bool, n_logits: int = 1) -> Chunk:
        """r's new tokens for its slot, with its block table from the block manager (the one source of blocks)."""
        return Chunk(self.slot_of[r.id], tuple(tokens), start, logits, n_logits=n_logits if logits else 1,
                     blocks=tuple(self.blocks.tables[r.id]))

    def _release(self, r: Request) -> None:
        """r leaves its slot: parked (cut to its kept prefix) if it finished without error, else dropped."""
        slot = self.slot_of.pop(r.id, None)
        self._holding.discard(r.id)
        park = self.park_slots and slot is not None and r.state is State.FINISHED \
            and r.finish_reason is not FinishReason.ERROR
        kept = self.blocks.unpark(r.id, r.n_tokens if park else 0)
        if slot is None:
            return
        mine = self.blocks.parked.get(r.id, [])
        keeper = next((o for o in self._parked if mine == self.blocks.parked.get(o, [])[:len(mine)]), None) \
            if mine else None
        if keeper is not None:                # r hit keeper's blocks and keeps no more: one id per conversation
            self._parked.move_to_end(keeper)
            kept = self.blocks.unpark(r.id)
        if not kept:
            self.executor.drop(slot)
            self._free_slots.append(slot)
            return
        self.executor.drop(slot, kept)
        prompt = hash(r.prompt)
        if self._host_parking() and not self._parks_in_host(slot, prompt):
            self.blocks.unpark(r.id)         # no room in host memory: not parked in cells either, where it
            self.executor.drop(slot)         # would widen what every step attends over
            self._free_slots.append(slot)
            return
        self._parked[r.id] = slot
        self._prompt_of[r.id] = prompt
        for other in [o for o in self._parked if o != r.id]:   # older parked KV that r keeps all of
            theirs = self.blocks.parked.get(other)
            if theirs is not None and theirs == mine[:len(theirs)]:
                self._unpark(other)
        while len(self._parked) > self.park_slots:
            self._unpark(self._victim())

    def _parks_in_host(self, slot: int, prompt: int) -> bool:
        """Move ``slot``'s KV to host memory, parked requests giving theirs up (``_victim``) while it does not fit
        beside them (``park`` False); False when it cannot go there (``park`` None: over the whole
        budget) or fits alone neither.  True also when the executor has just turned host parking off (its first
        state would not cut) and the block pool is the cells alone: the KV then stays parked in its cells."""
        while (done := self.executor.park(slot)) is not True:
            if not self._host_parking():      # in cells from now on, unless the pool has a host tier past them
                return self.blocks.max_used is None
            if done is None or not self._parked:
                return False
            self._unpark(self._victim(also=prompt))
        return True

    def _victim(self, also: int | None = None) -> str:
        """The parked request to give its slot up: the least recently used one whose prompt another parked request
        (or the one being parked, whose prompt hash is ``also``) was sent too, a prompt answered again differently
        (a regenerate; a resend whose first token flipped): its prompt's blocks stay in the other, it loses only its
        answer's.  Else the least recently used.  Plain LRU would take an unrelated conversation, the next one
        wanted when prompts come back in turn: each resent prompt answered differently took one."""
        seen = Counter(self._prompt_of.values())
        if also is not None:
            seen[also] += 1
        return next((rid for rid in self._parked if seen[self._prompt_of.get(rid)] > 1), next(iter(self._parked)))

    def _host_parking(self) -> bool:
        """The executor moves parked KV out of its cells (read each time: an executor may turn it off; llama.cpp's
        decides at load, from a probe state)."""
        return bool(self.park_slots) and getattr(self.executor, "parks_in_host", False)

    def _unpark(self, rid: str) -> None:
        """Parked ``rid`` gives its slot up: its KV is dropped and its blocks leave the cache (unless shared)."""
        slot = self._parked.pop(rid)
        self._prompt_of.pop(rid, None)
        self.blocks.unpark(rid)
        self.executor.drop(slot)
        self._free_slots.append(slot)

    def _evicted(self, rid: str, start: int) -> None:
        """The block manager evicted parked ``rid``'s blocks from position ``start`` on: drop that KV."""
        slot = self._parked.get(rid, self.slot_of.get(rid))     # slot_of: freed in this schedule, released later
        if slot is None:
            return
        self.executor.drop(slot, start)
        if start == 0 and self._parked.get(rid) == slot:
            del self._parked[rid]
            self._prompt_of.pop(rid, None)
            self._free_slots.append(slot)

    @property
    def parked(self) -> int:
        """Requests whose KV is parked in a slot for later prefix hits."""
        return len(self._parked)

    def _emit_finish(self, r: Request) -> StreamChunk:
        ev = StreamChunk(r.id, None, r.finished_s, r.finish_reason, r.error)
        self._streams.setdefault(r.id, deque()).append(ev)
        return ev

    def _fail(self, plan: StepPlan, exc: Exception) -> None:
        now = self.executor.clock()
        self.scheduler.complete(StepPlan(), {}, now)    # the step is over: deferred frees go back
        for c in plan.chunks:
            r = c.request
            if not r.finished:
                self.scheduler.finish(r, FinishReason.ERROR, now, f"{type(exc).__name__}: {exc}")
                self._release(r)
                self._emit_finish(r)

    def _idle(self) -> None:
        nxt = self.scheduler.next_arrival()
        if nxt is None:
            raise RuntimeError("requests are waiting but none can be admitted")
        advance = getattr(self.executor, "advance_to", None)
        if advance is not None:
            advance(nxt)
        else:
            time.sleep(max(0.0, min(nxt - self.executor.clock(), 0.05)))
