"""Grammar state in the step engine on real llama.cpp (embedded model): preemption and recompute, prompt-lookup
drafts, seeds.  A constrained greedy reply is the same tokens whatever happens to its KV, and always valid."""

from __future__ import annotations

import json

import pytest

from localinfer.generation.sampling import SamplingParams
from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine
from localinfer.serve.request import GREEDY, FinishReason
from localinfer.serve.scheduler import Scheduler, SchedulerConfig

pytest.importorskip("llama_cpp")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"fruits": {"type": "array", "minItems": 3, "maxItems": 6,
                                                      "items": {"enum": ["apple", "banana", "cherry", "damson",
                                                                         "elderberry", "fig", "grape"]}},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["fruits", "count"], "additionalProperties": False}
COPY = ('Copy the JSON exactly.\nJSON: {"fruits": ["apple", "banana", "cherry", "damson", "fig"], "count": 5}\n'
        'Copy: {"fruits": ["apple", "banana", "cherry", "damson", "fig"], "count": 5}\n'
        'JSON: {"fruits": ["apple", "banana", "cherry", "damson", "fig"], "count": 5}\nCopy: ')


@pytest.fixture(scope="module")
def executor(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=4, n_ctx=2048, threads=1, flash_attn=True,
                               unified=False) as ex:
        yield ex


def _run(ex, prompts, *, blocks=120, draft_max=0, sampling=GREEDY, max_tokens=60, overlap=True):
    from localinfer.generation.constraints import Constraint, grammar_from, grammar_tokenizer
    from localinfer.serve.http.sampler import ServeRequest

    for slot in range(ex.n_slots):
        ex.drop(slot)
    grammar = grammar_from("json_schema", SCHEMA, "schema")
    tok = grammar_tokenizer(ex.engine)
    config = SchedulerConfig(max_running=4, policy="chunked", chunk_tokens=32, draft_max=draft_max,
                             admission="on_demand")
    e = StepEngine(ex, Scheduler(config, BlockManager(blocks, 16, pool_hits=False)), overlap_masks=overlap)
    reqs = [e.add_request(ServeRequest(f"r{i}", p, max_tokens, sampling=sampling, stop_tokens=ex.engine.eos_ids,
                                       constraint=Constraint(tok, grammar))) for i, p in enumerate(prompts)]
    for _ in range(2000):
        if not e.unfinished:
            break
        e.step()
    return e, reqs


def _text(ex, r) -> str:
    return b"".join(ex.engine.token_bytes(t) for t in r.output).decode()


def test_preempted_requests_keep_their_grammar(executor):
    tok = executor.engine.tokenize
    prompts = [tuple(tok(f"List {k} fruits as JSON with a count. ", add_bos=True)) for k in (3, 4, 5, 6)]
    alone = [_text(executor, _run(executor, [p])[1][0]) for p in prompts]
    _, reqs = _run(executor, prompts, blocks=8)         # too few blocks for all four: the newest are preempted
    assert sum(r.preemptions for r in reqs) > 0
    for r, want in zip(reqs, alone):
        assert r.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(_text(executor, r)), SCHEMA)
        assert _text(executor, r) == want


def test_lookup_drafts_are_cut_to_the_grammar_and_change_nothing(executor):
    prompt = tuple(executor.engine.tokenize(COPY, add_bos=True))
    plain = _run(executor, [prompt])[1][0]
    e, (drafted,) = _run(executor, [prompt], draft_max=6)
    assert e.scheduler.drafter.accepted > 0
    assert drafted.output == plain.output and drafted.finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(_text(executor, drafted)), SCHEMA)


def test_seeded_sampling_is_valid_and_repeatable(executor):
    tok = executor.engine.tokenize
    prompts = [tuple(tok("Some fruits as JSON: ", add_bos=True))] * 3
    runs = []
    for _ in range(2):
        _, reqs = _run(executor, prompts, sampling=SamplingParams(temperature=1.0, seed=11), max_tokens=80)
        runs.append([_text(executor, r) for r in reqs])
        for r in reqs:
            assert r.finish_reason is FinishReason.STOP
            jsonschema.validate(json.loads(_text(executor, r)), SCHEMA)
    assert runs[0] == runs[1]


def test_masks_filled_beside_the_forward_pass_or_after_it_draw_the_same_tokens(executor):
    tok = executor.engine.tokenize
    prompts = [tuple(tok(f"List {k} fruits as JSON with a count. ", add_bos=True)) for k in (3, 4, 5, 6)]
    sampling = SamplingParams(temperature=0.8, seed=5)
    beside = _run(executor, prompts, sampling=sampling)[1]
    after = _run(executor, prompts, sampling=sampling, overlap=False)[1]
    assert [r.output for r in beside] == [r.output for r in after]
    for r in beside:
        jsonschema.validate(json.loads(_text(executor, r)), SCHEMA)
