"""The step engine on the real llama.cpp executor (embedded model): prefix hits are copies, cells = blocks."""

import pytest

from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine
from localinfer.serve.request import FinishReason, Request
from localinfer.serve.scheduler import Scheduler, SchedulerConfig

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def executor(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=3, n_ctx=768, threads=1, flash_attn=True) as ex:
        yield ex


def _engine(ex, **cfg):
    for slot in range(ex.n_slots):
        ex.drop(slot)
    config = SchedulerConfig(**{"max_running": 3, "policy": "chunked", "chunk_tokens": 16, **cfg})
    return StepEngine(ex, Scheduler(config, BlockManager(40, 16, pool_hits=False)))


def test_prefix_hit_copies_cells_and_counts_match(executor):
    tok = executor.engine.tokenize
    system = tuple(tok("You are a helpful assistant. Answer briefly and clearly, please. " * 3))[:32]
    e = _engine(executor)
    a = e.add_request(Request("a", system + tuple(tok(" The capital of France is")), 6))
    for _ in range(3):
        e.step()
    b = e.add_request(Request("b", system + tuple(tok(" The capital of Spain is")), 6))
    c = e.add_request(Request("c", tuple(tok("Water boils at")), 6))
    while e.unfinished:
        e.step()
        assert executor.cells_used() == e.blocks.tokens_in_use()
    assert b.cached == 32 and executor.cells_used() == 0 and e.blocks.used == 0
    assert all(r.finish_reason is FinishReason.LENGTH for r in (a, b, c))


def test_cancelling_the_only_request_of_a_long_prefill_step_stops_it_in_flight(executor):
    """Issue 32, item 8: a cancel mid-prompt waited out the whole prefill step.  Now the step whose requests are
    all cancelled is stopped in flight: it ends well before the same step run whole (timed in this test), is
    recorded as interrupted, leaves no cell or block behind, and the next request's greedy output is a fresh
    run's.  The simulated executor cannot interrupt: the step ends as before."""

    e = _engine(executor, chunk_tokens=700)       # the whole prompt in one step: the worst case
    e.records = []
    tok = executor.engine.tokenize
    q = tuple(tok("The capital of France is"))
    ref = e.add_request(Request("ref", q, 6))
    e.run()
    whole = e.add_request(Request("whole", tuple(range(1000, 1600)), 1))
    e.run()
    full_s = e.records[-1].end_s - e.records[-1].start_s
    assert whole.finish_reason is FinishReason.LENGTH and e.records[-1].chunks[-1][2] == 600

    r = e.add_request(Request("cut", tuple(range(2000, 2600)), 1))

    _run_cancelling_in_flight(e, "cut")
    rec = e.records[-1]
    assert r.finish_reason is FinishReason.CANCELLED and rec.interrupted and rec.chunks == (("cut", 0, 600),)
    assert rec.end_s - rec.start_s < 0.5 * full_s, (rec.end_s - rec.start_s, full_s)
    assert executor.cells_used() == 0 and e.blocks.used == 0 and not e.unfinished
    again = e.add_request(Request("again", q, 6))
    e.run()
    assert again.output == ref.output and len(ref.output) == 6


def test_a_step_is_not_stopped_while_one_of_its_requests_is_still_wanted(executor):
    """Cancelling one of two prompts in a step leaves the step to run: the other's first token, sampled from it,
    is the one it gets when nothing is cancelled (the same batch; later tokens need not match, as the cancelled
    request's freed cells change where the next ones go, and so the order attention adds them in)."""

    e = _engine(executor, chunk_tokens=700)
    e.records = []
    a_prompt, b_prompt = tuple(range(3000, 3280)), tuple(range(4000, 4280))
    e.add_request(Request("a0", a_prompt, 4))
    ref = e.add_request(Request("b0", b_prompt, 4))
    e.run()
    a = e.add_request(Request("a", a_prompt, 4))
    b = e.add_request(Request("b", b_prompt, 4))

    _run_cancelling_in_flight(e, "a")
    assert a.finish_reason is FinishReason.CANCELLED and b.finish_reason is FinishReason.LENGTH
    assert not any(r.interrupted for r in e.records) and len(e.records[-4].chunks) == 2
    assert len(b.output) == 4 and b.output[0] == ref.output[0]
    assert executor.cells_used() == 0 and e.blocks.used == 0


def _run_cancelling_in_flight(e, request_id: str) -> None:
    """Run the engine while another thread cancels ``request_id`` as soon as a step is in flight."""
    import threading
    import time

    def cancel_in_flight():
        deadline = time.monotonic() + 30
        while not e._flight and time.monotonic() < deadline:
            time.sleep(0.001)
        e.cancel(request_id)
    t = threading.Thread(target=cancel_in_flight)
    t.start()
    e.run()
    t.join(30)


def test_a_cancel_on_its_way_before_the_step_starts_stops_it_and_no_later_one(executor):
    """A cancel announced (``cancelling``) while the next step is still being planned, before it is in flight,
    stops that step as it starts; an interrupt asked after a step ended stops no later step."""
    e = _engine(executor, chunk_tokens=700)
    e.records = []
    r = e.add_request(Request("early", tuple(range(1000, 1600)), 1))
    assert not e.cancelling(["early"])                   # nothing in flight yet: remembered for the next step
    e.step()
    assert e.records[-1].interrupted and r.finish_reason is FinishReason.CANCELLED
    assert executor.cells_used() == 0 and e.blocks.used == 0
    tok = executor.engine.tokenize
    q = tuple(tok("The capital of France is"))
    executor.interrupt()                                 # between steps: the engine forgets it before the next
    executor.forget_interrupt()
    ok = e.add_request(Request("ok", q, 4))
    e.run()
    assert ok.finish_reason is FinishReason.LENGTH and not any(s.interrupted for s in e.records[1:])
