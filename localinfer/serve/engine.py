"""The step engine: a scheduler and a block manager driving any Executor.

One ``step``: the scheduler picks the batch (decodes, prompt chunks, admissions);
newly admitted requests get a sequence slot, and a prefix-cache hit whose blocks
another running (or parked) request holds becomes ``executor.copy`` of those
positions (no recompute); preempted and finished requests leave their slots
(:mod:`localinfer.serve.parking` keeps finished ones' KV where the block manager
has a Parking); the executor computes the batch in one call, while the grammar
masks of its constrained requests are filled beside it (:mod:`localinfer.serve.masks`);
each request asking for a token samples it with its own sampler.  Each token, and each finish,
becomes a ``StreamChunk`` on that request's stream.

What the executor can do is read from ``executor.caps``: an executor that
``restores_cached_prefix`` brings back a cached prefix no request holds
(``pool_hits``); one that declares ``block_size`` pages KV in the block
manager's blocks, and every chunk carries its request's block table
(``Chunk.blocks``); others keep KV their own way and ignore the tables.
On a recurrent or hybrid model (the block manager's ``snapshots``) the state after a
prompt chunk that ends at a snapshot position is saved (``executor.snapshot``), and a
seated prefix is taken back to the deepest saved state it reaches (``executor.rewind``).

Copy-on-write block copies are bookkeeping only here: a backend whose KV cells
carry several sequence ids (llama.cpp) writes a new cell for the new token and
never overwrites a shared one; a paging executor sees a table entry change
under positions it holds and copies that block itself.

A cancel takes effect at the next step boundary, and with an executor that
``interrupts_steps`` sooner: once every request of the step in flight is
cancelled (``cancel`` from another thread, or ``cancelling``: a cancel on its
way), the step is stopped in flight, computes nothing, and those requests
finish cancelled -- a long prompt's step is not waited out for nobody.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator

from localinfer.backends.executor import Chunk, Executor, StepInterrupted
from localinfer.generation.sampling import SamplingParams
from localinfer.serve.events import StepRecord, StreamChunk
from localinfer.serve.masks import StepMasks, spare_core, step_mask_items
from localinfer.serve.request import GREEDY, FinishReason, Request, State
from localinfer.serve.scheduler import Scheduler, StepBatch
from localinfer.serve.steady import enabled as steady_enabled, steady_step


class StepEngine:
    def __init__(self, executor: Executor, scheduler: Scheduler, *, record: bool = False,
                 on_step: Callable[[StepRecord], None] | None = None, overlap_masks: bool | None = None):
        caps, parking = executor.caps, scheduler.blocks.parking
        if scheduler.config.max_running > executor.n_slots:
            raise ValueError(f"max_running {scheduler.config.max_running} exceeds the executor's "
                             f"{executor.n_slots} slots")
        if parking is not None and parking.slots > executor.n_slots - scheduler.config.max_running:
            raise ValueError(f"{parking.slots} parked slots and max_running {scheduler.config.max_running} exceed "
                             f"the executor's {executor.n_slots} slots")
        if scheduler.blocks.pool_hits and not caps.restores_cached_prefix:
            raise ValueError("this executor keeps KV only in live sequences: build the BlockManager with "
                             "pool_hits=False, so that every prefix hit is a copy from a running request")
        if scheduler.drafter is not None and not caps.verifies_drafts:
            raise ValueError("this executor returns one logits row per chunk: it cannot verify lookup drafts "
                             "(it declares verifies_drafts = True when it honours Chunk.n_logits)")
        if caps.block_size is not None and caps.block_size != scheduler.blocks.block_tokens:
            raise ValueError(f"the executor's KV blocks hold {caps.block_size} tokens, the block manager's "
                             f"{scheduler.blocks.block_tokens}: one block size for both")
        self.executor = executor
        self.scheduler = scheduler
        self.blocks = scheduler.blocks
        self._free_slots = deque(range(executor.n_slots))
        self.slot_of: dict[str, int] = {}
        self._streams: dict[str, deque[StreamChunk]] = {}
        self._holding: set[str] = set()     # requests whose slot holds the positions their blocks say
        self.records: list[StepRecord] | None = [] if record else None
        self.on_step = on_step            # hears of every step's record (a server's step log), on the engine thread
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._in_step = False
        self._after_step: list[Request] = []     # cancelled during the step in flight: slots dropped after it
        self._flight_lock = threading.Lock()     # taken only around _flight: cancelling() never waits for a step
        self._flight: frozenset[str] = frozenset()   # the requests of the step inside executor.step
        self._leaving: set[str] = set()              # requests whose cancel is on its way (cancelling)
        self.parking = parking
        self._reply_snapshot: dict[str, int] = {}    # running request -> the key of its reply's latest snapshot
        self.steady, self.steady_steps = steady_enabled(), 0    # the steady decode step where it is the step
        self.defer_release = False                 # finished requests leave their slots at settle(), not in the step
        self._settling: list[Request] = []
        # grammar masks: filled beside the executor's step where a core is free for them (None: decide so)
        self.masks = StepMasks(spare_core(caps.cpu_threads) if overlap_masks is None else overlap_masks)
        if parking is not None:
            parking.bind_engine(executor, self._free_slots, self.slot_of)

    @property
    def park_slots(self) -> int:
        return self.parking.slots if self.parking is not None else 0

    @property
    def _parked(self):
        """Parked request id -> its slot, least recently used first."""
        return self.parking.slot_of if self.parking is not None else {}

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
        """Stop the request now (any thread); its slot and KV are freed after the step in flight, which stops early
        when no request of it is left (:meth:`cancelling`).  With ``error`` it finishes with reason error and that
        message (its KV is dropped, not parked)."""
        with self._lock:
            r = self.scheduler.cancel(request_id, self.executor.clock(), error)
            if r is None:
                return False
            in_step = self._in_step
            if in_step:
                self._after_step.append(r)
            else:
                self._release(r)
            self._emit_finish(r)
        if in_step:
            self.cancelling(())
        return True

    def cancelling(self, request_ids) -> bool:
        """Cancels of ``request_ids`` are on their way (any thread; never waits for the step in flight): when every
        request of that step is finished or among them, it is stopped in flight (an executor that
        ``interrupts_steps``), computes nothing, and its requests finish cancelled.  True when it was asked to."""
        if not self.executor.caps.interrupts_steps:
            return False
        with self._flight_lock:
            self._leaving.update(request_ids)      # a cancel on its way as the next step is planned counts too
            return self._interrupt_if_all_leaving()

    def _interrupt_if_all_leaving(self) -> bool:
        """(Under ``_flight_lock``) interrupt the step in flight if none of its requests is still wanted."""
        flight, requests = self._flight, self.scheduler.requests
        if not flight or not all(rid in self._leaving or (r := requests.get(rid)) is None or r.finished
                                 for rid in flight):
            return False
        self.executor.interrupt()
        return True

    @property
    def unfinished(self) -> bool:
        return self.scheduler.unfinished

    # ---- steps ---------------------------------------------------------------
    def step(self) -> list[StreamChunk]:
        """One batch (the steady decode step where it is one: serve/steady.py), after settling the last step's
        finished requests; the events it produced (tokens and finishes)."""
        if self._settling:
            self.settle()
        if self.steady and (events := steady_step(self)) is not None:
            return events
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
            model = sched.step_model     # predicted before the step runs (a fitted model learns from it after)
            predicted = model.seconds(plan.shapes()) if model is not None and self._recording else None
            self._in_step = True
            self.masks.start(step_mask_items(plan.chunks))    # constrained rows' masks, beside the forward pass
        with self._flight_lock:
            self._flight = frozenset(c.request.id for c in plan.chunks)
            if self._leaving and self.executor.caps.interrupts_steps:
                self._interrupt_if_all_leaving()
        try:
            rows = ex.step(chunks)     # maybe lent (Executor.step): all are sampled below before the next executor call
        except StepInterrupted:
            with self._lock:
                with contextlib.suppress(Exception):
                    self.masks.finish()       # its requests are all cancelled: no row is sampled
                self._end_step()
                return events + self._interrupted(plan, start, predicted)
        except Exception as exc:
            with self._lock:
                with contextlib.suppress(Exception):
                    self.masks.finish()
                self._end_step()
                self._fail(plan, exc)
            raise
        with self._lock:
            self._end_step()
            samples = tuple(c.samples for c in plan.chunks)      # read before complete() moves the requests on
            saves = self._snapshot_points(plan)
            sampled, before = {}, {}
            self.masks.finish()               # every mask filled before any row is sampled
            for c, ch in zip(plan.chunks, chunks):
                r = c.request
                if c.samples and r.state is State.RUNNING:    # not cancelled meanwhile
                    before[r.id] = (r, len(r.output))
                    sampled[r.id] = (sched.drafter.verify(r, rows[ch.slot], c.draft) if c.draft
                                     else r.sampler.sample(rows[ch.slot], r.view()))
            end = ex.clock()
            done = sched.complete(plan, sampled, end)
            for r, position in plan.trims:     # drafts the step did not keep (a finished request is cut as it parks)
                if r.id in self.slot_of and not r.finished:
                    ex.drop(self.slot_of[r.id], position)
            self._save_snapshots(saves)        # before the finished leave their slots (parking rewinds to them)
            self._adopt_matched(saves)
            self._holding.update(c.request.id for c in plan.chunks)
            if self._recording:
                rec = self._record(plan, samples, tuple(c.request.id in sampled for c in plan.chunks), start, end,
                                   predicted)
                if self.records is not None:
                    self.records.append(rec)
                if self.on_step is not None:
                    self.on_step(rec)
            for rid, (r, n) in before.items():
                for tok in r.output[n:]:
                    ev = StreamChunk(rid, tok, end)
                    self._streams[rid].append(ev)
                    events.append(ev)
            return events + self._finished(done)

    def _finished(self, done: list[Request]) -> list[StreamChunk]:
        """The finish events of the requests a step finished; their slots are left now, or with ``defer_release`` at
        :meth:`settle`."""
        for r in done:
            if self.defer_release:
                self._settling.append(r)
            else:
                self._release(r)
        return [self._emit_finish(r) for r in done]

    def settle(self) -> None:
        """The requests finished by the last step leave their slots (parked or dropped): the next step does it first
        if its caller has not.  A server calls it once it has handed the step's events on, so a reply's end does not
        wait for its KV to be parked (a copy to host memory: 5-9 ms for a 428-token reply of the embedded model)."""
        with self._lock:
            while self._settling:     # one at a time: a release that raises leaves the rest for the next call
                self._release(self._settling.pop(0))

    def _snapshot_points(self, plan: StepBatch) -> list[tuple[Request, int, bool]]:
        """(request, position, in its reply) for each chunk of ``plan`` that ends where the snapshot policy saves
        the state: a prompt chunk at one of its boundaries, a reply's decode at a block boundary (``reply_end``)
        (read before ``complete`` lengthens the requests)."""
        snaps = self.blocks.snapshots
        if snaps is None:
            return []
        p, policy = self.blocks.block_tokens, snaps.policy
        out = []
        for c in plan.chunks:
            end, r = c.start + c.n_tokens, c.request
            if r.prefilling:
                if not c.draft and end in policy.request_points(r, p):
                    out.append((r, end, False))
            elif policy.reply_end:
                out.append((r, None, True))      # where the reply's kept tokens end (a verify's: known after it)
        return out

    def _save_snapshots(self, points: list[tuple[Request, int, bool]]) -> None:
        """Save each request's state at its point, keyed by the hash of the block it ends (cached blocks only); a
        reply keeps only its latest one."""
        snaps, p = self.blocks.snapshots, self.blocks.block_tokens
        for r, end, reply in points:
            end = r.computed if reply else end
            if r.id not in self.slot_of or r.computed != end or not end or end % p:   # cancelled, preempted, mid-block
                continue
            hashes = r.prefix_hashes(p).values
            key = hashes[end // p - 1] if len(hashes) >= end // p else None
            if key is None or not self.blocks.has_hash(key) or key in snaps:
                continue
            snaps.put(key, self.executor.snapshot(self.slot_of[r.id]))
            if reply:        # the reply moved on: only its last block boundary's state is kept (one it saved itself)
                before = self._reply_snapshot.pop(r.id, None)
                if before is not None:
                    snaps.discard(before)
                self._reply_snapshot[r.id] = key

    def _adopt_matched(self, points: list[tuple[Request, int, bool]]) -> None:
        """A request that matched cached blocks past the deepest snapshot computed them again; once it reaches the
        end of the match (its state saved there), it takes the cached blocks' cells from a slot that holds them and
        frees its own copies (``executor.rebase``, then its own state back), so one copy is held and its later blocks
        chain to the cached ones: they enter the cache, and the request can be parked."""
        bm, snaps, p = self.blocks, self.blocks.snapshots, self.blocks.block_tokens
        for r, end, reply in points:
            if reply or not r.past_snapshot or end != r.cached + r.past_snapshot or r.id not in self.slot_of:
                continue
            hashes = r.prefix_hashes(p)
            hit = bm.cached_run(r.view(end), hashes)
            state = snaps.get(hashes.values[end // p - 1]) if len(hit) == end // p else None
            if state is None or bm.tables[r.id][:len(hit)] == hit:
                continue
            holder = self._holder(hit, r.id)
            if holder is None:
                continue
            self.executor.rebase(self.slot_of[r.id], self.slot_of.get(holder, self._parked.get(holder)), end)
            self.executor.rewind(self.slot_of[r.id], state)
            bm.adopt(r.id, hit)

    def _holder(self, blocks: list[int], other_than: str):
        """A running request (holding its positions) or a parked one whose KV holds all of ``blocks``, or None."""
        bm, n = self.blocks, len(blocks)
        running = ((seq, t) for seq, t in bm.tables.items()
                   if seq in self._holding and bm.written(seq) >= n * bm.block_tokens)
        parked = ((seq, kept) for seq, kept in bm.parked.items() if seq in self._parked)
        return next((seq for seq, table in (*running, *parked) if seq != other_than and table[:n] == blocks), None)

    @property
    def _recording(self) -> bool:
        return self.records is not None or self.on_step is not None

    def _record(self, plan: StepBatch, samples: tuple[bool, ...], got: tuple[bool, ...], start: float, end: float,
                predicted: float | None) -> StepRecord:
        kinds = tuple("verify" if c.draft else "prefill" if c.n_tokens > 1 or not s else "decode"
                      for c, s in zip(plan.chunks, samples))
        return StepRecord(start, end, tuple((c.request.id, c.start, c.n_tokens) for c in plan.chunks), kinds,
                          got, tuple(r.id for r in plan.admitted), predicted, tuple(r.id for r in plan.preempted))

    def _end_step(self) -> None:
        with self._flight_lock:
            self._flight = frozenset()
            self._leaving.clear()                # by now the engine has the cancels (or its caller forgot them)
            self.executor.forget_interrupt()     # one asked as the step ended stops no later step
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
        parking = self.parking
        if r.id in self._parked:      # an earlier request of the same id is parked: it gives its slot up now
            parking.give_up(r.id)
        if not r.cached:
            return
        p, have, src, append = self.blocks.block_tokens, 0, None, False
        for other, k in self.blocks.sharers(r.id):
            if other in self._holding:
                have, src = min(k * p, r.cached), self.slot_of[other]
                break
        hit = parking.hit(r.id, r.cached, have) if parking is not None else None
        if hit is not None:
            if parking.in_host and src is not None:    # the running holder's cells, then the rest
                self.executor.copy(src, slot, have)
                append = True
            src, have = hit
        if src is not None:
            got = self.executor.copy(src, slot, have, append=True) if append else self.executor.copy(src, slot, have)
            if parking is not None and parking.in_host:    # a write-back from host memory that found no cells
                have = got
        if have < r.cached and self.executor.caps.restores_cached_prefix:
            self.executor.restore(slot, r.cached)
            have = r.cached
        snaps = self.blocks.snapshots
        if snaps is not None and have:    # a recurrent state: back to the deepest one saved within the copy
            hashes = r.prefix_hashes(p).values
            k = snaps.depth(hashes, have // p)
            if k:
                self.executor.rewind(slot, snaps.get(hashes[k - 1]))
                snaps.restored += 1
            else:
                self.executor.drop(slot)
            have = k * p
        if have < r.cached:     # the hit spans blocks of several requests: compute what no single one can give
            self.executor.step([self._chunk(r, r.view()[have:r.cached], have, False)])
        self._holding.add(r.id)

    def _chunk(self, r: Request, tokens, start: int, logits: bool, n_logits: int = 1) -> Chunk:
        """r's new tokens for its slot, with its block table from the block manager (the one source of blocks)."""
        return Chunk(self.slot_of[r.id], tuple(tokens), start, logits, n_logits=n_logits if logits else 1,
                     blocks=tuple(self.blocks.tables[r.id]))

    def _release(self, r: Request) -> None:
        """r leaves its slot: parked (cut to its kept prefix) if it finished without error, else dropped."""
        self._reply_snapshot.pop(r.id, None)
        slot = self.slot_of.pop(r.id, None)
        self._holding.discard(r.id)
        if self.parking is not None:
            slot = self.parking.release(r, slot)
        if slot is not None:
            self.executor.drop(slot)
            self._free_slots.append(slot)

    @property
    def parked(self) -> int:
        """Requests whose KV is parked in a slot for later prefix hits."""
        return len(self._parked)

    def _emit_finish(self, r: Request) -> StreamChunk:
        ev = StreamChunk(r.id, None, r.finished_s, r.finish_reason, r.error)
        self._streams.setdefault(r.id, deque()).append(ev)
        return ev

    def _interrupted(self, plan: StepBatch, start: float, predicted: float | None) -> list[StreamChunk]:
        """The step was stopped in flight: the executor holds what it held before it; its requests, each cancelled
        or with a cancel on its way, finish cancelled now."""
        now = self.executor.clock()
        samples = tuple(c.samples for c in plan.chunks)
        self.scheduler.complete(StepBatch(), {}, now)    # the step is over: deferred frees go back
        events = []
        for c in plan.chunks:
            r = c.request
            if not r.finished:
                self.scheduler.finish(r, FinishReason.CANCELLED, now)
                self._release(r)
                events.append(self._emit_finish(r))
        if self._recording:
            rec = self._record(plan, samples, (False,) * len(plan.chunks), start, now, predicted)
            rec = dataclasses.replace(rec, interrupted=True)
            if self.records is not None:
                self.records.append(rec)
            if self.on_step is not None:
                self.on_step(rec)
        return events

    def _fail(self, plan: StepBatch, exc: Exception) -> None:
        now = self.executor.clock()
        self.scheduler.complete(StepBatch(), {}, now)    # the step is over: deferred frees go back
        for c in plan.chunks:
            r = c.request
            if not r.finished:
                self.scheduler.finish(r, FinishReason.ERROR, now, f"{type(exc).__name__}: {exc}")
                self._release(r)
                self._emit_finish(r)

    def _idle(self) -> None:
        nxt = self.scheduler.next_arrival()
        if nxt is not None:     # None: nothing waits (the last running request was cancelled from another thread)
            self.executor.idle_until(nxt)
