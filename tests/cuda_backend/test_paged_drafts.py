"""Draft verification on the torch serving executor (``Chunk.n_logits``, ``verifies_drafts``).

A chunk asking for its last n rows gets them as an ``[n, n_vocab]`` array equal to the rows of the same tokens
appended one step at a time (float32; ATOL_F32 of test_paged_executor.py: a k-token chunk multiplies [k, E] where
one-token steps multiply [1, E], another summation order), on the varlen path and with the padded (CUDA-graph)
decode path on, since a draft chunk has several tokens.  Under the serving engine, prompt-lookup drafts
(``SchedulerConfig.draft_max``) on this executor give the greedy output of plain decoding (embedded model,
f32 KV, CPU), with drafts accepted and fewer steps: tests/serve/test_speculation.py's check on llama.cpp.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from cuda_backend.paged_executor import PagedExecutor
from cuda_backend.serving import BLOCK_TOKENS, open_executor
from localinfer.backends.executor import Chunk
from localinfer.serve.block_manager import BlockManager
from tests.cuda_backend.test_paged_executor import ATOL_F32, prompts_for, static_engine
from tests.serve.test_speculation import REPEAT
from tests.support.drafts import run_engine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    eng = static_engine(tiny_models["qwen3"])
    yield eng
    eng.close()


def one_at_a_time(ex, slot, prompt, tokens):
    """Rows of each token in ``tokens`` appended one step at a time after ``prompt``."""
    ex.step([Chunk(slot, tuple(prompt), 0, False)])
    return np.stack([ex.step([Chunk(slot, (t,), len(prompt) + i, True)])[slot] for i, t in enumerate(tokens)])


@pytest.mark.parametrize("padded", [False, True], ids=["varlen", "padded-decode"])
def test_last_n_rows_equal_one_token_steps(tiny, padded):
    prompt, other = prompts_for(tiny.n_vocab, [21, 9], seed=31)
    draft = prompts_for(tiny.n_vocab, [5], seed=32)[0]
    ref_ex = PagedExecutor(tiny.model, n_slots=1, num_blocks=8, type_k="f32", type_v="f32")
    want = one_at_a_time(ref_ex, 0, prompt, draft)
    ex = PagedExecutor(tiny.model, n_slots=4, num_blocks=16, type_k="f32", type_v="f32", padded_decode=padded)
    assert ex.verifies_drafts
    ex.step([Chunk(0, tuple(prompt), 0, False), Chunk(1, tuple(other), 0, True)])
    out = ex.step([Chunk(1, (3,), len(other), True),                  # a decode beside the draft chunk
                   Chunk(0, tuple(draft), len(prompt), True, n_logits=5),
                   Chunk(2, (7, 8, 9), 0, True)])                       # and a one-row prefill
    assert out[0].shape == (5, tiny.n_vocab) and out[0].dtype == np.float32
    assert np.abs(out[0] - want).max() <= ATOL_F32 and (out[0].argmax(-1) == want.argmax(-1)).all()
    assert out[1].shape == out[2].shape == (tiny.n_vocab,)
    two = ex.step([Chunk(0, (4, 5), len(prompt) + 5, True, n_logits=2)])[0]     # n_logits < the chunk's tokens
    fresh = PagedExecutor(tiny.model, n_slots=1, num_blocks=8, type_k="f32", type_v="f32")
    assert two.shape == (2, tiny.n_vocab)
    assert np.abs(two - one_at_a_time(fresh, 0, prompt + draft, [4, 5])).max() <= ATOL_F32
    decode = ex.step([Chunk(1, (6,), len(other) + 1, True), Chunk(2, (1,), 3, True)])   # one-token steps:
    assert decode[1].shape == (tiny.n_vocab,) and (ex.graphs is not None) == padded      # the padded path
    assert not padded or ex.graphs.host_copies == 1          # only that step replayed the graph path
    ex.max_mask_elements = 60          # split into forwards: rows still arrive in chunk order
    ex.drop(0, len(prompt))
    split = ex.step([Chunk(3, tuple(other), 0, True, n_logits=3), Chunk(0, tuple(draft), len(prompt), True,
                                                                          n_logits=4)])
    assert ex.forwards > ex.steps and split[3].shape == (3, tiny.n_vocab)
    assert np.abs(split[0] - want[1:]).max() <= ATOL_F32


@pytest.fixture(scope="module")
def embedded(default_model):
    with open_executor(default_model, n_slots=2, n_ctx=512, device="cpu", threads=1, type_k="f32",
                       type_v="f32") as ex:
        yield ex


def _run(ex, prompts, max_tokens, draft_max=0):
    return run_engine(ex, BlockManager(ex.pool.num_blocks, BLOCK_TOKENS, pool_hits=ex.restores_cached_prefix),
                      prompts, max_tokens, draft_max)


def test_engine_with_drafts_equals_plain_greedy_decoding(embedded):
    tok = embedded.vocab.tokenize
    prompts = [tuple(tok(REPEAT, add_bos=True)), tuple(tok("def add(a, b):\n    return a + b\n\ndef add(", add_bos=True))]
    plain, plain_steps, _ = _run(embedded, prompts, 24)
    spec, spec_steps, drafter = _run(embedded, prompts, 24, draft_max=8)
    assert spec == plain
    assert drafter.accepted > 0 and drafter.accepted <= drafter.drafted
    assert spec_steps < plain_steps
