"""A recurrent or hybrid model's state saved to host memory and restored (llama.cpp's partial sequence state): the
executor's ``snapshot``/``rewind``, a prefix shared by ``copy`` and completed by ``rewind``, a rejected lookup draft
rolled back, and the runner's chat turns and lookup drafts.  Logits must equal, bit for bit, those of the same
positions computed straight through (one thread: the same kernels over the same cells)."""

from __future__ import annotations

import numpy as np
import pytest

from localinfer.backends.executor import Chunk
from localinfer.model.kv import snapshot_bytes
from localinfer.model.spec import ModelSpec
from tests.support.ggufgen import write_tiny_arch
from tests.support.tiny_archs import TINY

pytest.importorskip("llama_cpp")

NAMES = ("qwen35", "qwen3next", "granitehybrid", "nemotron_h", "lfm2", "mamba2")
TOKENS = tuple(int(t) for t in np.random.default_rng(0).integers(3, 200, 40))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("recurrent")
    return {name: str(write_tiny_arch(root / f"{name}.gguf", TINY[name], seed=3)) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_rewind_copy_and_a_rejected_draft_give_the_logits_of_a_straight_run(name, models):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    ex = LlamaCppExecutor.open(models[name], n_slots=3, n_ctx=3 * 256, threads=1, quiet=True)
    try:
        caps = ex.caps
        assert caps.snapshots and caps.verifies_drafts and not caps.drops_tail and caps.state_bytes > 0
        ex.step([Chunk(0, TOKENS[:32], 0)])
        saved = ex.snapshot(0)
        assert saved.n_tokens == 32 and saved.nbytes == caps.state_bytes
        assert caps.state_bytes == snapshot_bytes(ModelSpec.from_gguf(models[name]))     # fit's figure, exactly
        straight = ex.step([Chunk(0, TOKENS[32:], 32, logits=True)])[0]
        ex.rewind(0, saved)                       # back to 32: the state restored, positions 32.. dropped
        assert ex.slot_len(0) == 32
        assert np.array_equal(ex.step([Chunk(0, TOKENS[32:], 32, logits=True)])[0], straight)
        ex.copy(0, 1, 32)                         # the attention cells of [0, 32), then the state at 32
        ex.rewind(1, saved)
        assert np.array_equal(ex.step([Chunk(1, TOKENS[32:], 32, logits=True)])[1], straight)
        ex.step([Chunk(2, TOKENS[:36], 0)])       # a verify of 4 tokens keeps 2: the state before it, 2 replayed
        ex.step([Chunk(2, TOKENS[36:40], 36, logits=True, n_logits=4)])
        ex.drop(2, 38)
        assert ex.slot_len(2) == 38
        assert np.array_equal(ex.step([Chunk(2, TOKENS[38:], 38, logits=True)])[2], straight)
        with pytest.raises(Exception, match="cannot drop"):
            ex.drop(2, 20)                        # no saved state there: a recurrent slot cannot be cut
    finally:
        ex.close()


@pytest.mark.parametrize("name", ["qwen35", "granitehybrid", "mamba2"])
def test_a_chat_turn_that_extends_the_last_restores_its_state_and_answers_as_a_cold_run(name, models):
    import localinfer
    from localinfer.generation.sampling import SamplingParams

    greedy = SamplingParams(temperature=0, greedy=True)
    first = list(TOKENS[:20])
    engine = localinfer.load(models[name], ctx=512, threads=1)
    try:
        runner = localinfer.Runner(engine)
        reply = [c.token for c in runner.stream(first, greedy, max_tokens=6) if c.token is not None]
        second = first + reply[:3] + [11, 22, 33]       # the next turn repeats part of the reply, then goes on
        chunks = list(runner.stream(second, greedy, max_tokens=8))
        warm = [c.token for c in chunks if c.token is not None]
        assert chunks[-1].timings.cached_tokens == len(first)     # back to the first prompt's end, not to 0
    finally:
        engine.close()
    cold_engine = localinfer.load(models[name], ctx=512, threads=1)
    try:
        cold = [c.token for c in localinfer.Runner(cold_engine).stream(second, greedy, max_tokens=8)
                if c.token is not None]
    finally:
        cold_engine.close()
    assert warm == cold and warm


@pytest.mark.parametrize("name", ["qwen35", "granitehybrid"])
def test_runner_lookup_on_a_recurrent_model_gives_plain_greedy_tokens(name, models):
    import localinfer
    from localinfer.generation.lookup import LookupDecoder
    from localinfer.generation.sampling import SamplingParams

    greedy = SamplingParams(temperature=0, greedy=True)
    prompt = list(TOKENS[:12]) * 4
    engine = localinfer.load(models[name], ctx=512, threads=1)
    try:
        runner = localinfer.Runner(engine)
        plain = [c.token for c in runner.stream(prompt, greedy, max_tokens=40) if c.token is not None]
        runner.reset()
        decoder = LookupDecoder(draft_max=6)
        drafted = [c.token for c in runner.stream(prompt, greedy, max_tokens=40, decoder=decoder)
                   if c.token is not None]
    finally:
        engine.close()
    assert drafted == plain
    assert decoder.stats.drafted > 0


def test_prompts_that_part_after_a_system_prompt_save_the_state_there(models):
    """A chat whose turns leave the cached conversation at one point (a context shift keeps the system prompt and
    drops the oldest turns; an edited first message): the first time that point is recomputed and its state saved,
    the next time it is restored."""
    import localinfer
    from localinfer.generation.sampling import SamplingParams

    greedy = SamplingParams(temperature=0, greedy=True)
    system = list(TOKENS[:30])
    prompts = [system + [50 + i] * 12 for i in range(3)]
    engine = localinfer.load(models["granitehybrid"], ctx=512, threads=1)
    try:
        runner = localinfer.Runner(engine)
        cached, outputs = [], []
        for p in prompts:
            chunks = list(runner.stream(p, greedy, max_tokens=4))
            cached.append(chunks[-1].timings.cached_tokens)
            outputs.append([c.token for c in chunks if c.token is not None])
    finally:
        engine.close()
    assert cached == [0, 0, len(system)]
    cold_engine = localinfer.load(models["granitehybrid"], ctx=512, threads=1)
    try:
        cold = [c.token for c in localinfer.Runner(cold_engine).stream(prompts[2], greedy, max_tokens=4)
                if c.token is not None]
    finally:
        cold_engine.close()
    assert outputs[2] == cold


@pytest.mark.parametrize("name", ["qwen35", "granitehybrid"])
def test_a_step_that_fails_halfway_leaves_no_cells_behind_once_rewound(name, models):
    """llama.cpp cannot cut a recurrent state back: a step that fails after its first llama_decode (a 64-token
    chunk in two calls of 32; the second made to fail) leaves the slot refusing new chunks until it is rewound or
    dropped; the rewind frees every cell past the saved state, and the next logits equal a straight run's."""
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    long = tuple(int(t) for t in np.random.default_rng(1).integers(3, 200, 64))
    ex = LlamaCppExecutor.open(models[name], n_slots=2, n_ctx=2 * 256, threads=1, n_batch=32, n_ubatch=32,
                               quiet=True)
    try:
        ex.step([Chunk(0, TOKENS[:32], 0)])
        saved = ex.snapshot(0)
        straight = ex.step([Chunk(0, TOKENS[32:], 32, logits=True)])[0]
        ex.rewind(0, saved)
        decode, calls = ex._decode, []

        def second_fails(rows, **kw):        # a fault after the first call has written its positions
            calls.append(len(rows))
            if len(calls) == 2:
                raise RuntimeError("injected fault")
            return decode(rows, **kw)

        ex._decode = second_fails
        with pytest.raises(RuntimeError, match="injected"):
            ex.step([Chunk(0, long, 32)])
        ex._decode = decode
        assert calls == [32, 32]
        with pytest.raises(ValueError, match="rewind or drop"):
            ex.step([Chunk(0, TOKENS[32:], 32, logits=True)])
        ex.rewind(0, saved)
        assert ex.cells_used() == 32 and ex.slot_len(0) == 32
        assert np.array_equal(ex.step([Chunk(0, TOKENS[32:], 32, logits=True)])[0], straight)
    finally:
        ex.close()
