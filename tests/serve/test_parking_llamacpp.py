"""Parked sequences on the real llama.cpp executor (embedded model, 1 thread, flash attention on): a finished
request's KV serves a later prompt by llama_memory_seq_cp, evictions drop its cells, cells = blocks throughout.
Each test runs twice: parked KV in its cells, and parked in host memory (``park_host``, the server's: the cells are
then the running requests' blocks only, and a hit writes the parked positions back).

Every chunk stays under 64 rows (chunks of 16), so each row takes ggml's one-row flash-attention kernel and a
greedy reply is the same whether its prefix was copied from a parked sequence or computed (the cold run is on
the same executor, everything dropped first).
"""

import pytest

from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine
from localinfer.serve.parking import Parking
from localinfer.serve.http.sampler import ServeRequest
from localinfer.serve.request import FinishReason, Request
from localinfer.serve.scheduler import Scheduler, SchedulerConfig

pytest.importorskip("llama_cpp")

P = 16
TEXT = ("You are a helpful assistant. Answer briefly and clearly, and say so when you do not know. "
        "Keep to the facts you are given, and never invent a source. When a question is unclear, ask one short "
        "question back. Use plain words, short sentences, and the metric system for every measurement. ")


@pytest.fixture(scope="module", params=[False, True], ids=["in-cells", "in-host"])
def executor(default_model, request):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=4, n_ctx=256, threads=1, flash_attn=True,
                               park_host=request.param) as ex:
        assert ex.drops_tail and ex.n_cells == 256 and ex.parks_in_host is request.param
        yield ex


def _cells(e) -> int:
    """What llama.cpp's cells must hold: every block's tokens, or (parked in host memory) the running requests'."""
    return e.blocks.tokens_in_use() if e.executor.parks_in_host else e.blocks.tokens_held()


def _parked_tokens(ex) -> int:
    """Tokens the parked requests keep: in cells, or in host memory (no cells)."""
    return ex.host_tokens() if ex.parks_in_host else ex.cells_used()


