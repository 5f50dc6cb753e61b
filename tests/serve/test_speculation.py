"""Prompt-lookup drafts inside the serving engine's steps (serve --lookup).

On the real llama.cpp executor (embedded model, 1 thread, flash attention on,
per-slot KV streams, so a row is computed the same alone and in a batch) the
output with drafts equals plain decoding's token for token, greedy and seeded
sampling alike, while drafts are accepted and fewer steps are taken.  On the
simulator: drafts stay within the step's budget and the request's max_tokens,
rejected drafts leave no KV behind, and every block returns.
"""

from __future__ import annotations

import pytest

from localinfer.errors import UsageError
from localinfer.generation.sampling import SamplingParams
from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine
from localinfer.serve.request import FinishReason, Request
from localinfer.serve.scheduler import Scheduler, SchedulerConfig
from localinfer.serve.simulated import SimulatedExecutor
from localinfer.serve.speculation import Drafter
from localinfer.serve.step_model import LinearStepModel
from tests.support.drafts import run_engine

REPEAT = ("Copy the list exactly.\nList: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, "
          "lemon, mango.\nCopy: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon, mango.\n"
          "List: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon, mango.\nCopy:")


@pytest.fixture(scope="module")
def streams(default_model):
    pytest.importorskip("llama_cpp")
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=2, n_ctx=1024, threads=1, flash_attn=True,
                               unified=False) as ex:
        yield ex


