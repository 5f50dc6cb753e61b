"""Prompt-lookup speculative decoding: drafting, exact verification, KV rollback, adaptive length.

The distribution proof runs on ``ScriptedEngine``, a real ``Engine`` subclass
whose next-token logits come from a fixed table (a legitimate test double: the
property under test is the decoder's, and it needs tens of thousands of
generations).  The real-model checks go through the llama.cpp engine.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest

from localinfer.backends.engine import LoadPlan
from localinfer.errors import UsageError
from localinfer.generation.decoding import PlainDecoder, prefill
from localinfer.generation.lookup import CostModel, LookupDecoder, LookupStats, NgramIndex
from localinfer.plan.speculation import choose_draft_length, clairvoyant_time, copy_runs, expected_tokens
from tests.support.fakes import ScriptedEngine, TableSampler, bigram_table


def generate(engine, decoder, prompt, sampler, n_tokens):
    """The runner's loop over the shared step signature; checks the KV invariant every round."""
    engine.trim(0)
    decoder.start(prompt)
    pending = prefill(engine, prompt)
    context = list(prompt[:-1])
    out: list[int] = []
    while len(out) < n_tokens and not (out and engine.is_eos(out[-1])):
        emitted = decoder.step(engine, context, pending, sampler)
        assert emitted and engine.kv_len() == len(context) + len(emitted)
        context += [pending, *emitted[:-1]]
        pending = emitted[-1]
        out += emitted
        for i, t in enumerate(out):
            if engine.is_eos(t):
                del out[i + 1:]
                break
    if isinstance(engine, ScriptedEngine):
        assert engine.kv == context
    return out[:n_tokens]


# ---- SPEC §8.5 figures through the API -----------------------------------------
def test_expected_tokens_and_time_per_token_match_spec():
    aaaa, bbbb = expected_tokens([1 / 4] * 4), expected_tokens([3 / 4] * 4)
    assert aaaa == pytest.approx(1.33, rel=5e-3)
    assert bbbb == pytest.approx(3.05, rel=5e-3)
    round_ms = 26.26 + 0.1
    assert round_ms / aaaa == pytest.approx(19.8, rel=5e-3)
    assert round_ms / bbbb == pytest.approx(8.64, rel=5e-3)
    # break-even lookup cost: (26.26 + l) / E[N] = 26.26
    assert 26.26 * (aaaa - 1) == pytest.approx(8.7, rel=5e-3)
    assert 26.26 * (bbbb - 1) == pytest.approx(53.9, rel=5e-3)


def test_per_token_time_is_total_time_over_total_tokens():
    stats = LookupStats(rounds=2, emitted=6, round_times=[1.5e-3, 1.5e-3])
    assert stats.seconds_per_token == pytest.approx(0.5e-3)
    stats.plain_seconds_per_token = 1.5e-3
    assert stats.speedup == pytest.approx(3.0)
    assert stats.as_dict()["speedup"] == pytest.approx(3.0)


@pytest.mark.parametrize("cost", [lambda m: 26.3 + 3.6 * m, lambda m: 26.3 + 14.4 * math.ceil(m / 4)])
def test_draft_length_rule_picks_least_time_per_token(cost):
    a = [3 / 4] * 8
    lengths = [1, 2, 4, 8]
    chosen = choose_draft_length(a, lambda m: 26.3 if m == 0 else cost(m), lengths)
    per_token = {m: (26.3 if m == 0 else cost(m)) / expected_tokens(a[:m]) for m in [0, *lengths]}
    assert chosen == min(per_token, key=per_token.get)
    assert chosen != 0 and per_token[chosen] < 26.3


def test_draft_length_rule_declines_when_verifying_costs_more_than_it_returns():
    cpu = [1.0 + 0.35 * m for m in range(17)]
    assert choose_draft_length([0.3] * 16, cpu) == 0
    assert choose_draft_length([0.99] * 16, cpu) == 16
    assert 0 < choose_draft_length([0.8] * 16, cpu) < 16


