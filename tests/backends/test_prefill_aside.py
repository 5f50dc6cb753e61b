"""A lone prompt beside running sequences is computed in a context of its own and copied in
(backends/llamacpp/aside.py; serve's plan asks for it unless LOCALINFER_PREFILL_ASIDE=0), and the request gets what
it would alone: the prompt's logits and the greedy tokens after it, bit for bit at one thread with flash attention
on."""

import random

import numpy as np
import pytest

from localinfer.backends.executor import Chunk
from localinfer.backends.llamacpp.executor import LlamaCppExecutor
from localinfer.model.sources import resolve_model

STEPS = 6


def _open(monkeypatch, aside: bool) -> LlamaCppExecutor:
    """The executor as serve opens it (the plan's option ``prefill_aside``), or without the second context."""
    return LlamaCppExecutor.open(str(resolve_model(None)), n_slots=4, n_ctx=2048, threads=1, flash_attn=True,
                                 prefill_aside=aside)


def _greedy(x: LlamaCppExecutor, slot: int, prompt: tuple[int, ...], others: dict[int, int]) -> tuple:
    """Prefill ``prompt`` into ``slot`` beside one-row decodes of ``others`` (slot -> length), then STEPS greedy
    steps of slot and the others together; (the prompt's logits row, the slot's tokens)."""
    got = x.step([Chunk(slot, prompt, 0, logits=True)] + [Chunk(s, (7,), n, logits=True) for s, n in others.items()])
    first = np.array(got[slot])
    others = {s: n + 1 for s, n in others.items()}
    toks, n = [int(first.argmax())], len(prompt)
    for _ in range(STEPS):
        got = x.step([Chunk(slot, (toks[-1],), n, logits=True)]
                     + [Chunk(s, (9,), m, logits=True) for s, m in others.items()])
        others = {s: m + 1 for s, m in others.items()}
        n += 1
        toks.append(int(np.asarray(got[slot]).argmax()))
    return first, toks


@pytest.mark.parametrize("length", [64, 300])
def test_a_prompt_beside_running_sequences_gets_its_solo_result(monkeypatch, length):
    rng = random.Random(length)
    prompt = tuple(rng.randrange(100, 40000) for _ in range(length))
    with _open(monkeypatch, aside=False) as solo:
        alone, alone_toks = _greedy(solo, 0, prompt, {})
    with _open(monkeypatch, aside=True) as x:
        for s in (1, 2):             # two running sequences first, in place (nothing else holds cells for the first)
            x.step([Chunk(s, tuple(rng.randrange(100, 40000) for _ in range(200)), 0, logits=True)])
        assert x._aside is not None and x._aside.prompts == 1
        used = x.cells_used()
        beside, beside_toks = _greedy(x, 3, prompt, {1: 200, 2: 200})
        assert x._aside.prompts == 2 and x._aside.fallbacks == 0
        assert x.cells_used() == used + length + STEPS + 2 * (STEPS + 1)
        assert x.slot_len(3) == length + STEPS
    assert np.array_equal(beside, alone)
    assert beside_toks == alone_toks


def test_made_only_where_the_plan_asks_and_short_prompts_stay_in_place(monkeypatch):
    with _open(monkeypatch, aside=False) as x:
        assert x.prefill_aside is None
    monkeypatch.delenv("LOCALINFER_PREFILL_ASIDE", raising=False)      # serve's default is on; the plan decides here
    with LlamaCppExecutor.open(str(resolve_model(None)), n_slots=2, n_ctx=512, threads=1, flash_attn=True) as x:
        assert x.prefill_aside is None                                 # no option: nothing fit did not count
    plan = x.engine.plan
    with LlamaCppExecutor(plan.with_(options={**plan.options, "prefill_aside": True})) as x:    # serve's option
        assert x.prefill_aside is not None
    with _open(monkeypatch, aside=True) as x:
        x.step([Chunk(0, tuple(range(100, 300)), 0)])
        x.step([Chunk(1, tuple(range(100, 130)), 0, logits=True)])      # under 64 rows: the untiled kernel, in place
        x.step([Chunk(1, (5,), 30, logits=True), Chunk(2, tuple(range(200, 280)), 0, logits=True)])
        assert x._aside.prompts == 1          # slot 0's prompt went in place (nothing else held cells)
        assert x.slot_len(2) == 80 and x.slot_len(1) == 31


