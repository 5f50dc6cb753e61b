"""The engine's state as the engine view shows it (``GET /v1/engine/state``), snapshotted on the engine thread.

:class:`EngineWatch` hangs on the runtime (``Runtime.watch``); the engine thread calls ``finished`` for every
request that ends and ``published`` after every step, right after the gauges of ``/metrics`` are published.
While a page polls (a read in the last ``WATCHED_S``), ``published`` keeps each step's batch and, when the
engine has moved, builds a JSON-ready snapshot at most every ``SNAPSHOT_S`` (and at once when the engine goes
idle): the KV block pool as a grid, the requests running and queued, the parked KV, the step model, and the
``/metrics`` samples of that same moment.  The HTTP side reads only the last snapshot (one attribute replaced
whole), so it never touches the engine.  The fields are documented in docs/serving.md ("The engine view").
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

log = logging.getLogger("localinfer.serve")
VERSION = 1
WATCHED_S = 10.0       # a page read within this long ago: keep steps and build snapshots
SNAPSHOT_S = 0.2       # at most this often (stretched to 20x the build time on a very large pool)
STEPS_KEPT = 120
FINISHED_KEPT = 64
TEXT_CHARS = 240       # --show-prompts: the last characters of a prompt, and of the output so far
# grid codes: k >= 0 is held by requests[k] alone
FREE, CACHED, PARKED, SHARED = -1, -2, -3, -4


class EngineWatch:
    """Per-step bookkeeping and snapshots for the engine view (all calls but ``read`` on the engine thread)."""

    def __init__(self, show_prompts: bool = False):
        self.show_prompts = show_prompts
        self.snapshot: dict | None = None          # replaced whole by the engine thread
        self.snapshot_at = 0.0                     # time.monotonic() of it
        self.fresh = threading.Event()             # set when a snapshot is built
        self._read_at = -1e9                       # time.monotonic() of the last page read
        self._steps: deque[dict] = deque(maxlen=STEPS_KEPT)
        self._finished: deque[dict] = deque(maxlen=FINISHED_KEPT)
        self.output_done = 0
        self._n_step = 0
        self._exec = (0, 0.0)                      # the executor's (steps, step seconds) at the last publish
        self._key = None                           # what the last snapshot saw (rebuilt only when it changes)
        self._cost = 0.0                           # seconds the last build took
        self.error: str | None = None              # set if the view failed (the engine goes on)
        self._engine = None

    # ---- the HTTP side ---------------------------------------------------------
    def read(self) -> dict | None:
        """The last snapshot; a read also keeps the engine thread snapshotting for ``WATCHED_S`` (a read after a
        pause makes the next publish build a fresh one, ``fresh`` set then)."""
        if not self.watched:
            self.fresh.clear()
            self._key = None
        self._read_at = time.monotonic()
        return self.snapshot

    @property
    def watched(self) -> bool:
        return time.monotonic() - self._read_at < WATCHED_S

    # ---- the engine thread -----------------------------------------------------
    def finished(self, r, reason) -> None:
        """Request ``r`` ended with ``reason`` (a FinishReason); called once its events are on their way."""
        if self.error is None:
            try:
                self._note_finished(r, reason)
            except Exception as exc:  # noqa: BLE001 - the view fails, never the engine thread
                self._fail(exc)

    def published(self, runtime, idle: bool) -> None:
        """After each step (and each idle wait): record the step's batch; snapshot when it is due."""
        if self.error is None:
            try:
                self._note_step(runtime, idle)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        log.exception("the engine view stopped")
        if self._engine is not None:
            self._engine.records = None            # no more step records kept for it
        self.error = f"{type(exc).__name__}: {exc}"
        self.fresh.set()

    def _note_finished(self, r, reason) -> None:
        self.output_done += len(r.output)
        times = r.token_times
        self._finished.append({
            "id": _short(r.id), "reason": reason.value, "error": r.error, "refused": r.admitted_s is None,
            "prompt_tokens": len(r.prompt), "output_tokens": len(r.output), "cached_tokens": r.cached,
            "preemptions": r.preemptions, "ttft_s": r.ttft_s,
            "itl_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            "e2e_s": None if r.finished_s is None else r.finished_s - r.arrival_s, "at_s": r.finished_s})

    def _note_step(self, runtime, idle: bool) -> None:
        engine, executor = runtime.engine, runtime.executor
        self._engine = engine
        sched = engine.scheduler
        watched = self.watched
        if engine.records is None and watched:
            engine.records = []                    # Engine appends a StepRecord per step while this is a list
        records, engine.records = engine.records, ([] if watched else None)
        steps, seconds = executor.steps, executor.step_seconds
        d_steps, d_seconds = steps - self._exec[0], seconds - self._exec[1]
        self._exec = (steps, seconds)
        if not watched:
            return
        for rec in records or ():
            self._record(runtime, rec, d_seconds if len(records) == 1 and d_steps == 1 else None)
        key = (steps, len(sched.running), len(sched.waiting), engine.blocks.used, engine.blocks.num_cached,
               engine.parked, len(self._finished), runtime.state)
        due = time.monotonic() - self.snapshot_at >= max(SNAPSHOT_S, 20 * self._cost)
        if key != self._key and (due or idle):
            self._key = key
            t0 = time.perf_counter()
            self.snapshot = self._build(runtime)
            self._cost = time.perf_counter() - t0
            self.snapshot_at = time.monotonic()
            self.fresh.set()

    def _record(self, runtime, rec, measured_s: float | None) -> None:
        sched = runtime.engine.scheduler
        chunks = []
        for (rid, start, n), kind in zip(rec.chunks, rec.kinds):
            chunks.append({"id": _short(rid), "kind": "decode" if kind == "verify" else kind, "start": start,
                           "tokens": n})
        self._n_step += 1
        self._steps.append({
            "n": self._n_step, "end_s": rec.end_s, "tokens": sum(n for _, _, n in rec.chunks),
            "budget": sched.config.token_budget, "chunks": chunks,
            "measured_s": measured_s, "wall_s": rec.end_s - rec.start_s,
            "predicted_s": rec.predicted_s,      # the step model's, made before the step ran
            "admitted": [_short(x) for x in rec.admitted], "preempted": [_short(x) for x in rec.preempted]})

    def _build(self, runtime) -> dict:
        engine, sched, blocks = runtime.engine, runtime.engine.scheduler, runtime.engine.blocks
        now = runtime.executor.clock()
        live = [*sched.running, *sched.waiting]
        index = {r.id: i for i, r in enumerate(live)}
        requests = [self._request(runtime, r, now, blocks) for r in live]
        grid, counts = _grid(blocks, index)
        model = None if runtime.step_model is None else runtime.step_model.model     # the fitted LinearStepModel
        cfg = sched.config
        return {
            "config": {"parallel": cfg.max_running, "max_queue": runtime.config.max_queue,
                       "token_budget": cfg.token_budget, "chunk_tokens": cfg.chunk_tokens,
                       "block_tokens": blocks.block_tokens, "prefix_cache": blocks.prefix_cache,
                       "park_slots": engine.park_slots, "context_tokens": runtime.context_tokens,
                       "draft_max": cfg.draft_max},
            "pool": {"blocks": blocks.num_blocks, "capacity": blocks.capacity, "used": blocks.used,
                     "cached": blocks.num_cached, "free": blocks.num_free, **counts, "grid": grid},
            "requests": requests,
            "running": len(sched.running), "waiting": len(sched.waiting),
            "parked": {"sequences": engine.parked,
                       "blocks": sum(len(v) for v in blocks.parked.values())},
            "snapshots": None if blocks.snapshots is None else blocks.snapshots.as_json(),
            "steps": list(self._steps),
            "finished": list(self._finished),
            "counts": {"admissions": sched.admissions, "preemptions": sched.preemptions,
                       "output_tokens": self.output_done + sum(len(r.output) for r in live)},
            "step_model": None if model is None else {
                "fixed_s": model.fixed_s, "per_token_s": model.per_token_s, "per_pair_s": model.per_pair_s,
                "per_seq_s": model.per_seq_s, "per_row_pair_s": model.coefficients[3], "per_held_s": model.per_held_s},
            # deadline-aware admission's scale on its predicted paths: recent steps' wall time over predicted
            "deadline_factor": {"factor": sched.step_errors.factor(sched.step_model),
                                "window": len(sched.step_errors.steps), "observed": sched.step_errors.seen},
            "clock_s": now,
            "metrics": metric_samples(runtime.metrics),
        }

    def _request(self, runtime, r, now: float, blocks) -> dict:
        out = {"id": _short(r.id), "state": r.state.value, "prompt_tokens": len(r.prompt),
               "output_tokens": len(r.output), "max_tokens": r.max_tokens, "computed": r.computed,
               "cached_tokens": r.cached, "blocks": len(blocks.tables.get(r.id, ())), "preemptions": r.preemptions,
               "prefilling": r.state.value == "running" and r.prefilling, "age_s": now - r.arrival_s,
               "ttft_s": r.ttft_s, "deadline_in_s": None if r.deadline_s is None else r.deadline_s - now}
        if self.show_prompts:
            out["prompt"] = _text(runtime.tokenizer, r.prompt[-TEXT_CHARS:])[-TEXT_CHARS:]
            out["output"] = _text(runtime.tokenizer, r.output[-TEXT_CHARS:])[-TEXT_CHARS:]
        return out


def engine_state(runtime, show_prompts: bool = False) -> dict:
    """The engine view's JSON (version :data:`VERSION`): the runtime's state and the engine thread's last
    snapshot (``snapshot`` null while loading or before the first one), with its age in seconds, and each
    device's memory as loaded beside fit's prediction (``devices``: empty until the model is loaded)."""
    watch = runtime.watch
    if watch is None:                      # the first page read: the engine thread starts snapshotting
        watch = runtime.watch = EngineWatch(show_prompts)
    snap = watch.read()
    return {"version": VERSION, "state": runtime.state, "show_prompts": watch.show_prompts, "error": watch.error,
            "age_s": None if snap is None else round(time.monotonic() - watch.snapshot_at, 4), "snapshot": snap,
            "devices": runtime.metrics.devices}


def metric_samples(metrics) -> dict[str, float]:
    """Every sample ``/metrics`` exports but histogram buckets, keyed as its text lines name them
    (``name`` or ``name{label="value"}``)."""
    out = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _grid(blocks, index: dict[str, int]) -> tuple[list[int], dict[str, int]]:
    """One code a block (FREE, CACHED, PARKED, SHARED, or the index of the one request holding it), and counts."""
    grid = [FREE] * blocks.num_blocks
    for b in blocks.blocks:                                    # unreferenced blocks the prefix cache names
        if b.ref == 0 and b.hash is not None:
            grid[b.id] = CACHED
    for kept in blocks.parked.values():
        for b in kept:
            if grid[b] == CACHED:
                grid[b] = PARKED
    for seq, table in blocks.tables.items():
        k = index.get(seq, SHARED)
        for b in table:
            g = grid[b]
            grid[b] = k if g < 0 and g != SHARED else SHARED
    counts = {"shared": grid.count(SHARED), "parked_blocks": grid.count(PARKED),
              "cached_unparked": grid.count(CACHED)}
    return grid, counts


def _text(tokenizer, tokens) -> str:
    if tokenizer is None:
        return ""
    return b"".join(tokenizer.token_bytes(t) for t in tokens).decode("utf-8", "replace")


def _short(rid: str) -> str:
    """A request's id as the page shows it: the first 8 characters and the choice index."""
    head, _, choice = str(rid).rpartition("-")
    return f"{head[:8]}-{choice}" if head else str(rid)[:12]