def test_cost_model_fits_a_line_and_shrugs_off_one_slow_round():
    cost = CostModel(17)
    assert cost.curve() is None
    for _ in range(8):
        cost.add(1, 0.020)
    for _ in range(3):
        cost.add(5, 0.040)
    curve = cost.curve()
    assert curve[0] == pytest.approx(0.020) and curve[4] == pytest.approx(0.040)   # measured sizes
    assert curve[2] == pytest.approx(0.030, rel=0.05) and curve[16] > curve[8] > curve[4]  # the line
    cost.add(2, 5.0)                       # a round while the machine was busy
    assert cost.measured(2) <= 3 * 0.025
    assert choose_draft_length([0.9] * 16, cost.curve()) > 0


def test_decoders_on_one_engine_share_its_measured_costs():
    engine, other = (ScriptedEngine(_scripted([1, 2, 3]), 64) for _ in range(2))
    first, second, elsewhere = LookupDecoder(), LookupDecoder(), LookupDecoder()
    generate(engine, first, [1, 2, 3, 1, 2], TableSampler(0), 5)
    generate(engine, second, [1, 2, 3, 1, 2], TableSampler(0), 5)
    generate(other, elsewhere, [1, 2, 3, 1, 2], TableSampler(0), 5)
    assert first.cost is second.cost and elsewhere.cost is not first.cost
    assert first.cost.measured(1) is not None


# ---- the n-gram index ------------------------------------------------------------
def test_index_prefers_longest_then_latest_match():
    idx = NgramIndex(1, 3, [5, 1, 2, 9, 7, 1, 2, 8, 3, 2])
    assert idx.match() == (1, 7)          # only the unigram "2" recurs: at 2 and 6, the latest wins
    idx.extend([1, 2])                    # now the bigram (1, 2): at 1..2 and 5..6
    n, p = idx.match()
    assert n == 2 and idx.tokens[p] == 8
    idx.extend([8])
    n, p = idx.match()
    assert n == 3 and idx.tokens[p] == 3


def test_incremental_index_equals_a_rebuild():
    rng = random.Random(3)
    toks = [rng.randrange(6) for _ in range(400)]
    grown = NgramIndex(2, 5)
    for i, t in enumerate(toks):
        grown.extend([t])
        if i % 37 == 0:
            fresh = NgramIndex(2, 5, toks[:i + 1])
            assert grown.match() == fresh.match()
            assert grown._maps == fresh._maps


def test_continuation_extends_periodic_text_past_the_end():
    idx = NgramIndex(1, 4, [7, 1, 2, 3, 1, 2, 3])
    n, p = idx.match()
    assert (n, p) == (3, 4)
    assert idx.continuation(p, 7) == [1, 2, 3, 1, 2, 3, 1]


def test_next_chat_turn_extends_the_index_instead_of_rebuilding():
    dec = LookupDecoder(ngram_max=3, ngram_min=1)
    dec.start([1, 2, 3, 4])
    first = dec.index
    dec.start([1, 2, 3, 4, 5, 6])
    assert dec.index is first and dec.index.tokens == [1, 2, 3, 4, 5, 6]
    dec.start([9, 2, 3])
    assert dec.index is not first and dec.index.tokens == [9, 2, 3]
    assert dec.index._maps == NgramIndex(1, 3, [9, 2, 3])._maps


def test_bad_parameters_are_usage_errors():
    with pytest.raises(UsageError) as e:
        LookupDecoder(ngram_max=2, ngram_min=3)
    assert e.value.flag == "--lookup-ngram"
    for bad in (0, -3, 10**6, 2.5, True):
        with pytest.raises(UsageError) as e:
            LookupDecoder(draft_max=bad)
        assert e.value.flag == "--draft-max"


# ---- greedy: same tokens as plain, KV rolled back ----------------------------------
def _scripted(script):
    """Target emits script[position] greedily, whatever came before."""
    def logits(prefix):
        row = np.zeros(64)
        row[script[len(prefix) % len(script)]] = 5.0
        return row
    return logits


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_lookup_equals_plain_and_rolls_back(adaptive):
    rng = random.Random(0)
    # copy-heavy with edits: the target repeats the prompt but changes every 9th token
    prompt = [rng.randrange(60) for _ in range(80)]
    script = prompt + [t if i % 9 else 61 for i, t in enumerate(prompt)] * 3
    engine = ScriptedEngine(_scripted(script), 64)
    sampler = TableSampler(temperature=0)
    plain = generate(engine, PlainDecoder(), prompt, sampler, 150)
    cost = CostModel.fixed([1.0 + 0.05 * m for m in range(17)])
    dec = LookupDecoder(ngram_max=3, ngram_min=1, draft_max=8, adaptive=adaptive, cost=cost)
    out = generate(engine, dec, prompt, sampler, 150)
    assert out == plain
    st = dec.stats
    assert st.accepted > 100 and st.drafted > st.accepted          # drafts were both kept and rejected
    assert st.rounds < 60
    assert max(map(len, engine.evals[-st.rounds:])) > 1


