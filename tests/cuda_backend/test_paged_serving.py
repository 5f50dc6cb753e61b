"""The paged executor under the serving engine: block tables from the block manager (prefix hits from the pool,
copy-on-write inferred from the tables), the step engine's batching, prefix copies and preemption + recompute.

Outputs are compared as greedy tokens with the static engine run one request at a time; logits with the
tolerance of test_paged_executor.py (batched float32 matmuls sum in another order: measured ≤ 1.1e-6 here).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from cuda_backend.paged_executor import PagedExecutor
from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine
from localinfer.backends.executor import Chunk, Executor
from localinfer.serve.request import Request
from localinfer.serve.scheduler import Scheduler, SchedulerConfig
from tests.cuda_backend.test_paged_executor import ATOL_F32, alone, prompts_for, static_engine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def eng(tiny_models):
    e = static_engine(tiny_models["qwen3"])
    yield e
    e.close()


def last_row(eng, tokens):
    eng.trim(0)
    return eng.eval(tokens, logits_at=[len(tokens) - 1])[0]


def test_is_an_executor(eng):
    ex = PagedExecutor(eng.model, n_slots=2, num_blocks=4, type_k="f32", type_v="f32")
    assert isinstance(ex, Executor) and not ex.restores_cached_prefix and ex.n_cells == 64


def test_block_tables_from_the_block_manager(eng):
    bm = BlockManager(12, 16, pool_hits=True)
    ex = PagedExecutor(eng.model, n_slots=3, num_blocks=12, type_k="f32", type_v="f32", external_blocks=True)
    assert ex.restores_cached_prefix
    a = prompts_for(eng.n_vocab, [40], seed=7)[0]
    bm.allocate("a", a)
    ex.step([Chunk(0, tuple(a), 0, True, blocks=tuple(bm.tables["a"]))])
    bm.commit("a", a)
    bm.free("a")                          # a finishes; its two whole blocks stay cached in the pool
    ex.drop(0)
    b = a[:32] + [5, 6, 7]
    assert bm.allocate("b", b) == 32
    before = ex.tokens_computed
    out = ex.step([Chunk(1, tuple(b[32:]), 32, True, blocks=tuple(bm.tables["b"]))])
    assert ex.tokens_computed - before == 3               # the cached prefix is read, not recomputed
    assert np.abs(out[1] - last_row(eng, b)).max() <= ATOL_F32
    bm.commit("b", b)
    bm.fork("b", "c")                                      # c shares b's blocks, the partial tail too
    ex.copy(1, 2, len(b))
    copies = bm.grow("c", len(b) + 1)
    assert len(copies) == 1 and copies[0].n_tokens == 3     # c's tail is copied before c writes to it
    bm.grow("b", len(b) + 1)
    out = ex.step([Chunk(2, (9,), len(b), True, blocks=tuple(bm.tables["c"])),
                   Chunk(1, (11,), len(b), True, blocks=tuple(bm.tables["b"]))])
    assert np.abs(out[2] - last_row(eng, b + [9])).max() <= ATOL_F32
    assert np.abs(out[1] - last_row(eng, b + [11])).max() <= ATOL_F32
    bm.commit("b", b + [11])
    bm.commit("c", b + [9])
    assert ex.cells_used() == bm.tokens_in_use()
    with pytest.raises(ValueError, match="0 blocks of 16 tokens"):
        ex.step([Chunk(0, (1,), 0, True)])


def engine_for(eng, n_blocks, max_running=4, admission="reserve", **kw):
    ex = PagedExecutor(eng.model, n_slots=max_running, num_blocks=n_blocks, type_k="f32", type_v="f32", **kw)
    sched = Scheduler(SchedulerConfig(max_running=max_running, admission=admission, policy="chunked",
                                      chunk_tokens=24), BlockManager(n_blocks, 16, pool_hits=False))
    return StepEngine(ex, sched), ex


def greedy_alone(eng, prompt, n):
    return [int(np.argmax(r)) for r in alone(eng, prompt, n - 1)]


def run_checking_cells(e, ex):
    while e.unfinished:
        e.step()
        assert ex.cells_used() == e.blocks.tokens_in_use()


def test_engine_batches_equal_alone_and_survive_preemption(eng):
    prompts = prompts_for(eng.n_vocab, [30, 12, 41, 20], seed=8)
    want = [greedy_alone(eng, p, 6) for p in prompts]
    e, ex = engine_for(eng, 40)
    reqs = [e.add_request(Request(f"r{i}", p, 6)) for i, p in enumerate(prompts)]
    run_checking_cells(e, ex)
    assert [r.output for r in reqs] == want
    small, ex = engine_for(eng, 7, admission="on_demand")     # 112 token slots for 4 x ~30: preempts
    reqs = [small.add_request(Request(f"r{i}", p, 6)) for i, p in enumerate(prompts)]
    run_checking_cells(small, ex)
    assert [r.output for r in reqs] == want
    assert sum(r.preemptions for r in reqs) > 0 and sum(r.recomputed for r in reqs) > 0
    assert ex.cells_used() == 0 and ex.alloc.num_free == 7


def test_engine_prefix_hit_is_a_copy(eng):
    shared = prompts_for(eng.n_vocab, [32], seed=9)[0]
    p1, p2 = shared + [3, 4, 5], shared + [8, 9]
    e, ex = engine_for(eng, 20)
    r1 = e.add_request(Request("a", p1, 4))
    e.step()
    e.step()                                               # a's prompt in two chunks of <= 24: 2 blocks hashed
    before = ex.tokens_computed
    r2 = e.add_request(Request("b", p2, 4))
    run_checking_cells(e, ex)
    assert r2.cached == 32
    assert ex.tokens_computed - before == 2 + 3 + 3          # b: 2 prompt tokens + 3 decodes; a: 3 decodes
    assert r1.output == greedy_alone(eng, p1, 4) and r2.output == greedy_alone(eng, p2, 4)


def test_engine_with_block_tables_from_the_block_manager(eng):
    """Pool prefix hits (the first request has finished), preemption + recompute, one block source."""
    shared = prompts_for(eng.n_vocab, [36], seed=10)[0]
    prompts = [shared + [3, 4], shared[:20] + [5] * 9, shared + [6], prompts_for(eng.n_vocab, [25], seed=11)[0]]
    want = [greedy_alone(eng, p, 5) for p in prompts]
    for n_blocks, admission in ((30, "reserve"), (6, "on_demand")):
        ex = PagedExecutor(eng.model, n_slots=3, num_blocks=n_blocks, type_k="f32", type_v="f32", external_blocks=True)
        sched = Scheduler(SchedulerConfig(max_running=3, admission=admission),
                          BlockManager(n_blocks, 16, pool_hits=True))
        e = StepEngine(ex, sched)          # every chunk carries its request's table from the block manager
        first = e.add_request(Request("r0", prompts[0], 5))
        run_checking_cells(e, ex)                           # r0 finishes; its two whole blocks stay cached
        reqs = [first] + [e.add_request(Request(f"r{i}", p, 5)) for i, p in enumerate(prompts[1:], 1)]
        before = ex.tokens_computed
        run_checking_cells(e, ex)
        assert [r.output for r in reqs] == want
        assert reqs[2].cached == 32 or reqs[2].preemptions      # read from the pool, not recomputed
        if admission == "on_demand":         # r3 is preempted; back, its first block is read from the pool
            assert reqs[3].preemptions == 1 and reqs[3].cached == 16
        else:
            assert ex.tokens_computed - before == sum(len(p) for p in prompts[1:]) - 32 - 16 + 3 * 4


_ALONE: dict[tuple[int, ...], list[int]] = {}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 6), st.integers(0, 12)),
                min_size=1, max_size=6),
       st.sampled_from(["reserve", "on_demand"]), st.booleans(), st.integers(6, 12))
def test_random_requests_and_cancels(eng, specs, admission, external, n_blocks):
    """Requests from three prefix families, some cancelled at a random step: after every step the pool's
    cells equal the block manager's tokens, at the end nothing is held, and every reply that ran to its end
    equals the request alone."""
    family = prompts_for(eng.n_vocab, [40, 40, 40], seed=12)
    inner = PagedExecutor(eng.model, n_slots=3, num_blocks=n_blocks, type_k="f32", type_v="f32",
                          external_blocks=external)
    e = StepEngine(inner, Scheduler(SchedulerConfig(max_running=3, admission=admission, policy="chunked",
                                                chunk_tokens=16), BlockManager(n_blocks, 16, pool_hits=external)))
    reqs, cancel_at = [], {}
    for i, (f, n, out, at) in enumerate(specs):
        reqs.append(e.add_request(Request(f"r{i}", family[f][:n] + [i + 1], out)))
        cancel_at[f"r{i}"] = at if at % 3 == 0 else None
    step = 0
    while e.unfinished:
        e.step()
        step += 1
        for rid, at in cancel_at.items():
            if at == step:
                e.cancel(rid)
        assert inner.cells_used() == e.blocks.tokens_in_use()
    assert inner.cells_used() == 0 and all(not t for t in inner.tables)
    assert external or inner.alloc.num_free == n_blocks
    for r in reqs:
        if r.finish_reason is not None and r.finish_reason.name == "LENGTH":
            key = (*r.prompt, r.max_tokens)
            if key not in _ALONE:
                _ALONE[key] = greedy_alone(eng, list(r.prompt), r.max_tokens)
            assert r.output == _ALONE[key]
