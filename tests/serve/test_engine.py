"""The step engine on the simulated executor: streams, prefix copies, cells = blocks, random add/step/cancel."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine
from localinfer.serve.parking import Parking
from localinfer.backends.executor import Chunk, Executor
from localinfer.serve.request import FinishReason, Request
from localinfer.serve.scheduler import Scheduler, SchedulerConfig
from localinfer.serve.simulated import SimulatedExecutor
from localinfer.serve.step_model import LinearStepModel
from tests.support.engine_ops import OPS, apply_ops

CARD = LinearStepModel.parse("26.22,30.4,3")


def engine(n_blocks=200, p=4, **cfg):
    ex = SimulatedExecutor(CARD, n_slots=cfg.get("max_running", 8))
    return StepEngine(ex, Scheduler(SchedulerConfig(**cfg), BlockManager(n_blocks, p), CARD), record=True)


def test_simulated_executor_contract():
    ex = SimulatedExecutor(CARD, n_slots=4, n_vocab=50)
    assert isinstance(ex, Executor)
    rows = ex.step([Chunk(0, (1, 2, 3), 0, True), Chunk(1, (4,), 0)])
    assert set(rows) == {0} and rows[0].shape == (50,) and rows[0].dtype == np.float32
    assert ex.clock() == CARD.seconds([(3, 0), (1, 0)])
    ex.copy(0, 2, 2)
    assert ex.cells_used() == 4
    ex.drop(0)
    assert ex.cells_used() == 3
    ex.drop(2, 1)
    assert ex.cells_used() == 2


def test_outputs_do_not_depend_on_the_batch():
    prompts = {f"r{i}": tuple(range(100 * i, 100 * i + 5 + i)) for i in range(4)}
    alone = {}
    for rid, pr in prompts.items():
        e = engine()
        r = e.add_request(Request(rid, pr, 6))
        e.run()
        alone[rid] = r.output
    e = engine(max_running=4)
    reqs = [e.add_request(Request(rid, pr, 6)) for rid, pr in prompts.items()]
    e.run()
    assert {r.id: r.output for r in reqs} == alone
    small = engine(n_blocks=6, max_running=4, admission="on_demand")
    reqs = [small.add_request(Request(rid, pr, 6)) for rid, pr in prompts.items()]
    small.run()
    assert {r.id: r.output for r in reqs} == alone
    assert sum(r.preemptions for r in reqs) > 0


def test_stream_of_chunks():
    e = engine()
    e.add_request(Request("a", (1, 2, 3), 3))
    e.add_request(Request("b", (4, 5), 2))
    events = list(e.stream("a"))
    assert [ev.token is not None for ev in events] == [True, True, True, False]
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert [ev.time_s for ev in events[:3]] == e.scheduler.requests["a"].token_times
    assert e.scheduler.requests["b"].finished          # every request advanced meanwhile
    assert [ev.finish_reason for ev in e.stream("b")][-1] is FinishReason.LENGTH


def test_prefix_hit_is_a_copy_and_cells_match_blocks():
    e = engine(n_blocks=100, p=4, max_running=4)
    system = tuple(range(1000, 1012))                   # three whole blocks
    a = e.add_request(Request("a", system + (1, 2), 4))
    e.step()
    b = e.add_request(Request("b", system + (3,), 4, arrival_s=e.executor.clock()))
    copies = []
    real_copy = e.executor.copy
    e.executor.copy = lambda *args: (copies.append(args), real_copy(*args))
    while e.unfinished:
        e.step()
        if not b.finished and not a.finished:
            assert e.executor.cells_used() == e.blocks.tokens_in_use()
    assert b.cached == 12 and copies == [(e.slot_of.get('a', 0), 1, 12)] == [(0, 1, 12)]
    assert e.executor.cells_used() == 0 and e.blocks.used == 0


def test_cancel_through_the_engine():
    e = engine()
    r = e.add_request(Request("x", (1, 2, 3), 50))
    e.step()
    assert e.cancel("x") and not e.cancel("x")
    assert list(e.stream("x"))[-1].finish_reason is FinishReason.CANCELLED
    assert e.executor.cells_used() == 0 and e.blocks.used == 0 and len(r.output) == 1


@settings(max_examples=40, deadline=None)
@given(OPS, st.sampled_from(["reserve", "on_demand"]), st.sampled_from(["continuous", "chunked", "fixed"]))
def test_random_add_step_cancel_leaves_nothing_behind(seq, admission, policy):
    e = engine(n_blocks=24, p=4, max_running=3, admission=admission, policy=policy, chunk_tokens=8)

    def check(e):
        assert e.blocks.used <= e.blocks.num_blocks
        assert e.executor.cells_used() == e.blocks.tokens_in_use()     # KV cells = tokens in referenced blocks
        for r in e.scheduler.running:        # the block manager reads what a sequence holds off its blocks
            assert e.blocks.written(r.id) == r.computed

    apply_ops(e, seq, tuple(range(500, 508)), check)
    e.run()
    assert e.blocks.used == 0 and e.executor.cells_used() == 0
    reqs = e.scheduler.requests.values()     # one count of admissions and preemptions: the scheduler's
    assert e.scheduler.preemptions == sum(r.preemptions for r in reqs)
    once = sum(r.admitted_s is not None for r in reqs)     # a preempted request is admitted again unless cancelled
    assert once <= e.scheduler.admissions <= once + e.scheduler.preemptions
    assert sum(len(s.admitted) for s in e.records) <= e.scheduler.admissions
    assert sum(len(s.preempted) for s in e.records) <= e.scheduler.preemptions
    assert all(r.finished for r in e.scheduler.requests.values())
    for r in e.scheduler.requests.values():
        assert r.finish_reason in (FinishReason.LENGTH, FinishReason.CANCELLED, FinishReason.ERROR)
        if r.finish_reason is FinishReason.LENGTH:
            assert len(r.output) == r.max_tokens


def test_an_executor_without_restore_needs_live_hits_only():
    import pytest

    class Plain(SimulatedExecutor):
        restores_cached_prefix = False

    sched = lambda **kw: Scheduler(SchedulerConfig(max_running=2), BlockManager(50, 4, **kw))
    with pytest.raises(ValueError, match="pool_hits=False"):
        StepEngine(Plain(CARD, n_slots=2), sched())
    e = StepEngine(Plain(CARD, n_slots=2), sched(pool_hits=False))
    system = tuple(range(1000, 1012))
    e.add_request(Request("a", system + (1,), 2))
    e.run()
    late = e.add_request(Request("b", system + (2,), 2, arrival_s=e.executor.clock()))
    e.step()
    assert late.cached == 0 and e.executor.cells_used() == e.blocks.tokens_in_use()


def test_cancel_from_another_thread_frees_after_the_step_in_flight():
    import threading

    class Slow(SimulatedExecutor):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.entered, self.release = threading.Event(), threading.Event()

        def step(self, chunks):
            self.entered.set()
            assert self.release.wait(10)
            return super().step(chunks)

    p = 16
    ex = Slow(CARD, n_slots=2)
    e = StepEngine(ex, Scheduler(SchedulerConfig(max_running=2), BlockManager(200, p), CARD))
    r = e.add_request(Request("long", tuple(range(104 * p - 10)), 11))     # 104 blocks with its output
    worker = threading.Thread(target=e.step)
    worker.start()
    assert ex.entered.wait(10)
    assert e.cancel("long") and r.finish_reason is FinishReason.CANCELLED
    assert e.blocks.used == 0 and e.blocks.num_free == 200 - 104            # still read by the step
    ex.release.set()
    worker.join(10)
    assert e.blocks.num_free == 200 and ex.cells_used() == 0 and r.output == []


def test_submit_and_sampled_requests_are_reproducible():
    from localinfer.generation.sampling import SamplingParams

    outs = []
    for _ in range(2):
        e = engine()
        hot = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)
        a = e.submit((1, 2, 3), 5, sampling=hot)
        b = e.submit((1, 2, 3), 5, stop_tokens={e.executor.token_for(3, 3)})
        e.run()
        assert a.id != b.id and b.finish_reason is FinishReason.STOP and len(b.output) == 1
        outs.append(a.output)
    assert outs[0] == outs[1] and len(outs[0]) == 5


def test_warm_pool_hits_are_restored_once_then_copied():
    e = engine(n_blocks=100, p=4, max_running=3)
    system = tuple(range(1000, 1012))
    e.blocks.preload(system)
    reqs = [e.add_request(Request(f"w{i}", system + (i,), 3)) for i in range(3)]
    e.step()
    assert [r.cached for r in reqs] == [12, 12, 12]
    assert e.executor.cells_used() == e.blocks.tokens_in_use() == 12 + 3     # one copy of the prefix


class _CopyOnlyExecutor(SimulatedExecutor):
    """Keeps KV only in live slots, like llama.cpp: no restore from the pool."""

    restores_cached_prefix = False


def test_a_hit_spanning_two_live_requests_is_completed_by_computing_the_gap():
    p = 4
    ex = _CopyOnlyExecutor(CARD, n_slots=4)
    eng = StepEngine(ex, Scheduler(SchedulerConfig("continuous", max_running=4, wait_for_prefix=False),
                               BlockManager(64, p, pool_hits=False), CARD))
    base = tuple(range(10, 18))                     # two whole blocks (b does not wait for a's: a split chain)
    a = eng.submit(base + (1,), 40)                 # prefilled in the same step as b: a registers blocks 0-1,
    b = eng.submit(base + tuple(range(30, 38)) + (2,), 40)   # b its own copy of them plus blocks 2-3
    eng.step()
    gaps = []
    step = ex.step
    ex.step = lambda chunks: gaps.extend(c for c in chunks if c.start == 8 and not c.logits) or step(chunks)
    c = eng.submit(base + tuple(range(30, 38)) + (3,), 4)    # hit of 4 blocks: 2 from a, 2 more from b
    for _ in range(20):
        eng.step()
        if c.finished_s is not None:
            break
    assert c.cached == 16 and c.finish_reason is not None and len(c.output) == 4
    assert [len(g.tokens) for g in gaps] == [8]           # a gave 8 by copy, the other 8 were computed
    assert ex.cells_used() == eng.blocks.tokens_in_use()
    eng.cancel(a.id), eng.cancel(b.id)
    eng.run()
    assert ex.cells_used() == 0 and eng.blocks.used == 0


def test_every_chunk_carries_its_block_table():
    """The engine is the one source of blocks: each chunk's ``blocks`` is the block manager's table for its
    request at that step (covering the chunk's positions), through prefix hits, preemption and finishes."""
    e = engine(n_blocks=10, p=4, max_running=3, admission="on_demand", policy="chunked", chunk_tokens=6,
               wait_for_prefix=False)     # all four prefill the shared block at once: preemptions follow
    seen = []
    real_step = e.executor.step

    def step(chunks):
        owner = {slot: rid for rid, slot in e.slot_of.items()}
        for c in chunks:
            assert c.blocks == tuple(e.blocks.tables[owner[c.slot]])
            assert len(c.blocks) * e.blocks.block_tokens >= c.start + len(c.tokens)
        seen.extend(chunks)
        return real_step(chunks)

    e.executor.step = step
    shared = tuple(range(300, 308))
    reqs = [e.add_request(Request(f"r{i}", shared + tuple(range(10 * i, 10 * i + 3 + i)), 6)) for i in range(4)]
    e.run()
    assert seen and all(c.blocks for c in seen)
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert sum(r.preemptions for r in reqs) > 0 and any(r.cached for r in reqs)


def test_cancel_with_an_error_frees_the_slot_and_does_not_park():
    """The server finishes requests with an error this way when its engine loop fails: the slot must come back
    (before, the scheduler was told directly and the slot stayed taken until none was left)."""
    ex = SimulatedExecutor(CARD, n_slots=3)
    e = StepEngine(ex, Scheduler(SchedulerConfig(max_running=2),
                                 BlockManager(64, 4, pool_hits=False, parking=Parking(1)), CARD))
    rs = [e.add_request(Request(f"e{i}", tuple(range(10 * i, 10 * i + 9)), 20)) for i in range(2)]
    e.step()
    assert all(e.cancel(r.id, error="engine loop error") for r in rs)
    assert all(r.finish_reason is FinishReason.ERROR and r.error == "engine loop error" for r in rs)
    assert not e.slot_of and not e._parked and ex.cells_used() == 0 and e.blocks.used == 0
    again = [e.add_request(Request(f"f{i}", tuple(range(5, 14)), 3)) for i in range(2)]
    e.run()
    assert all(r.finish_reason is FinishReason.LENGTH for r in again)


@settings(max_examples=30, deadline=None)
@given(OPS, st.sampled_from(["each op", "forgotten first", "next step"]))
def test_deferred_releases_end_as_releases_in_the_step(seq, when):
    """``defer_release`` (a server's): settled after every op (as the server does, with or without forgetting the
    finished requests first) or only by the next step, everything ends as when the step released its finished
    requests itself: outputs, events, blocks, cells, parked requests, slots."""

    def settle(e):
        if when == "forgotten first":
            for r in [r for r in e.scheduler.requests.values() if r.finished]:
                e.forget(r.id)
        if when != "next step":
            e.settle()

    runs = []
    for defer in (False, True):
        ex = SimulatedExecutor(CARD, n_slots=3 + 4)
        e = StepEngine(ex, Scheduler(SchedulerConfig(max_running=3, chunk_tokens=8),
                                     BlockManager(24, 4, pool_hits=False, parking=Parking(4)), CARD))
        e.defer_release = defer
        reqs = {}
        apply_ops(e, seq, tuple(range(500, 508)), lambda e: (reqs.update(e.scheduler.requests), settle(e)))
        e.run()
        e.settle()
        runs.append(([(r.id, r.output, r.finish_reason, r.finished_s) for r in reqs.values()],
                     {k: [(ev.token, ev.finish_reason) for ev in q] for k, q in e._streams.items()},
                     e.blocks.used, e.parked, e.executor.cells_used(), dict(e.slot_of)))
    assert runs[0] == runs[1]


def test_a_deferred_release_keeps_the_slot_until_settle_or_the_next_step():
    ex = SimulatedExecutor(CARD, n_slots=2 + 2)
    e = StepEngine(ex, Scheduler(SchedulerConfig(max_running=2),
                                 BlockManager(40, 4, pool_hits=False, parking=Parking(2)), CARD))
    e.defer_release = True
    a = e.add_request(Request("a", tuple(range(1, 10)), 3))
    while not a.finished:
        events = e.step()
    assert events[-1].finish_reason is FinishReason.LENGTH and "a" in e.slot_of and e.parked == 0
    cells = ex.cells_used()
    e.settle()
    assert "a" not in e.slot_of and e.parked == 1 and (cells, ex.cells_used()) == (11, 8)    # cut to 2 blocks
    b = e.add_request(Request("b", tuple(range(1, 10)) + (99,), 3))
    while not b.finished:
        e.step()
    assert "b" in e.slot_of and b.cached == 8
    e.add_request(Request("c", (7, 8), 1))
    e.step()                      # settles b first, then seats c
    assert "b" not in e.slot_of and "c" in e.slot_of