def test_drafts_never_contain_eos_and_respect_the_context():
    script = [1, 2, 3, 4, 0] * 40
    engine = ScriptedEngine(_scripted(script), 64, n_ctx=60, eos=0)
    dec = LookupDecoder(ngram_max=2, ngram_min=1, draft_max=8, adaptive=False)
    prompt = script[:12]
    dec.start(prompt)
    pending = prefill(engine, prompt)
    context = list(prompt[:-1])
    while len(context) + 1 < engine.n_ctx:
        emitted = dec.step(engine, context, pending, TableSampler(0))
        context += [pending, *emitted[:-1]]
        pending = emitted[-1]
    assert all(0 not in toks[1:] for toks in engine.evals[1:])  # EOS only ever as the pending token
    assert max(map(len, engine.evals[1:])) == 5
    assert engine.kv_len() == engine.n_ctx - 1


def test_index_resyncs_when_the_caller_rewinds():
    script = list(range(1, 30)) * 4
    engine = ScriptedEngine(_scripted(script), 64)
    dec = LookupDecoder(ngram_max=3, ngram_min=1, draft_max=4, adaptive=False)
    sampler = TableSampler(0)
    generate(engine, dec, script[:40], sampler, 20)
    # a new conversation without start(): the decoder must not draft from the old history
    other = [40 + (i % 7) for i in range(30)]
    out = generate(engine, dec.__class__(ngram_max=3, ngram_min=1, draft_max=4, adaptive=False), other, sampler, 10)
    assert out == script[30:40]


# ---- sampling: the output distribution is plain sampling's ---------------------------
V, PROMPT, N_GEN = 5, [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], 3