def test_an_interrupt_stops_a_prompt_computed_aside(monkeypatch):
    from localinfer.backends.executor import StepInterrupted

    with _open(monkeypatch, aside=True) as x:
        x.step([Chunk(0, tuple(range(100, 300)), 0)])
        tried = []
        decode = x._aside.decode
        x._aside.decode = lambda *a, **k: tried.append(1) or decode(*a, **k)
        x.interrupt()                                       # asked before the step: the aside call does not start
        with pytest.raises(StepInterrupted):
            x.step([Chunk(1, tuple(range(300, 500)), 0, logits=True)])
        assert tried == [1]                                 # the prompt went aside and stopped there
        assert x.slot_len(1) == 0 and x.slot_len(0) == 200 and x.cells_used() == 200
        assert not x._aside._logits.any()                   # no logits flag left behind in the aside's batch
        got = x.step([Chunk(1, tuple(range(300, 600)), 0, logits=True)])     # the next step runs, aside (a longer
        assert x._aside.prompts == 1 and tried == [1, 1]                     # prompt: one logits row still)
        assert x.slot_len(1) == 300 and got[1].shape == (x.n_vocab,)


def test_a_copy_that_finds_too_few_free_cells_leaves_the_cache_as_it_was(monkeypatch):
    from localinfer.errors import ContextFullError

    with LlamaCppExecutor.open(str(resolve_model(None)), n_slots=3, n_ctx=512, threads=1, flash_attn=True,
                               prefill_aside=True) as x:
        assert x.n_cells == 512
        x.step([Chunk(0, tuple(range(100, 300)), 0)])
        x.step([Chunk(1, tuple(range(300, 550)), 0)])
        assert x._aside.prompts == 1 and x.cells_used() == 450
        with pytest.raises(ContextFullError):      # computed aside, 100 cells to copy into 62: in place, no room
            x.step([Chunk(2, tuple(range(600, 700)), 0, logits=True)])
        assert x._aside.fallbacks == 1 and x._aside.prompts == 1
        assert (x.slot_len(0), x.slot_len(1), x.slot_len(2), x.cells_used()) == (200, 250, 0, 450)
        x.drop(1)
        got = x.step([Chunk(2, tuple(range(600, 700)), 0, logits=True)])
        assert x._aside.prompts == 2 and x.slot_len(2) == 100 and x.cells_used() == 300
        assert np.isfinite(got[2]).all()


def test_fit_counts_the_second_context_as_llama_cpp_allocates_it(monkeypatch):
    """serve's plan asks for the second context (option prefill_aside): the memory model prices its KV, compute and
    output buffers under the key "aside", within llama.cpp's two logged decimals of what it allocated."""
    from localinfer.backends.llamacpp.memory import breakdown
    from localinfer.commands._common import plan_request
    from localinfer.devices.profiles import profile_from_dict
    from localinfer.model.spec import ModelSpec

    MiB = 1 << 20
    spec = ModelSpec.from_gguf(str(resolve_model(None)))
    cpu = profile_from_dict({"name": "test-cpu", "kind": "cpu", "memory": "8GiB"})
    with _open(monkeypatch, aside=True) as x:
        got, plan = x.prefill_aside.memory, x.engine.plan
    asked = plan_request(spec, plan)          # the plan the executor loaded, its option included
    terms = [t for t in breakdown(spec, cpu, asked)[0].terms if t.key == "aside"]
    for kind, label in (("kv", "KV cache"), ("compute", "compute buffer"), ("output", "output buffer")):
        predicted = sum(t.bytes for t in terms if t.label.startswith(label))
        assert predicted > 0 and abs(predicted - got[kind]) <= 0.005 * MiB, (kind, predicted, got[kind])
    assert sum(t.bytes for t in terms) == breakdown(spec, cpu, asked)[0].sum("aside")
    plain = plan_request(spec, plan.with_(options={**plan.options, "prefill_aside": False}))
    assert asked.prefill_aside and not plain.prefill_aside and breakdown(spec, cpu, plain)[0].sum("aside") == 0


@pytest.mark.parametrize("value,on", [("0", False), ("off", False), ("False", False), ("no", False), ("1", True),
                                      ("on", True), ("yes", True), ("", True), ("sometimes", True)])
def test_the_switch_reads_the_usual_spellings(monkeypatch, caplog, value, on):
    from localinfer.backends.llamacpp import aside

    monkeypatch.setenv("LOCALINFER_PREFILL_ASIDE", value)
    assert aside.wanted() is on
    assert ("not one of" in caplog.text) == (value == "sometimes")      # an unknown value is warned about
