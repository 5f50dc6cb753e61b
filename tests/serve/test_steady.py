"""The steady decode step (serve/steady.py) leaves everything as the general step does: the same tokens, times,
finishes, blocks, cache and cells, under random arrivals, cancels and preemptions, deadlines dropped at the
boundary, stop tokens, a decode share, parking; and on the real llama.cpp executor the same greedy text."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine
from localinfer.serve.parking import Parking
from localinfer.serve.request import FinishReason, Request
from localinfer.serve.scheduler import Scheduler, SchedulerConfig
from localinfer.serve.simulated import SimulatedExecutor
from localinfer.serve.step_model import LinearStepModel
from tests.support.engine_ops import OPS, apply_ops

CARD = LinearStepModel.parse("26.22,30.4,3")


def _engine(steady: bool, n_blocks=24, p=4, park=0, **cfg) -> StepEngine:
    running = cfg.get("max_running", 8)
    ex = SimulatedExecutor(CARD, n_slots=running + park)
    parking = Parking(park) if park else None
    blocks = BlockManager(n_blocks, p, pool_hits=not park, parking=parking)
    e = StepEngine(ex, Scheduler(SchedulerConfig(**cfg), blocks, CARD))
    e.steady = steady
    return e


def _state(e: StepEngine):
    """Everything a step leaves behind that a later step or a reader sees."""
    reqs = [(r.id, tuple(r.output), r.finish_reason, tuple(r.token_times), r.finished_s, r.computed, r.preemptions)
            for r in e.scheduler.requests.values()]
    b = e.blocks
    blocks = [(x.ref, x.filled, x.hash) for x in b.blocks]
    return (reqs, blocks, {k: list(v) for k, v in b.tables.items()}, b.num_cached, b.used, e.executor.clock(),
            e.executor.cells_used(), e.scheduler.admissions, e.scheduler.preemptions, e.parked,
            {k: [(ev.token, ev.finish_reason) for ev in q] for k, q in e._streams.items()},
            [r.id for r in e.scheduler.running], dict(e.slot_of), sorted(e._holding), e.scheduler.peak_running,
            e.scheduler._decode_owed)


@settings(max_examples=40, deadline=None)
@given(OPS, st.sampled_from(["reserve", "on_demand"]), st.sampled_from(["continuous", "chunked", "fixed"]),
       st.sampled_from([0, 4]))
def test_random_loads_end_the_same_with_and_without_the_steady_step(seq, admission, policy, park):
    runs = []
    for steady in (True, False):
        e = _engine(steady, max_running=3, admission=admission, policy=policy, chunk_tokens=8, park=park)
        apply_ops(e, seq, tuple(range(500, 508)), lambda e: None)
        mid = _state(e)
        e.run()
        runs.append((mid, _state(e), e.steady_steps))
    (mid_a, end_a, steady_steps), (mid_b, end_b, general) = runs
    assert mid_a == mid_b and end_a == end_b
    assert general == 0
    STEADY.append(steady_steps)


STEADY: list[int] = []


def test_the_random_loads_took_steady_steps():
    """(After the property test) its loads were not all general steps."""
    if not STEADY:
        pytest.skip("the property test did not run")
    assert sum(STEADY) > 50 and sum(s > 0 for s in STEADY) > len(STEADY) // 4, STEADY


def test_long_decodes_take_the_steady_step_between_block_boundaries_only_where_nothing_else_happens():
    """Deadlines dropped at the boundary, stop tokens, a decode share, arrivals mid-decode and a cancel: the same
    result both ways, and most decode steps were steady ones."""
    runs = []
    for steady in (True, False):
        e = _engine(steady, n_blocks=200, p=16, max_running=4, policy="chunked", chunk_tokens=32, drop_late=True,
                    decode_share=0.5)
        for i in range(3):
            e.add_request(Request(f"a{i}", tuple(range(100 * i + 1, 100 * i + 41)), 60, arrival_s=e.executor.clock()))
        while e.steady_steps < 20 and steady or len(e.scheduler.requests["a0"].output) < 25:
            e.step()
        now = e.executor.clock()
        e.add_request(Request("late", tuple(range(900, 930)), 50, arrival_s=now, deadline_s=now + 0.3))
        e.add_request(Request("stops", tuple(range(700, 720)), 50, arrival_s=now,
                              stop_tokens=frozenset({e.scheduler.requests["a1"].output[3]})))
        for _ in range(5):
            e.step()
        e.cancel("a2")
        e.run()
        runs.append((_state(e), e.steady_steps, e.scheduler.requests))
    (a, steady_steps, reqs), (b, general, _) = runs
    assert a == b and general == 0
    assert reqs["late"].finish_reason is FinishReason.DEADLINE and reqs["a2"].finish_reason is FinishReason.CANCELLED
    decodes = sum(len(r.output) for r in reqs.values())
    assert steady_steps > 0.3 * decodes / 4, (steady_steps, decodes)


def test_a_cancel_from_another_thread_during_a_steady_step_frees_after_it():
    import threading

    e = _engine(True, n_blocks=100, p=4, max_running=2)
    a = e.add_request(Request("a", tuple(range(1, 6)), 40))
    b = e.add_request(Request("b", tuple(range(11, 16)), 40))
    while len(a.output) < 3:
        e.step()
    inner, cancelled = e.executor.step, []

    def step(chunks):     # a cancel of a arrives while the executor computes the step
        if not cancelled:
            t = threading.Thread(target=e.cancel, args=("a",))
            t.start()
            t.join()
            cancelled.append(e.slot_of.get("a"))
        return inner(chunks)

    e.executor.step = step
    before = e.steady_steps
    events = e.step()
    assert e.steady_steps == before + 1 and cancelled[0] is not None
    assert a.finish_reason is FinishReason.CANCELLED and "a" not in e.slot_of
    assert [ev.request_id for ev in events if ev.token is not None] == ["b"]
    e.run()
    assert len(b.output) == 40 and e.blocks.used == 0 and e.executor.cells_used() == 0


def test_a_recording_engine_keeps_the_general_step():
    e = _engine(True, n_blocks=100, p=4, max_running=2)
    e.records = []
    e.add_request(Request("a", tuple(range(1, 6)), 20))
    e.run()
    assert e.steady_steps == 0 and len(e.records) == 20


@pytest.fixture(scope="module")
def executor(default_model):
    pytest.importorskip("llama_cpp")
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=3, n_ctx=768, threads=1, flash_attn=True) as ex:
        yield ex


def test_llamacpp_greedy_text_is_the_same_with_and_without_the_steady_step(executor):
    tok = executor.engine.tokenize
    prompts = [tuple(tok(t)) for t in ("The capital of France is", "Water boils at", "Once upon a time")]
    outs = []
    for steady in (True, False):
        for slot in range(executor.n_slots):
            executor.drop(slot)
        config = SchedulerConfig(max_running=3, policy="chunked", chunk_tokens=16)
        e = StepEngine(executor, Scheduler(config, BlockManager(60, 16, pool_hits=False)))
        e.steady = steady
        reqs = [e.add_request(Request(f"r{i}", p, 40 + 5 * i)) for i, p in enumerate(prompts[:2])]
        for _ in range(10):
            e.step()
        reqs.append(e.add_request(Request("r2", prompts[2], 30)))
        e.run()
        assert executor.cells_used() == 0 and e.blocks.used == 0
        outs.append(([r.output for r in reqs], e.steady_steps))
    (a, steady_steps), (b, general) = outs
    assert a == b and general == 0 and steady_steps > 20
    assert [len(o) for o in a] == [40, 45, 30]


def test_steady_step_switch(monkeypatch):
    monkeypatch.setenv("LOCALINFER_STEADY_STEP", "0")
    assert StepEngine(SimulatedExecutor(CARD, n_slots=1),
                      Scheduler(SchedulerConfig(max_running=1), BlockManager(8, 4), CARD)).steady is False
    monkeypatch.delenv("LOCALINFER_STEADY_STEP")
    assert StepEngine(SimulatedExecutor(CARD, n_slots=1),
                      Scheduler(SchedulerConfig(max_running=1), BlockManager(8, 4), CARD)).steady is True