def _chi2_threshold(df: int, z: float) -> float:
    """Upper quantile of chi-square(df) at normal quantile z (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _exact_joint(table):
    probs = np.exp(table - table.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    joint = {}
    for seq in np.ndindex(*(V,) * N_GEN):
        prev, p = PROMPT[-1], 1.0
        for t in seq:
            p *= probs[prev, t]
            prev = t
        joint[seq] = p
    return joint


def _chi2(counts: Counter, joint: dict, n: int) -> tuple[float, int]:
    stat, df, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    for cell, p in joint.items():
        e = n * p
        if e < 5:
            rest_obs += counts[cell]
            rest_exp += e
            continue
        stat += (counts[cell] - e) ** 2 / e
        df += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        df += 1
    return stat, df


class WrongResidual(LookupDecoder):
    """Accepts x with probability p(x) but on rejection draws from p, not (p - q)+."""

    def _verify(self, rows, draft, sampler):
        out = []
        for i in range(len(draft) + 1):
            p = sampler.probs(rows[i], [])
            if i < len(draft) and sampler.rng.random() < p[draft[i]]:
                out.append(draft[i])
                continue
            out.append(sampler.sample_from(p))
            break
        return out


def _sampled_counts(decoder_cls, n_runs: int, seed: int):
    table = bigram_table(V, seed=11, sharp=1.0)
    table[np.arange(V), (np.arange(V) + 1) % V] += 2.0   # the lookup draft (0 1 2 3 ...) is often right
    engine = ScriptedEngine(lambda prefix: table[prefix[-1]], V, n_ctx=64)
    sampler = TableSampler(1.0, seed=seed)
    dec = decoder_cls(ngram_max=2, ngram_min=1, draft_max=N_GEN - 1, adaptive=False)  # all kept: a bonus token
    counts, drafted, accepted = Counter(), 0, 0
    for _ in range(n_runs):
        counts[tuple(generate(engine, dec, PROMPT, sampler, N_GEN))] += 1
        drafted += dec.stats.drafted
        accepted += dec.stats.accepted
    assert 0.3 * drafted < accepted < 0.7 * drafted, (drafted, accepted)  # both outcomes are common
    return counts, _exact_joint(table)


def test_sampled_lookup_matches_the_target_distribution():
    n = 4000
    counts, joint = _sampled_counts(LookupDecoder, n, seed=1)
    stat, df = _chi2(counts, joint, n)
    assert stat < _chi2_threshold(df, 3.09), (stat, df)           # p > 0.001
    wrong, _ = _sampled_counts(WrongResidual, n, seed=1)
    wstat, wdf = _chi2(wrong, joint, n)
    assert wstat > _chi2_threshold(wdf, 6.0), (wstat, wdf)        # the test can tell a wrong residual apart


def test_seeded_sampling_consumes_randomness_like_plain_decoding():
    table = bigram_table(V, seed=5)
    table[np.arange(V), (np.arange(V) + 1) % V] += 2.0
    engine = ScriptedEngine(lambda prefix: table[prefix[-1]], V, n_ctx=512)
    for seed in range(5):
        plain = generate(engine, PlainDecoder(), PROMPT, TableSampler(0.8, seed), 120)
        dec = LookupDecoder(ngram_max=3, ngram_min=1, draft_max=6, adaptive=False)
        assert generate(engine, dec, PROMPT, TableSampler(0.8, seed), 120) == plain
        assert dec.stats.accepted > 0 and dec.stats.drafted > dec.stats.accepted


# ---- adaptive length ---------------------------------------------------------------
CPU_COST = CostModel.fixed([1.0 + 0.35 * m for m in range(17)])


def test_adaptive_stops_drafting_when_nothing_can_be_copied():
    rng = random.Random(1)
    script = [rng.randrange(40) for _ in range(600)]
    engine = ScriptedEngine(_scripted(script), 64)
    dec = LookupDecoder(ngram_max=4, ngram_min=1, draft_max=16, cost=CPU_COST)
    generate(engine, dec, script[:200], TableSampler(0), 300)
    assert dec.stats.drafted <= 10, dec.stats


def test_adaptive_drafts_long_on_repetitive_text():
    script = [3, 9, 4, 7, 1, 8, 2] * 100
    engine = ScriptedEngine(_scripted(script), 64)
    dec = LookupDecoder(ngram_max=4, ngram_min=1, draft_max=16, cost=CPU_COST)
    generate(engine, dec, script[:30], TableSampler(0), 300)
    assert dec.stats.drafted / dec.stats.rounds > 12, dec.stats


# ---- the clairvoyant bound -------------------------------------------------------------------
def test_copy_runs_see_the_history_and_the_output_so_far():
    assert copy_runs([1, 2, 3, 4], [1, 2, 3, 9, 1, 2, 3, 9]) == [3, 2, 1, 0, 4, 3, 2, 1]
    assert copy_runs([5], [5, 5, 5, 5]) == [4, 3, 2, 1]  # a copy may run on into what it produces
    assert copy_runs([5], [5, 5, 5, 5], cap=2) == [2, 2, 2, 1]


def test_clairvoyant_time_drafts_exactly_what_pays():
    assert clairvoyant_time([5], [5, 5, 5, 5], [1.0, 1.5, 2.0, 2.5]) == (2.5, 1)
    assert clairvoyant_time([5], [5, 5, 5, 5], [1.0, 2.0, 3.0, 4.0]) == (4.0, 1)  # no gain; ties: fewer rounds
    # nothing to copy: one plain round per token
    assert clairvoyant_time([1], [2, 3, 4], [1.0, 1.1]) == (3.0, 3)


@pytest.mark.parametrize("seed", range(4))
def test_no_lookup_policy_beats_the_clairvoyant_bound(seed):
    """Replaying LookupDecoder against a known output never takes less time than the bound."""
    rng = random.Random(seed)
    phrase = [rng.randrange(30) for _ in range(40)]
    history = [rng.randrange(30) for _ in range(60)] + phrase
    output = []
    while len(output) < 300:  # copies of the phrase with edits, and free text between
        output += [t if rng.random() > 0.08 else rng.randrange(30) for t in phrase[rng.randrange(20):]]
        output += [rng.randrange(30) for _ in range(rng.randrange(6))]
    output = output[:300]
    costs = [1.0 + 0.35 * m for m in range(17)]
    bound, _ = clairvoyant_time(history, output, costs)
    dec = LookupDecoder(ngram_max=4, ngram_min=1, draft_max=16, cost=CostModel.fixed(costs))
    dec.start(history[:-1])
    context, pending, i, spent = list(history[:-1]), history[-1], 0, 0.0
    while i < len(output):
        draft = dec.propose(context, pending, room=1 << 20)
        k = 0
        while k < len(draft.tokens) and i + k < len(output) and draft.tokens[k] == output[i + k]:
            k += 1
        emitted = output[i:i + k + 1]
        spent += costs[len(draft.tokens)]
        dec.observe(draft, emitted)
        context += [pending, *emitted[:-1]]
        pending, i = emitted[-1], i + len(emitted)
    assert bound <= spent < len(output)  # lookup pays here, and the bound is below it


# ---- the real embedded model through llama.cpp -----------------------------------------
# One thread: llama.cpp's multi-threaded single-token kernels (flash-attention decode) sum in a
# different order from its batched kernels once the context passes ~256 tokens, so greedy
# near-ties can flip between plain and batched verification (benchmarks/lookup.py reports them).
# With one thread both paths are bit-identical, which is what lets these tests assert equality.
CODE_TASK = '''Rename the variable `total` to `subtotal` in this function and print the whole function again.

def invoice(lines, tax_rate=0.2):
    total = 0
    for name, qty, price in lines:
        if qty <= 0:
            raise ValueError(f"bad quantity for {name}")
        total += qty * price
    tax = round(total * tax_rate, 2)
    return {"net": total, "tax": tax, "gross": total + tax}
'''
LIST_TASK = "Repeat this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates, kiwis."


@pytest.fixture(scope="module", params=["f16", "q8_0"], ids=["kv_f16", "kv_q8_0"])
def llama_engine(request, default_model):
    llamacpp = pytest.importorskip("localinfer.backends.llamacpp.engine")
    engine = llamacpp.LlamaCppEngine(LoadPlan(str(default_model), n_ctx=1024, n_threads=1,
                                              type_k=request.param, type_v=request.param))
    yield engine
    engine.close()


def _chat(engine, default_model, text):
    from localinfer.model.spec import ModelSpec
    from localinfer.model.templates import template_for

    return template_for(ModelSpec.from_gguf(default_model)).tokens(engine, [{"role": "user", "content": text}])


@pytest.mark.parametrize("task", [CODE_TASK, LIST_TASK], ids=["code", "list"])
def test_lookup_equals_plain_greedy_on_the_embedded_model(llama_engine, default_model, task):
    from localinfer.generation.sampling import Sampler, SamplingParams

    prompt = _chat(llama_engine, default_model, task)
    greedy = SamplingParams(greedy=True)
    plain = generate(llama_engine, PlainDecoder(), prompt, Sampler(greedy), 32)
    dec = LookupDecoder(cost=CostModel.fixed([1.0 + 0.1 * m for m in range(17)]))  # draft whenever it may pay
    assert generate(llama_engine, dec, prompt, Sampler(greedy), 32) == plain   # KV checked every round
    assert dec.stats.accepted > 8 and dec.stats.rounds < 32


def test_runner_with_lookup_matches_plain_and_leaves_the_kv_consistent(llama_engine, default_model):
    from localinfer.generation.runner import Runner
    from localinfer.generation.sampling import SamplingParams

    prompt = _chat(llama_engine, default_model, CODE_TASK)
    greedy = SamplingParams(greedy=True)
    runner = Runner(llama_engine)
    plain = runner.generate(prompt, greedy, max_tokens=33)
    runner.reset()  # prefill the prompt the same way (a reused prefix computes its last token alone)
    dec = LookupDecoder()
    spec = runner.generate(prompt, greedy, max_tokens=33, decoder=dec)
    assert spec.tokens == plain.tokens and spec.text == plain.text
    assert llama_engine.kv_len() == len(runner.cached())   # a round past max_tokens was trimmed back
    assert spec.stats is dec.stats and dec.stats.emitted >= 32   # the first token comes from the prefill