def _engine(ex, park=2, **cfg):
    for slot in range(ex.n_slots):
        ex.drop(slot)
    assert ex.cells_used() == 0
    config = SchedulerConfig(max_running=2, policy="chunked", chunk_tokens=P, **cfg)
    return StepEngine(ex, Scheduler(config, BlockManager(ex.n_cells // P, P, pool_hits=False, parking=Parking(park))))


def _run(e):
    while e.unfinished:
        e.step()
        assert e.executor.cells_used() == _cells(e)     # each cell a block's, each block's cells


def _cold(ex, prompt, n):
    e = _engine(ex, park=0)
    r = e.add_request(Request("cold", prompt, n))
    _run(e)
    assert r.finish_reason is FinishReason.LENGTH
    return r.output


def _prompts(ex):
    tok = ex.engine.tokenize
    system = tuple(tok(TEXT * 2))[:72]
    assert len(system) == 72
    return system, system + tuple(tok(" The capital of France is")), system + tuple(tok(" Water boils at"))


def test_a_finished_requests_kv_serves_a_later_prompt(executor):
    system, a_prompt, b_prompt = _prompts(executor)
    cold_b = _cold(executor, b_prompt, 8)
    e = _engine(executor)
    a = e.add_request(Request("a", a_prompt, 8))
    _run(e)
    assert e.parked == 1 and e.blocks.used == 0
    assert _parked_tokens(executor) == e.blocks.num_cached * P == (len(a_prompt) + 7) // P * P   # the tail dropped
    assert executor.cells_used() == (0 if executor.parks_in_host else e.blocks.num_cached * P)
    b = e.add_request(Request("b", b_prompt, 8))
    _run(e)
    assert b.cached == len(system) // P * P >= 64 and b.output == cold_b
    again = e.add_request(Request("again", a_prompt, 8))            # the identical prompt
    _run(e)
    assert again.cached == (len(a_prompt) - 1) // P * P and again.output == a.output
    assert e.blocks.used == 0 and executor.cells_used() == _cells(e)


def test_evicted_parked_blocks_lose_their_cells_and_a_later_hit_is_partial(executor):
    _, a_prompt, _ = _prompts(executor)
    tok = executor.engine.tokenize
    filler = tuple(tok(" ".join(f"item {i} is number {i * 7}." for i in range(40))))
    late_prompt = a_prompt + tuple(tok(" And of Italy?"))
    cold_late = _cold(executor, late_prompt, 6)
    e = _engine(executor, park=2)
    n_blocks = e.blocks.num_blocks                                   # 16 blocks of 16
    e.add_request(Request("a", a_prompt, 4))
    _run(e)
    parked = e.blocks.num_cached
    assert parked == (len(a_prompt) + 3) // P == 5
    big = filler[:(n_blocks - 2) * P - 4]                            # 14 blocks with its output: 3 of a's go
    assert len(big) == (n_blocks - 2) * P - 4
    e.add_request(Request("big", big, 4))
    _run(e)
    assert e.blocks.evictions == 3 and e.blocks.parked["a"] == [0, 1]
    kept = len(e.blocks.parked["a"])
    assert kept == 2 and executor.cells_used() == _cells(e) and e.blocks.tokens_held() == e.blocks.num_cached * P
    assert _parked_tokens(executor) == e.blocks.num_cached * P
    late = e.add_request(Request("late", late_prompt, 6))
    _run(e)
    assert late.cached == kept * P and late.output == cold_late


def test_a_preempted_request_is_dropped_not_parked(executor):
    _, a_prompt, b_prompt = _prompts(executor)
    e = _engine(executor, park=2, admission="on_demand", wait_for_prefix=False)   # both prefill the system prompt
    reqs = [e.add_request(Request(f"r{i}", p, 60)) for i, p in enumerate((a_prompt, b_prompt))]
    while e.unfinished:
        e.step()
        assert executor.cells_used() == _cells(e)
        assert all(r.finished for r in reqs if r.id in e._parked)
    assert sum(r.preemptions for r in reqs) > 0 and all(r.finish_reason is FinishReason.LENGTH for r in reqs)


def test_a_full_host_budget_gives_the_oldest_parked_kv_up(executor):
    """Room in host memory for one parked request: the next to finish takes its place (least recently used
    first), and one over the whole budget is not parked at all (no cells kept either), the others left be."""
    if not executor.parks_in_host:
        pytest.skip("host memory only")
    system, a_prompt, b_prompt = _prompts(executor)
    e = _engine(executor, park=2)
    a = e.add_request(Request("a", a_prompt, 4))
    _run(e)
    one = executor._host[e._parked["a"]].size
    executor.host_budget = one + one // 2                 # a second parked state does not fit beside it
    try:
        tail = tuple(executor.engine.tokenize(" at sea level, which is a hundred degrees on the Celsius scale"))
        b = e.add_request(Request("b", b_prompt + tail, 4))   # a whole block of its own past the system prompt's
        _run(e)
        assert list(e._parked) == ["b"] and executor.cells_used() == 0 and executor.host_tokens() > 0
        assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
        kept = executor.host_tokens()
        executor.host_budget = 16                         # under any state: c is not parked, b stays
        c = e.add_request(Request("c", a_prompt, 4))
        _run(e)
        assert c.finish_reason is FinishReason.LENGTH
        assert list(e._parked) == ["b"] and executor.cells_used() == 0 and executor.host_tokens() == kept
        assert e.blocks.used == 0 and e.blocks.num_cached * P == kept
    finally:
        executor.host_budget = None


def test_a_full_host_budget_gives_up_the_first_answer_to_a_prompt_sent_again(executor):
    """Host memory for two parked requests: a prompt sent again and answered differently takes its first answer's
    place (that prompt's blocks stay in the new one), not the other conversation's, as least recently used would."""
    if not executor.parks_in_host:
        pytest.skip("host memory only")
    _, a_prompt, b_prompt = _prompts(executor)
    tail = tuple(executor.engine.tokenize(" at sea level, which is a hundred degrees on the Celsius scale"))
    a_prompt, b_prompt = a_prompt + tail, b_prompt + tail      # each a whole block of its own past the system's
    N = 20                                                     # the answers fill a block past the prompts
    e = _engine(executor, park=2)
    a = e.add_request(Request("a", a_prompt, N))
    _run(e)
    b = e.add_request(Request("b", b_prompt, N))
    _run(e)
    assert list(e._parked) == ["a", "b"]
    one = executor._host[e._parked["a"]].size
    held = sum(b.size for b in executor._host.values())
    executor.host_budget = held + one // 2      # a third state does not fit beside them
    try:
        again = e.add_request(ServeRequest("a2", a_prompt, N, banned=frozenset(a.output[:1])))
        _run(e)
        assert again.cached == len(a_prompt) // P * P and again.output[0] != a.output[0]
        assert list(e._parked) == ["b", "a2"] and executor.cells_used() == 0
        b2 = e.add_request(Request("b2", b_prompt, N))
        _run(e)
        assert b2.cached == len(b_prompt) // P * P and b2.output == b.output
    finally:
        executor.host_budget = None
