"""The steady decode step: every running request decodes one token and nothing else changes.

Most steps of a served load are this one (a closed loop's 128-token replies: all but a handful), and the general
step spends most of its host time finding it out: the scheduler's plan (budget, prompt chunks, admission, drafts,
the decode share), the chunks' block tables, the snapshot and mask bookkeeping, the block manager's commit.  Between
two graphs that time is llama.cpp's idle time: at one client on the 2-vCPU dev VM the engine's work between two
``llama_decode`` calls was ~0.45 ms of a ~13 ms token (issue 45).

:func:`steady_step` takes the step when it is exactly what the scheduler would plan -- no request waits (no arrival,
no preempted one), every running request has its one pending token and nothing else to compute, takes no new block
and shares no block it writes, and nothing asks for more than a plain step gives (no recording, drafts, snapshots,
grammar, a deadline passed under ``drop_late``, decode share, a budget smaller than the batch) -- and otherwise returns
None, so the general step runs.  It computes the same chunks in the same order, samples each row with the request's
own sampler, and completes them with the scheduler's own ``complete``; the cancel and interrupt protocol
(``StepEngine.cancel``/``cancelling``) is the same one.
"""

from __future__ import annotations

import os

from localinfer.backends.executor import Chunk, StepInterrupted
from localinfer.serve.events import StreamChunk
from localinfer.serve.request import State
from localinfer.serve.scheduler import ScheduledChunk, StepBatch


def enabled() -> bool:
    """Whether engines take the steady step (``LOCALINFER_STEADY_STEP=0`` turns it off: the general step always)."""
    return os.environ.get("LOCALINFER_STEADY_STEP", "1") != "0"


def steady_step(engine) -> list | None:
    """One steady decode step of ``engine`` (a :class:`~localinfer.serve.engine.StepEngine`) and its events; None
    when this step is not one (nothing done: the caller runs the general step)."""
    ex, sched = engine.executor, engine.scheduler
    with engine._lock:
        start = ex.clock()
        batch = _batch(engine, start)
        if batch is None:
            return None
        sched.blocks.begin_step()
        engine._in_step = True
    with engine._flight_lock:
        engine._flight = frozenset(r.id for r, _ in batch)
        if engine._leaving and ex.caps.interrupts_steps:
            engine._interrupt_if_all_leaving()
    try:
        rows = ex.step([c for _, c in batch])
    except StepInterrupted:
        with engine._lock:
            engine._end_step()
            return engine._interrupted(_plan(batch), start, None)
    except Exception as exc:
        with engine._lock:
            engine._end_step()
            engine._fail(_plan(batch), exc)
        raise
    with engine._lock:
        engine._end_step()
        engine.steady_steps += 1
        got = [(r, r.sampler.sample(rows[c.slot], r.view())) for r, c in batch
               if r.state is State.RUNNING and r.computed == c.start]       # not cancelled or preempted meanwhile
        end = ex.clock()
        done = sched.complete(_plan(batch), {r.id: tok for r, tok in got}, end)     # the general step's completion
        events = [StreamChunk(r.id, r.output[-1], end) for r, _ in got]
        for ev in events:
            engine._streams[ev.request_id].append(ev)
        return events + engine._finished(done)


def _batch(engine, now: float) -> list[tuple] | None:
    """(request, chunk) of every running request, in the scheduler's order, when this step (at ``now``) is a steady
    one."""
    sched, bm = engine.scheduler, engine.blocks
    cfg, running = sched.config, sched.running
    if (not running or sched.waiting or engine._after_step or engine._recording or sched.drafter is not None
            or sched._decode_owed > 0 or bm.snapshots is not None
            or (cfg.token_budget is not None and cfg.token_budget < len(running))):
        return None
    out = []
    slot_of, tables = engine.slot_of, bm.tables
    for r in running:
        c = r.computed
        if (not r.output or r.n_tokens - c != 1 or r.id not in engine._holding or r.sampler.constraint is not None
                or (cfg.drop_late and r.deadline_s is not None and now > r.deadline_s) or bm.grow_needed(r.id, c + 1)):
            return None
        out.append((r, Chunk(slot_of[r.id], (r.output[-1],), c, True, blocks=tuple(tables[r.id]))))
    return out


def _plan(batch):
    """The general step's plan for this batch (for its completion, interrupt and failure paths)."""
    return StepBatch([ScheduledChunk(r, c.start, 1) for r, c in batch])

