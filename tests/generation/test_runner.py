"""Runner: the stream of chunks, finish reasons, prefix reuse, interrupts, and the shared decoder path."""

import numpy as np
import pytest

from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from localinfer.errors import ContextFullError, UsageError
from localinfer.generation.decoding import PlainDecoder
from localinfer.generation.runner import Runner
from localinfer.generation.sampling import SamplingParams
from localinfer.generation.text import split_stop

GREEDY = SamplingParams(temperature=0)
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is"


@pytest.fixture(scope="module")
def engine(default_model):
    with load_engine(LoadPlan(str(default_model), n_ctx=256, n_threads=1)) as e:
        yield e


@pytest.fixture
def runner(engine):
    r = Runner(engine)
    r.reset()
    return r


def manual_greedy(engine, prompt, n):
    engine.trim(0)
    logits = engine.eval(prompt)[0]
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = engine.eval([tok])[0]
    engine.trim(0)
    return out


def test_greedy_stream_equals_argmax_decoding(engine, runner):
    prompt = engine.tokenize(PROMPT)
    chunks = list(runner.stream(prompt, GREEDY, max_tokens=8, ignore_eos=True))
    tokens = [c.token for c in chunks if c.token is not None]
    # the KV holds prompt + reply minus the last token, and the runner knows it
    assert engine.kv_len() == len(prompt) + 7 == len(runner.cached())
    assert tokens == manual_greedy(engine, prompt, 8)
    last = chunks[-1]
    assert last.token is None and last.finish_reason == "length"
    assert [c.finish_reason for c in chunks[:-1]] == [None] * 8
    tm = last.timings
    assert tm.generated == 8 and len(tm.itl) == 7 and tm.ttft > 0
    assert tm.prefill_tokens == len(prompt) and tm.decode_tok_s > 0 and tm.prefill_tok_s > 0
    assert "".join(c.text for c in chunks) == engine.detokenize(tokens)


def test_eos_stops_with_reason_stop(engine, runner):
    eos = min(engine.eos_ids)
    prompt = engine.tokenize("<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\nOK.<|im_end|>", special=True)
    chunks = list(runner.stream(prompt, GREEDY, max_tokens=64))
    assert chunks[-1].finish_reason == "stop"
    assert all(c.token not in engine.eos_ids for c in chunks[:-1]) or chunks[-2].token == eos


def test_stop_strings_cut_the_text(engine, runner):
    prompt = engine.tokenize(PROMPT)
    full = runner.generate(prompt, GREEDY, max_tokens=12, ignore_eos=True).text
    word = full.split()[1] if len(full.split()) > 1 else full.strip()[:3]
    cut = full[: full.index(word)]
    runner.reset()
    g = runner.generate(prompt, GREEDY, max_tokens=12, stop=[word], ignore_eos=True)
    assert g.finish_reason == "stop" and g.text == cut
    assert engine.kv_len() == len(runner.cached())


def testsplit_stop_holds_back_possible_prefixes():
    assert split_stop("hello wor", ["world"]) == ("hello ", "wor", False)
    assert split_stop("hello world!", ["world"]) == ("hello ", None, True)
    assert split_stop("abc", []) == ("abc", "", False)


def test_prefix_of_the_previous_request_is_reused(engine, runner):
    prompt = engine.tokenize(PROMPT)
    g1 = runner.generate(prompt, GREEDY, max_tokens=4, ignore_eos=True)
    follow = prompt + g1.tokens + engine.tokenize(" and")
    g2 = runner.generate(follow, GREEDY, max_tokens=4, ignore_eos=True)
    assert g2.timings.cached_tokens == len(prompt) + 3  # all but the last reply token, which was never evaluated
    runner.reset()
    g3 = runner.generate(follow, GREEDY, max_tokens=4, ignore_eos=True)
    assert g3.timings.cached_tokens == 0 and g3.tokens == g2.tokens


