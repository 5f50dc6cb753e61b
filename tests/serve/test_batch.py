"""Batch generation equals each prompt run alone through Runner (embedded model, 1 thread, flash attention on).

At one thread with flash attention llama.cpp computes each row of a batch bit
for bit as alone (tests/backends/test_llamacpp_executor.py), so the texts must be
equal, greedy or sampled with the same seed, whatever the slots' interleaving.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localinfer.backends.engine import LoadPlan
from localinfer.generation.runner import Runner
from localinfer.generation.sampling import SamplingParams

pytest.importorskip("llama_cpp")

PROMPTS = ["The capital of France is", "def add(a, b):", "Three colours:", "Water boils at",
           "Once upon a time"]
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def executor(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=3, n_ctx=768, threads=1, flash_attn=True, unified=False) as ex:
        yield ex


@pytest.fixture(scope="module")
def alone(default_model):
    from localinfer.backends.llamacpp.engine import LlamaCppEngine

    with LlamaCppEngine(LoadPlan(str(default_model), n_ctx=256, n_threads=1, flash_attn=True)) as eng:
        yield eng


def _prompts(engine, texts=PROMPTS):
    return [engine.tokenize(t, add_bos=True) for t in texts]


def _runner(engine, prompt, params=GREEDY, **kw):
    r = Runner(engine)
    r.reset()
    return r.generate(prompt, params, **kw)


def _batch(executor, prompts, params=GREEDY, **kw):
    from localinfer.serve.batch import run_batch

    out = run_batch(executor, executor.engine, prompts, params, **kw)
    assert executor.cells_used() == 0                     # every slot dropped at the end
    return out


def test_greedy_batch_with_refill_equals_each_prompt_alone(executor, alone):
    prompts = _prompts(alone)
    got = _batch(executor, prompts, max_tokens=12, parallel=3)          # 5 prompts, 3 slots: two refills
    for p, r in zip(prompts, got):
        want = _runner(alone, p, max_tokens=12)
        assert (r.text, r.tokens, r.finish_reason) == (want.text, want.tokens, want.finish_reason)
        assert len(r.token_times) == len(r.tokens) and r.ttft_s > 0


def test_chunked_prefill_early_stops_and_a_prefix_copy_equal_each_prompt_alone(executor, alone, default_model):
    from localinfer.model.spec import ModelSpec
    from localinfer.model.templates import template_for

    tpl = template_for(ModelSpec.from_gguf(default_model))
    prompts = [tpl.tokens(alone, [{"role": "user", "content": q}]) for q in ("Say hi.", "What is 2+2?", "Name a fruit.")]
    copies = []
    copy = executor.copy
    executor.copy = lambda *a: (copies.append(a), copy(*a))
    try:
        got = _batch(executor, prompts, max_tokens=40, parallel=2, chunk=7)
    finally:
        del executor.copy
    assert [r.finish_reason for r in got[:2]] == ["stop", "stop"]   # "2+2" ends first and frees its slot
    # the second waits for the first's template block (not yet computed when both arrive), the third comes later:
    # both copy it instead of computing it again
    assert [(src, n) for src, _dst, n in copies] == [(0, 16), (0, 16)]
    for p, r in zip(prompts, got):
        want = _runner(alone, p, max_tokens=40)
        assert (r.text, r.tokens, r.finish_reason) == (want.text, want.tokens, want.finish_reason)


def test_sampled_requests_with_one_seed_equal_each_alone(executor, alone):
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    prompts = _prompts(alone)[:3]
    got = _batch(executor, prompts, params, max_tokens=10)
    for p, r in zip(prompts, got):
        assert r.tokens == _runner(alone, p, params, max_tokens=10).tokens


def test_stop_strings_and_the_request_context_end_replies_as_runner_does(executor, alone, default_model):
    from localinfer.backends.llamacpp.engine import LlamaCppEngine

    prompts = _prompts(alone)[:3]
    got = _batch(executor, prompts, max_tokens=16, stop=["\n", " a"])
    for p, r in zip(prompts, got):
        want = _runner(alone, p, max_tokens=16, stop=["\n", " a"])
        assert (r.text, r.finish_reason) == (want.text, want.finish_reason)
    with LlamaCppEngine(LoadPlan(str(default_model), n_ctx=12, n_threads=1, flash_attn=True)) as small:
        want = _runner(small, prompts[0], max_tokens=30)
    r = _batch(executor, prompts[:1], max_tokens=30, ctx=12)[0]
    assert (r.text, r.finish_reason) == (want.text, want.finish_reason) == (r.text, "length")
    assert len(r.tokens) == 12 - len(prompts[0]) + 1


def test_generate_batch_end_to_end(default_model, alone):
    from localinfer.serve.batch import generate_batch

    texts = generate_batch(default_model, PROMPTS[:3], max_tokens=8, temperature=0, parallel=2, threads=1)
    assert texts == [_runner(alone, p, max_tokens=8).text for p in _prompts(alone)[:3]]
    assert generate_batch(default_model, [], max_tokens=8) == []


def test_bad_arguments_are_usage_errors(executor, default_model):
    from localinfer.errors import ContextFullError, UsageError
    from localinfer.serve.batch import generate_batch, run_batch

    with pytest.raises(UsageError):
        generate_batch(default_model, ["x"], parallel=0)
    with pytest.raises(UsageError):
        generate_batch(default_model, ["x"], backend="mlx")
    with pytest.raises(UsageError):
        run_batch(executor, executor.engine, [[1, 2]], ctx=1000)                # 3 x 1000 > 768 cells
    with pytest.raises(ContextFullError):
        run_batch(executor, executor.engine, [list(range(300))], parallel=3)   # 256 positions per request
    with pytest.raises(UsageError):
        run_batch(executor, executor.engine, [[]])


def test_preempted_and_recomputed_requests_give_the_same_replies(executor, alone):
    prompts = _prompts(alone)[:3]
    got = _batch(executor, prompts, max_tokens=20, parallel=3, admission="on_demand", kv_blocks=6, chunk=16,
                 block_tokens=8)                      # 48 cells for three requests of ~26: someone is preempted
    assert sum(r.preemptions for r in got) > 0 and sum(r.recomputed_tokens for r in got) > 0
    for p, r in zip(prompts, got):
        assert r.tokens == _runner(alone, p, max_tokens=20).tokens


# ---- the step engine on a unified llama.cpp cache: its cells are the block manager's ----------------

@pytest.fixture(scope="module")
def unified(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=3, n_ctx=256, threads=1) as ex:
        yield ex


SYSTEM = tuple(range(500, 516))                        # four whole blocks of 4 that most prompts start with


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "step", "cancel"]), st.integers(0, 7),
                          st.integers(1, 12)), min_size=1, max_size=24),
       st.sampled_from(["reserve", "on_demand"]))
def test_random_add_step_cancel_keeps_llama_cpp_cells_equal_to_the_blocks(unified, ops, admission):
    from localinfer.serve.block_manager import BlockManager
    from localinfer.serve.engine import StepEngine
    from localinfer.serve.request import Request
    from localinfer.serve.scheduler import Scheduler, SchedulerConfig

    blocks = BlockManager(10, 4, pool_hits=False)        # 40 of the 256 cells: on_demand preempts
    eng = StepEngine(unified, Scheduler(SchedulerConfig(max_running=3, admission=admission), blocks))
    now = unified.clock()
    ids = []
    for op, k, n in ops:
        if op == "add":
            rid = f"r{len(ids)}"
            prompt = SYSTEM + tuple(range(1000 + 7 * k, 1003 + 8 * k)) if k < 6 else tuple(range(2000, 2002 + k))
            eng.add_request(Request(rid, prompt, n, arrival_s=now))
            ids.append(rid)
        elif op == "cancel" and ids:
            eng.cancel(ids[k % len(ids)])
        elif eng.unfinished:
            eng.step()
        assert unified.cells_used() == blocks.tokens_in_use()
    while eng.unfinished:
        eng.step()
        assert unified.cells_used() == blocks.tokens_in_use()
    assert blocks.used == 0 and unified.cells_used() == 0


def test_long_prompts_equal_each_alone_when_both_sides_run_ubatches_under_64(default_model):
    """Prompts of 64+ tokens prefilled together take the one-row attention kernel only if every ubatch
    stays under 64 rows; with n_ubatch 32 on both sides the batch equals each prompt alone."""
    from localinfer.backends.llamacpp.engine import LlamaCppEngine
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    text = "The quick brown fox jumps over the lazy dog near the river bank. "
    with LlamaCppEngine(LoadPlan(str(default_model), n_ctx=256, n_threads=1, flash_attn=True, n_ubatch=32)) as eng:
        prompts = [eng.tokenize(text * k + q, add_bos=True) for k, q in ((6, "Then"), (5, "Why"), (1, "So"))]
        assert min(len(p) for p in prompts[:2]) >= 64
        want = [_runner(eng, p, max_tokens=8).tokens for p in prompts]
    with LlamaCppExecutor.open(default_model, n_slots=3, n_ctx=768, threads=1, unified=False, n_ubatch=32) as ex:
        assert [r.tokens for r in _batch(ex, prompts, max_tokens=8)] == want
