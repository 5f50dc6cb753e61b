"""generate_batch(..., backend="torch") runs on the paged executor and equals each prompt alone through Runner
on the static-cache TorchEngine (embedded model, float32, CPU).

Batched float32 steps differ from a lone request's by ≤ ~5e-5 in the logits (see test_paged_executor.py),
far below the gaps between the top tokens here, so greedy and seeded-sampled texts must be equal.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from cuda_backend.engine import TorchEngine
from localinfer.backends.engine import LoadPlan
from localinfer.generation.runner import Runner
from localinfer.generation.sampling import SamplingParams
from localinfer.serve.batch import generate_batch

torch.set_num_threads(1)
PROMPTS = ["The capital of France is", "def add(a, b):", "Three colours:", "Water boils at", "Once upon a time"]
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def alone(default_model):
    eng = TorchEngine(LoadPlan(str(default_model), n_ctx=64, n_threads=1, device="cpu", type_k="f32", type_v="f32",
                               options={"quiet": True}))
    yield eng
    eng.close()


def _alone(engine, text, params, max_tokens):
    r = Runner(engine)
    r.reset()
    return r.generate(engine.tokenize(text, add_bos=True), params, max_tokens=max_tokens).text


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=5)], ids=["greedy", "seeded"])
def test_torch_batch_equals_each_prompt_alone(default_model, alone, params):
    want = [_alone(alone, p, params, 8) for p in PROMPTS]
    got = generate_batch(default_model, PROMPTS, max_tokens=8, sampling=params, parallel=3, backend="torch",
                         threads=1, type_k="f32", type_v="f32", n_gpu_layers=0, chunk=4)
    assert got == want and all(want)


def test_open_executor_allocates_what_fit_prints(tiny_models):
    from cuda_backend.memory import MEMORY
    from cuda_backend.serving import open_executor
    from localinfer.backends.memory import FitRequest
    from localinfer.devices.profiles import local_device

    req = FitRequest(n_ctx=100, n_seq=3, type_k="q8_0", type_v="f16", backend="torch")
    with open_executor(tiny_models["llama"], n_slots=3, n_ctx=100, type_k="q8_0", type_v="f16", device="cpu",
                       threads=1) as ex:
        bd, _ = MEMORY.breakdown(ex.spec, local_device(), req)
        assert ex.pool.num_blocks == 3 * 7 and ex.pool.nbytes == bd.kv and ex.graphs is None
        assert ex.slot_cells == 100 and ex.vocab.eos_ids


def test_open_plan_is_the_serving_plan_fit_checks(tiny_models):
    """serve --backend torch: n_seq slots sharing n_ctx positions; the pool is the KV fit counts for the plan,
    one request may hold all n_ctx positions."""
    from cuda_backend.serving import open_plan
    from localinfer.backends.engine import LoadPlan
    from localinfer.model.spec import ModelSpec
    from localinfer.plan.fit import check_load

    path = str(tiny_models["llama"])
    plan = LoadPlan(path, n_ctx=100, n_seq=3, n_gpu_layers=0, n_threads=1, type_k="q8_0", type_v="f16")
    fit = check_load(ModelSpec.from_gguf(path), plan, backend="torch")
    with open_plan(plan) as ex:
        assert ex.n_slots == 3 and ex.slot_cells == 100 and ex.pool.num_blocks == 3 * 3   # 3 × ⌈⌈100/3⌉/16⌉
        assert ex.pool.nbytes == fit.breakdown.kv and ex.device.type == "cpu"
        assert ex.vocab.n_vocab == ex.n_vocab and ex.vocab.token_text(ex.vocab.bos_id)


def test_run_batch_takes_the_executors_block_size_and_pool_hits(tiny_models):
    """run_batch builds its block manager with the executor's block size and, since the torch executor restores
    cached prefixes, takes hits from the pool: a prompt seen by a finished request is read, not recomputed."""
    from cuda_backend.serving import open_executor
    from localinfer.serve.batch import run_batch
    from tests.cuda_backend.test_paged_executor import prompts_for

    with open_executor(tiny_models["llama"], n_slots=1, n_ctx=96, device="cpu", threads=1, type_k="f32",
                       type_v="f32") as ex:
        prompt = prompts_for(ex.n_vocab, [40], seed=5)[0]
        before = ex.tokens_computed
        a, b = run_batch(ex, ex.vocab, [prompt, prompt], GREEDY, max_tokens=3, parallel=1, ignore_eos=True)
    assert a.tokens == b.tokens and a.cached_tokens == 0 and b.cached_tokens == 32
    assert ex.tokens_computed - before == 2 * (40 + 2) - 32
