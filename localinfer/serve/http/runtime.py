"""The engine thread: one :class:`~localinfer.serve.engine.StepEngine` stepped in a thread of its own.

The event loop never touches the engine.  It puts ``add`` and ``cancel`` commands in a locked inbox and wakes the
thread; the thread applies them between steps, runs ``Engine.step``, and hands each step's tokens and finishes back to
the loop with one ``loop.call_soon_threadsafe`` (each request's events land on its asyncio queue), made by a relay
thread that takes each step's events from a ``queue.SimpleQueue`` (all that is queued, one wake-up): waking the loop
writes to its self-pipe, a call that lets go of the GIL, and the loop then took the GIL to turn the step's tokens into
SSE frames while the engine thread waited for it (0.63 ms a step at 8 streams).  The relay makes that write while the
engine thread is inside the next ``llama_decode``, which runs without the GIL.  A plain streamed reply's token frames
skip all that: once its stream is under way the relay renders and writes them itself (:mod:`.direct`), and the loop
hears of the reply again at its finish (or when a slow reader's socket takes a write only in part).  What a finished
request leaves comes after its events are handed on: its slot (parked or dropped, ``StepEngine.settle``) and its
counts (``/metrics``, the engine view).  A cancel takes effect before the next step; the request's blocks are freed
once the step in flight completes (``Scheduler.cancel``), and a step all of whose requests are being cancelled is
stopped in flight (``StepEngine.cancelling``, the one engine call the loop makes: it takes no lock a step holds), so
a client leaving a long prompt frees the engine at once instead of after its prompt chunk.  Loading happens in this
thread too, so ``/health`` answers 503 until the model is ready, and a signal during the load stops it (llama.cpp's
progress callback polls ``signals.pending``).

Admission control at the door: at most ``parallel + max_queue`` requests are
outstanding; one more is answered 429 with ``Retry-After`` (the mean
end-to-end time of recent requests times the queue depth over the slots).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from localinfer.serve.http.config import ServeConfig, build_engine
from localinfer.serve.http.direct import loop_events, write_frames
from localinfer.serve.http.errors import APIError
from localinfer.serve.http.metrics import Metrics, engine_values
from localinfer.serve.http.sampler import ServeRequest
from localinfer.serve.request import FinishReason
from localinfer.serve.step_log import StepLog
from localinfer.util import signals

log = logging.getLogger("localinfer.serve")
IDLE_WAIT_S = 0.5
PUBLISH_S = 0.05     # while steps run and no request comes, goes or is admitted, the gauges are published this often


class RuntimeState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Event:
    index: int                   # which of the request's n choices
    token: int | None
    reason: FinishReason | None = None
    error: str | None = None


class Handle:
    """One engine request as the loop sees it."""

    def __init__(self, request: ServeRequest, queue: asyncio.Queue, index: int, sink=None):
        self.request, self.queue, self.index = request, queue, index
        self.sink = sink              # a DirectSink (http/direct.py): the relay may write its token frames
        self.finished = False         # set on the loop when its finish event is dispatched
        self.quiet_cancel = False     # cancelled because a stop string matched: not a client cancel


class Runtime:
    def __init__(self, open_executor: Callable[[], object], config: ServeConfig, metrics: Metrics | None = None):
        self.config = config
        self.metrics = metrics or Metrics()
        self._open = open_executor
        self.state = RuntimeState.LOADING
        self._idle_published = False      # kv_cells_used read at the start of this idle spell
        self._published: tuple = (0.0, None)  # when the gauges were last published, and the requests' marks then
        self.load_error: str | None = None
        self.executor = self.engine = self.tokenizer = self.step_model = None
        self._compaction = None            # the llama.cpp executor's compaction record (None on other backends)
        self._aside = None                 # and its context for lone prompts (aside.py; None without one)
        self._closing = None               # the executor, once the engine thread ended: stop() closes it
        self._step_log: StepLog | None = None
        self.context_tokens = 0            # per-request limit: prompt + max_tokens
        self.watch = None                  # the engine view's EngineWatch (http/state.py), told of steps and finishes
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Handle]] = []
        self._active: dict[str, Handle] = {}
        self._outstanding = 0
        self._stop_at: float | None = None
        self._stopping = threading.Event()  # set with _stop_at: also stops a model load in progress
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mean_e2e = 1.0
        self._counting: list[tuple[ServeRequest, FinishReason, bool]] = []    # finished, not yet counted
        self._thread = threading.Thread(target=self._main, name="localinfer-engine", daemon=True)
        self.ready = threading.Event()
        self._relay_queue: queue.SimpleQueue = queue.SimpleQueue()   # each step's events; None: the engine ended
        self._relay = threading.Thread(target=self._relay_main, name="localinfer-relay", daemon=True)
        self._side: list = []               # work run here between steps (the embeddings face): attach()
        self._direct = [0, 0]               # streamed frames the relay wrote itself, and the writes it spilled

    # ---- lifecycle (loop thread) ----------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        self._thread.start()

    def drain(self) -> None:
        """Refuse new requests (503); those in flight go on."""
        if self.state in (RuntimeState.READY, RuntimeState.LOADING):
            self.state = RuntimeState.DRAINING

    def shutdown_after(self, grace_s: float) -> None:
        """Refuse new requests now, and those queued for a slot (a 503 each, before the next step); cancel those
        still running ``grace_s`` from now (returns at once)."""
        self.drain()
        with self._cond:
            at = self._now() + max(0.0, grace_s)
            self._stop_at = at if self._stop_at is None else min(self._stop_at, at)
            self._stopping.set()
            self._cond.notify()

    def stop(self, grace_s: float = 0.0, join_s: float = 30.0) -> None:
        """Finish in-flight requests for up to grace_s, cancel the rest, stop the thread, close the executor."""
        self.shutdown_after(grace_s)
        if self._thread.is_alive():
            self._thread.join(join_s + grace_s)
        if self._relay.is_alive() and not self._thread.is_alive():   # the engine ended, so its last events are queued
            self._relay.join(join_s)          # the last events are on the loop when stop returns
        if not self._thread.is_alive():
            self._close()

    def _close(self) -> None:
        """Close the model once, after the engine thread: not when the engine stops, since replies still being
        written turn their last tokens into text with its vocabulary (the server calls ``stop`` after them)."""
        with self._cond:
            executor, self._closing = self._closing, None
        if executor is not None:
            executor.close()

    def attach(self, worker) -> None:
        """Run ``worker`` in the engine thread between steps: ``worker.work(budget)`` whenever
        ``worker.pending()``, with the step's token budget; ``worker.finish()`` when the thread ends.
        The worker calls :meth:`wake` when it has work."""
        self._side.append(worker)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _side_work(self) -> None:
        cfg = self.engine.scheduler.config
        budget = cfg.token_budget or cfg.chunk_tokens
        for w in self._side:
            if w.pending():
                w.work(budget)

    # ---- requests (loop thread; cancel from any) ----------------------------------
    def submit(self, prompts: list[tuple[int, ...]], make: Callable[..., ServeRequest],
               loop: asyncio.AbstractEventLoop, sink=None) -> tuple[list[Handle], asyncio.Queue]:
        """Queue one engine request per prompt; ``make(id, prompt, arrival_s, index)`` builds each; ``sink``: the
        one prompt's DirectSink, attached before the engine thread can see its handle."""
        n = len(prompts)
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:                          # checked under the lock the engine thread exits under
            self.check_serving()
            limit = self.config.parallel + self.config.max_queue
            if n > limit:
                raise APIError(400, f"n={n} choices exceed what this server holds at once ({limit}: --parallel + "
                                    f"--max-queue)", param="n", code="invalid_value")
            if self._outstanding + n > limit:
                wait = math.ceil(self._mean_e2e * max(1, self._outstanding) / self.config.parallel)
                raise APIError(429, f"the server has {self._outstanding} requests outstanding, its limit "
                                    f"(--parallel + --max-queue) is {limit}; retry later", code="queue_full",
                               headers={"Retry-After": str(min(max(wait, 1), 60))})
            self._loop = loop
            now = self._now()
            rid = uuid.uuid4().hex
            handles = [Handle(make(f"{rid}-{i}", p, now, i), queue, i, sink if n == 1 else None)
                       for i, p in enumerate(prompts)]
            if sink is not None:
                sink.counts = self._direct
            self._outstanding += n
            self._inbox += [("add", h) for h in handles]
            self._cond.notify()
        return handles, queue

    def cancel(self, handle: Handle, quiet: bool = False) -> None:
        """Stop a request (client gone, or a stop string matched when ``quiet``); no-op once finished."""
        if handle.finished:
            return
        handle.quiet_cancel = handle.quiet_cancel or quiet
        with self._cond:
            self._inbox.append(("cancel", handle))
            leaving = [h.request.id for kind, h in self._inbox if kind == "cancel"]
            self._cond.notify()
        if self.engine is not None:
            self.engine.cancelling(leaving)

    def check_serving(self) -> None:
        if self.state is RuntimeState.LOADING:
            raise APIError(503, "the model is still loading; retry shortly", code="loading",
                           headers={"Retry-After": "1"})
        if self.state is RuntimeState.FAILED:
            raise APIError(503, "the model failed to load; the server's log says why", code="load_failed")
        if self.state is not RuntimeState.READY:
            raise APIError(503, "the server is shutting down", code="shutting_down")

    def fail_all(self, error: str, wait_s: float = 3.0) -> None:
        """The process is about to end (an RPC worker went away; any thread): every open request ends with
        ``error`` (a stream with its error event and ``[DONE]``, a whole reply with a 500), waiting up to ``wait_s``
        for the replies to take it."""
        with self._cond:
            handles = [h for h in self._active.values() if not h.finished]
            handles += [h for kind, h in self._inbox if kind == "add" and not h.finished]
        loop = self._loop
        if not handles or loop is None or loop.is_closed():
            return
        for h in handles:             # the relay writes no more frames: the loop writes the error's
            if h.sink is not None:
                h.sink.close()
        out = [(h, Event(h.index, None, FinishReason.ERROR, error)) for h in handles]
        if self._relay.is_alive():    # behind the frames the relay has queued (their spills come first)
            self._relay_queue.put(out)
        else:
            try:
                loop.call_soon_threadsafe(_deliver, out)
            except RuntimeError:       # the loop closed meanwhile
                return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(not h.queue.empty() or not h.finished for h in handles):
            time.sleep(0.02)
        time.sleep(min(0.3, max(0.0, deadline - time.monotonic())))   # the replies' last frames reach the socket

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def _now(self) -> float:
        return self.executor.clock() if self.executor is not None else time.perf_counter()

    # ---- the engine thread ---------------------------------------------------
    def _main(self) -> None:
        try:
            with signals.stops_on(self._stopping):    # llama.cpp's load polls it: a signal stops the load
                self._load()
        except BaseException as exc:  # noqa: BLE001 - reported on /health and to every request
            if self._stopping.is_set():
                self.state = RuntimeState.STOPPED                # stopped while loading: nothing failed
                self.ready.set()
                return
            self.load_error = " ".join(str(exc).split()) or type(exc).__name__
            self.state = RuntimeState.FAILED
            log.info("loading failed: %s", self.load_error)    # the CLI prints it as its error line
            self.ready.set()
            return
        self._relay.start()                   # events exist only once the model is loaded
        if self.state is RuntimeState.LOADING:
            self.state = RuntimeState.READY
        self.ready.set()
        try:
            self._serve()
        finally:
            try:
                self._cancel_all()
                self._publish(idle=True)
            finally:
                self.state = RuntimeState.STOPPED
                self._end_relay()
                for w in self._side:
                    w.finish()
            self._closing = self.executor      # closed by stop()
            if self._step_log is not None:
                self._step_log.close()

    def _load(self) -> None:
        inner = self._open()
        try:
            self.tokenizer = inner.vocab
            self._step_log = StepLog(self.config.step_log) if self.config.step_log else None
            self.executor, self.engine, self.step_model = build_engine(inner, self.config, on_step=self._step_log)
            self.engine.defer_release = True      # a reply's end is handed on before its KV is parked (_iteration)
            self._compaction = getattr(inner, "compaction", None)
            self._aside = getattr(inner, "prefill_aside", None)
        except BaseException:       # calibration failed or a signal came: the model loaded is freed now
            inner.close()
            raise
        b = self.engine.blocks
        self.context_tokens = min(b.capacity * b.block_tokens, inner.caps.slot_cells or 1 << 62)
        self._publish(idle=True)

    def _serve(self) -> None:
        while True:
            try:
                if self._iteration():
                    return
            except Exception as exc:
                log.exception("engine loop error")
                self._dispatch(self._cancel_active(error=f"{type(exc).__name__}: {exc}"))
                self._settle()

    def _iteration(self) -> bool:
        """Apply the inbox, step once, deliver; True when a stop has drained everything."""
        engine = self.engine
        with self._cond:
            if (not self._inbox and not engine.unfinished and self._stop_at is None
                    and not any(w.pending() for w in self._side)):
                self._cond.wait(IDLE_WAIT_S)
            items, self._inbox = self._inbox, []
        out: list[tuple[Handle, Event]] = []
        for kind, h in items:
            if kind == "add":
                engine.add_request(h.request)
                self._active[h.request.id] = h
            elif h.request.id in self._active and engine.cancel(h.request.id):
                out += self._finished(h)
        if self._stop_at is not None:
            out += self._refuse_queued() if self._now() < self._stop_at else self._cancel_active()
        if engine.unfinished:
            try:
                events = engine.step()
            except Exception as exc:  # noqa: BLE001 - the step's requests are finished with ERROR
                log.error("engine step failed: %s: %s", type(exc).__name__, exc)
                events = []
            out += self._events(events)
            if not events and not engine.scheduler.running and not any(w.pending() for w in self._side):
                with self._cond:
                    self._cond.wait(0.005)
        self._dispatch(out)
        self._settle()
        self._side_work()
        self._maybe_publish(engine, bool(items))
        if (self._stop_at is not None and not engine.unfinished and not self._active
                and (self._now() >= self._stop_at or not any(w.pending() for w in self._side))):
            with self._cond:
                if not self._inbox:
                    self.state = RuntimeState.STOPPED
                    return True
        return False

    def _events(self, events) -> list[tuple[Handle, Event]]:
        out = []
        for ev in events:
            h = self._active.get(ev.request_id)
            if h is None:
                continue
            if ev.token is not None:
                got = Event(h.index, ev.token)
                out.append((h, got if h.sink is None else h.sink.route(got)))
        for h in [h for h in self._active.values() if h.request.finished]:
            out += self._finished(h)      # finishes from step() and from a failed step alike
        return out

    def _finished(self, h: Handle) -> list[tuple[Handle, Event]]:
        r = h.request
        self._active.pop(r.id, None)
        self.engine.forget(r.id)                              # the engine keeps every request otherwise
        reason = r.finish_reason or FinishReason.ERROR
        self._counting.append((r, reason, h.quiet_cancel))    # counted once its events are on their way
        with self._cond:
            self._outstanding -= 1
        ev = Event(h.index, None, reason, r.error)
        return [(h, ev if h.sink is None else h.sink.route(ev))]

    def _settle(self) -> None:
        """After a dispatch: the finished requests' slots (parked or dropped: the copy lets the relay have the GIL for
        their last frames), then their counts (their latency histograms: ~0.3 ms for a 128-token reply)."""
        try:
            self.engine.settle()
        except Exception as exc:  # noqa: BLE001 - as a failed step's: logged, and the next step settles what is left
            log.error("releasing finished requests failed: %s: %s", type(exc).__name__, exc)
        counting, self._counting = self._counting, []
        for r, reason, quiet in counting:
            try:
                self.metrics.finished_request(r, cancelled=reason is FinishReason.CANCELLED and not quiet)
                if self.watch is not None:
                    self.watch.finished(r, reason)
            except Exception:  # noqa: BLE001 - counting is after-work: it never ends a request
                log.exception("counting a finished request failed")
            if r.finished_s is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
                self._mean_e2e = 0.9 * self._mean_e2e + 0.1 * (r.finished_s - r.arrival_s)

    def _cancel_active(self, error: str | None = None) -> list[tuple[Handle, Event]]:
        out = []
        for h in list(self._active.values()):
            if not h.request.finished:
                try:
                    self.engine.cancel(h.request.id, error=error)     # frees (or parks) its slot too
                except Exception:  # noqa: BLE001
                    h.request.finish(FinishReason.ERROR, self._now(), error)
            out += self._finished(h)
        return out

    def _refuse_queued(self) -> list[tuple[Handle, Event]]:
        """Shutting down: requests queued behind the free slots, never admitted, end now (their 503); the running
        ones keep the grace period, and so do those the next step admits into a free slot."""
        sched, out = self.engine.scheduler, []
        free = sched.config.max_running - len(sched.running)
        # a reply's choices share a queue: one of them admitted, the others wait their turn in the grace period
        started = {id(h.queue) for h in self._active.values() if h.request.admitted_s is not None}
        for r in [r for i, r in enumerate(sched.waiting) if i >= free and r.admitted_s is None]:
            h = self._active.get(r.id)
            if h is not None and id(h.queue) not in started and self.engine.cancel(r.id):
                out += self._finished(h)
        return out

    def _cancel_all(self) -> None:
        with self._cond:
            items, self._inbox = self._inbox, []
        out = []
        for kind, h in items:
            if kind == "add":
                h.request.finish(FinishReason.CANCELLED, self._now())
                self._active[h.request.id] = h
        if self.engine is not None:
            out = self._cancel_active()
        self._dispatch(out)
        if self.engine is not None:
            self._settle()

    def _dispatch(self, out: list[tuple[Handle, Event]]) -> None:
        """Hand events to the relay thread, which wakes the loop (the engine thread never does: module docstring)."""
        if out:
            self._relay_queue.put(out)

    def _end_relay(self) -> None:
        """The engine thread has ended: the relay delivers what is queued, then ends."""
        self._relay_queue.put(None)

    def _relay_main(self) -> None:
        while True:
            steps = [self._relay_queue.get()]
            while not self._relay_queue.empty():     # steps queued meanwhile: one wake-up of the loop for all
                steps.append(self._relay_queue.get())
            try:
                out = write_frames([ev for step in steps if step is not None for ev in step])
            except Exception:  # noqa: BLE001 - a bug in a frame's path must not end every stream's events
                log.exception("the relay failed on a step's events")
                out = loop_events([ev for step in steps if step is not None for ev in step])
            if out and self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.call_soon_threadsafe(_deliver, out)
                except RuntimeError:      # the loop closed meanwhile
                    pass
            if any(step is None for step in steps):
                return

    def _maybe_publish(self, engine, commands: bool) -> None:
        """The gauges after a step: at once when the engine goes idle, a command came, or a request was admitted,
        preempted or finished, and after every step while the engine view is open; otherwise at most every
        PUBLISH_S (building them each step was ~10% of the engine thread's work between decodes at one client).
        The engine view hears of every step."""
        idle = not engine.unfinished
        now = time.monotonic()
        marks = (engine.scheduler.admissions, engine.scheduler.preemptions, self._outstanding)
        at, before = self._published
        if commands:
            self._idle_published = False      # a request came: the next idle spell reads llama.cpp's cells again
        watched = self.watch is not None and self.watch.watched   # the view's snapshot shows these beside the pool
        if idle or commands or watched or marks != before or now - at >= PUBLISH_S:
            self._published = (now, marks)
            self._publish(idle=idle)
        elif self.watch is not None:
            self.watch.published(self, idle)

    def _publish(self, idle: bool = False) -> None:
        e = self.engine
        if e is None:
            return
        values = engine_values(e, self.executor, self._direct,
                               {k: self.metrics.gauge(k) for k in ("kv_cells_used", "kv_host_tokens")},
                               self._compaction, self._aside)
        if idle and not self._idle_published:   # read llama.cpp's state once per idle spell, not every wait
            values["kv_cells_used"] = self.executor.cells_used()
            values["kv_host_tokens"] = self.executor.host_tokens()
        self._idle_published = idle
        self.metrics.publish(values)
        if self.watch is not None:
            self.watch.published(self, idle)


def _deliver(out: list[tuple[Handle, Event]]) -> None:
    for h, ev in out:
        if ev.reason is not None:
            h.finished = True
        h.queue.put_nowait(ev)