def test_full_context_finishes_with_length(engine, runner):
    prompt = engine.tokenize(PROMPT * 15)[:250]
    assert len(prompt) == 250
    g = runner.generate(prompt, GREEDY, max_tokens=100, ignore_eos=True)
    assert g.finish_reason == "length" and g.timings.context_full
    assert len(g.tokens) == engine.n_ctx - len(prompt) + 1
    with pytest.raises(ContextFullError):
        runner.generate(list(range(10, 300)), GREEDY)


def test_bad_requests(runner):
    with pytest.raises(UsageError):
        runner.generate([], GREEDY)
    with pytest.raises(UsageError):
        runner.generate([1, 2], GREEDY, max_tokens=0)
    with pytest.raises(UsageError):
        runner.generate([1, 2], GREEDY, max_tokens=10**9)
    with pytest.raises(UsageError):
        runner.generate([1, 2], GREEDY, stop=["x" * 1000])


def test_interrupt_mid_stream_keeps_kv_and_bookkeeping_in_step(engine, runner):
    prompt = engine.tokenize(PROMPT)
    stream = runner.stream(prompt, GREEDY, max_tokens=50, ignore_eos=True)
    got = [next(stream) for _ in range(3)]
    stream.close()  # what a Ctrl-C in the consumer does through the generator
    assert engine.kv_len() == len(runner.cached()) == len(prompt) + 2
    # the next request works and reuses the cache
    g = runner.generate(prompt + [c.token for c in got], GREEDY, max_tokens=3, ignore_eos=True)
    assert g.timings.cached_tokens == len(prompt) + 2


def test_keyboard_interrupt_inside_a_step(engine, runner):
    class Boom(PlainDecoder):
        n = 0

        def step(self, engine, context, pending, sampler, seq=0):
            self.n += 1
            if self.n == 3:
                engine.eval([pending])  # the KV grows, then Ctrl-C lands before the step returns
                raise KeyboardInterrupt
            return super().step(engine, context, pending, sampler, seq)

    prompt = engine.tokenize(PROMPT)
    with pytest.raises(KeyboardInterrupt):
        runner.generate(prompt, GREEDY, max_tokens=10, decoder=Boom(), ignore_eos=True)
    assert engine.kv_len() == len(runner.cached()) == len(prompt) + 2  # prompt, first token, step 1


def test_seeded_sampling_repeats(engine, runner):
    prompt = engine.tokenize(PROMPT)
    p = SamplingParams(temperature=1.0, seed=11)
    a = runner.generate(prompt, p, max_tokens=6, ignore_eos=True).tokens
    runner.reset()
    b = runner.generate(prompt, p, max_tokens=6, ignore_eos=True).tokens
    assert a == b


def test_prompt_lookup_decoder_runs_through_the_same_path(engine, runner):
    speculative = pytest.importorskip("localinfer.generation.lookup")
    prompt = engine.tokenize("one two three four five six seven eight. one two three four five six seven eight. one two")
    plain = runner.generate(prompt, GREEDY, max_tokens=12, ignore_eos=True)
    runner.reset()
    dec = speculative.LookupDecoder()
    spec = runner.generate(prompt, GREEDY, max_tokens=12, ignore_eos=True, decoder=dec)
    assert spec.tokens == plain.tokens
    assert spec.stats is dec.stats and dec.stats.drafted > 0 and dec.stats.rounds < 12
    assert engine.kv_len() == len(runner.cached()) == len(prompt) + 11


def test_each_step_hands_the_sampler_a_view_of_the_history_not_a_copy():
    from tests.support.fakes import ScriptedEngine

    seen = []

    class Spy:
        greedy = True
        constraint = None

        def sample(self, logits, history):
            seen.append((history, list(history[-3:]), len(history)))
            return int(np.argmax(logits))

    eng = ScriptedEngine(lambda toks: np.eye(8)[(toks[-1] + 1) % 8], 8)
    out = Runner(eng).generate([1, 2, 3, 4], sampler=Spy(), max_tokens=5)
    assert out.tokens == [5, 6, 7, 0, 1]
    full = [1, 2, 3, 4, *out.tokens]
    assert [(tail, n) for _, tail, n in seen] == [(full[n - 3:n], n) for n in range(4, 9)]
    assert all(not isinstance(h, list) for h, _, _ in seen[1:])     # decode steps: no copy of the context