def _run(ex, prompts, max_tokens, draft_max=0, sampling=None, step_model=None):
    for s in range(ex.n_slots):
        ex.drop(s)
    return run_engine(ex, BlockManager(ex.n_cells // 16, 16, pool_hits=False), prompts, max_tokens, draft_max,
                      sampling, step_model)


def test_greedy_output_with_drafts_equals_plain_decoding_in_fewer_steps(streams):
    tok = streams.engine.tokenize
    prompts = [tuple(tok(REPEAT, add_bos=True)), tuple(tok("def add(a, b):\n    return a + b\n\ndef add(", add_bos=True))]
    plain, plain_steps, _ = _run(streams, prompts, 40)
    spec, spec_steps, drafter = _run(streams, prompts, 40, draft_max=8)
    assert spec == plain
    assert drafter.accepted > 0 and drafter.rounds > 0 and drafter.accepted <= drafter.drafted
    assert spec_steps < plain_steps


def test_seeded_sampling_with_drafts_draws_the_same_tokens(streams):
    prompts = [tuple(streams.engine.tokenize(REPEAT, add_bos=True))]
    sampling = SamplingParams(temperature=0.7, top_k=40, seed=1234)
    plain, _, _ = _run(streams, prompts, 32, sampling=sampling)
    spec, _, drafter = _run(streams, prompts, 32, draft_max=6, sampling=sampling)
    assert spec == plain and drafter.drafted > 0


def test_a_cpu_step_model_that_makes_drafts_cost_their_tokens_drafts_less(streams):
    """The marginal rule over the step model: when m tokens cost m decode steps, drafting does not pay."""
    prompts = [tuple(streams.engine.tokenize(REPEAT, add_bos=True))]
    gpu = LinearStepModel(0.020, 0.00002, 0.0)        # verifying more tokens is nearly free
    cpu = LinearStepModel(0.0001, 0.010, 0.0)         # each token costs a whole decode
    _, _, cheap = _run(streams, prompts, 24, draft_max=8, step_model=gpu)
    _, _, dear = _run(streams, prompts, 24, draft_max=8, step_model=cpu)
    assert cheap.drafted > 0 and dear.drafted < cheap.drafted


# ---- the simulator: budget, room, trims, blocks ------------------------------------------------------------------

def _sim_engine(draft_max=4, token_budget=None, n_blocks=64):
    model = LinearStepModel(0.02, 0.00002, 0.0)
    config = SchedulerConfig(max_running=4, policy="chunked", chunk_tokens=32, token_budget=token_budget,
                             draft_max=draft_max)
    return StepEngine(SimulatedExecutor(model, n_slots=4), Scheduler(config, BlockManager(n_blocks, 16), model),
                  record=True)


def _lure(ex, i: int, n: int = 48) -> tuple[int, ...]:
    """A prompt whose first output token continues a bigram seen at its start (followed by 9s): the first
    decode step finds a draft of 9s, which the simulator's tokens do not follow."""
    body = tuple([5, 6, 7, 8] * (n // 4)) + (i,)
    first = ex.token_for(i, 6 + len(body))
    return (i, first, 9, 9, 9, 9) + body


def test_drafts_respect_the_budget_and_max_tokens_and_rejected_ones_are_dropped():
    e = _sim_engine(token_budget=10)
    reqs = [e.add_request(Request(f"s{i}", _lure(e.executor, i), 9)) for i in range(3)]
    while e.unfinished:
        e.step()
        assert sum(n for _, _, n in e.records[-1].chunks) <= 10
        assert e.executor.cells_used() == e.blocks.tokens_in_use()
    assert all(len(r.output) == 9 and r.finish_reason is FinishReason.LENGTH for r in reqs)
    d = e.scheduler.drafter
    assert d.drafted > 0 and d.accepted == 0
    assert e.blocks.used == 0 and e.executor.cells_used() == 0


def test_output_with_rejected_drafts_equals_plain_decoding_on_the_simulator():
    outs = []
    for draft_max in (0, 4):
        e = _sim_engine(draft_max=draft_max)
        rs = [e.add_request(Request(f"s{i}", _lure(e.executor, i), 12)) for i in range(3)]
        e.run()
        outs.append([r.output for r in rs])
    assert outs[0] == outs[1] and e.scheduler.drafter.drafted > 0


def test_every_way_a_request_ends_releases_its_lookup_state():
    """Cancels (a stop string, a client gone), errors and deadline drops go through the scheduler's one finish
    path: no request's LookupDecoder outlives it (before, cancel skipped the drafter and kept one each)."""
    e = _sim_engine(draft_max=4)
    reqs = [e.add_request(Request(f"s{i}", _lure(e.executor, i), 40)) for i in range(4)]
    for _ in range(4):
        e.step()
    d = e.scheduler.drafter
    assert d.drafted > 0 and set(d._decoders) == {r.id for r in reqs}
    e.cancel("s0")
    e.cancel("s1", error="engine loop error")
    e.run()
    assert all(r.finished for r in reqs) and d._decoders == {} and d._drafts == {}


def test_draft_flags_are_checked():
    with pytest.raises(UsageError, match="draft"):
        SchedulerConfig(draft_max=10_000)
    with pytest.raises(UsageError, match="draft"):
        Drafter(0)


def test_an_executor_that_returns_one_row_per_chunk_is_refused_for_drafts():
    class OneRow(SimulatedExecutor):
        verifies_drafts = False

    model = LinearStepModel(0.02, 0.0, 0.0)
    with pytest.raises(ValueError, match="verify lookup drafts"):
        StepEngine(OneRow(model), Scheduler(SchedulerConfig(draft_max=4), BlockManager(8, 16), model))


def test_steps_without_a_draft_to_size_ask_the_step_model_nothing_extra():
    """The cost curve of a draft is computed only when the proposer found one (most steps find none)."""
    calls = [0]

    class Counting(LinearStepModel):
        def seconds(self, chunks):
            calls[0] += 1
            return super().seconds(chunks)

    model = Counting(0.02, 0.00002, 0.0)
    counts = {}
    for draft_max in (0, 8):
        calls[0] = 0
        config = SchedulerConfig(max_running=4, policy="chunked", chunk_tokens=64, draft_max=draft_max)
        e = StepEngine(SimulatedExecutor(model, n_slots=4), Scheduler(config, BlockManager(64, 16), model))
        for i in range(4):       # prompts without a repeated n-gram, and the simulator's outputs repeat none either
            e.add_request(Request(f"n{i}", tuple(range(100 * i + 1, 100 * i + 40)), 12))
        e.run()
        counts[draft_max] = calls[0]
        assert draft_max == 0 or e.scheduler.drafter.drafted == 0
    assert counts[8] == counts[0]
    with pytest.raises(UsageError, match="1 to 32"):
        SchedulerConfig(draft_max=33)


def test_rejected_drafts_give_their_blocks_back_under_on_demand_admission():
    from localinfer.plan.paging import blocks_for

    model = LinearStepModel(0.02, 0.00002, 0.0)
    config = SchedulerConfig(max_running=4, policy="chunked", chunk_tokens=64, draft_max=8, admission="on_demand")
    ex = SimulatedExecutor(model, n_slots=4)
    e = StepEngine(ex, Scheduler(config, BlockManager(64, 4), model))
    reqs = [e.add_request(Request(f"s{i}", _lure(ex, i), 9)) for i in range(3)]
    while e.unfinished:
        e.step()
        for r in e.scheduler.running:
            if not r.prefilling:       # a decoding request holds the blocks of its tokens, none for dropped drafts
                assert len(e.blocks.tables[r.id]) == blocks_for(r.computed, 4)
    assert e.scheduler.drafter.drafted > 0 and all(len(r.output) == 9 for r in reqs) and e.blocks.used == 0
