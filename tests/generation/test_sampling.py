"""SamplingParams validation and the numpy Sampler against direct computations."""

import math

import numpy as np
import pytest

from localinfer.errors import UsageError
from localinfer.generation.decoding import TokenSampler as SamplerProtocol
from localinfer.generation.sampling import Sampler, SamplingParams, check_max_tokens


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def logits():
    return (np.random.default_rng(0).standard_normal(5000) * 3).astype(np.float32)


@pytest.mark.parametrize("field,value,flag", [
    ("temperature", float("nan"), "--temp"), ("temperature", -0.1, "--temp"), ("temperature", math.inf, "--temp"),
    ("temperature", 1e300, "--temp"), ("top_k", -1, "--top-k"), ("top_k", 1 << 40, "--top-k"),
    ("top_p", 0.0, "--top-p"), ("top_p", 1.5, "--top-p"), ("top_p", float("nan"), "--top-p"),
    ("min_p", -0.2, "--min-p"), ("repeat_penalty", 0.0, "--repeat-penalty"),
    ("repeat_penalty", 1e9, "--repeat-penalty"), ("seed", -1, "--seed"), ("seed", 2**64, "--seed"),
    ("repeat_last_n", -5, "--repeat-last-n"), ("temperature", "hot", "--temp"), ("top_k", 2.5, "--top-k"),
])
def test_absurd_values_are_refused_naming_the_flag(field, value, flag):
    with pytest.raises(UsageError) as err:
        SamplingParams(**{field: value})
    assert err.value.flag == flag
    assert field in str(err.value)


def test_max_tokens_bounds():
    assert check_max_tokens(1) == 1
    for bad in (0, -3, 10**9, 2.0, True):
        with pytest.raises(UsageError):
            check_max_tokens(bad)


def test_sampler_implements_the_decoding_protocol():
    s = Sampler(SamplingParams(seed=1))
    assert isinstance(s.greedy, bool)
    for name in ("probs", "sample", "sample_from"):
        assert callable(getattr(s, name))
    assert set(dir(SamplerProtocol)) >= {"probs", "sample", "sample_from"}


def test_greedy_is_argmax_and_a_point_mass(logits):
    s = Sampler(SamplingParams(temperature=0))
    assert s.greedy
    assert s.sample(logits, []) == int(np.argmax(logits))
    p = s.probs(logits, [])
    assert p[int(np.argmax(logits))] == 1.0 and p.sum() == 1.0


def test_top_k_then_temperature_matches_direct_computation(logits):
    s = Sampler(SamplingParams(top_k=20, top_p=1.0, min_p=0.0, temperature=0.7))
    p = s.probs(logits, [])
    top = np.argsort(-logits)[:20]
    want = np.zeros_like(p)
    want[top] = softmax(logits[top].astype(np.float64) / 0.7)
    np.testing.assert_allclose(p, want, atol=1e-9)


def test_top_p_on_the_untempered_distribution(logits):
    s = Sampler(SamplingParams(top_k=0, top_p=0.9, min_p=0.0, temperature=1.3))
    p = s.probs(logits, [])
    base = softmax(logits.astype(np.float64))
    order = np.argsort(-base)
    keep = order[: int(np.searchsorted(np.cumsum(base[order]), 0.9)) + 1]
    want = np.zeros_like(p)
    want[keep] = softmax(logits[keep].astype(np.float64) / 1.3)
    np.testing.assert_allclose(p, want, atol=1e-9)
    assert len(keep) > 256  # the partial sort had to fall back to the full one


def test_min_p_keeps_tokens_above_a_fraction_of_the_best(logits):
    s = Sampler(SamplingParams(top_k=0, top_p=1.0, min_p=0.1, temperature=1.0))
    ids, pr = s.candidates(logits, [])
    base = softmax(logits.astype(np.float64))
    assert set(ids.tolist()) == set(np.flatnonzero(base >= 0.1 * base.max()).tolist())
    assert pr.sum() == pytest.approx(1.0)


def test_repetition_penalty_lowers_recent_tokens(logits):
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=100.0))
    best = int(np.argmax(logits))
    assert s.sample(logits, [best]) != best
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=100.0, repeat_last_n=1)).sample(logits, [best, 7]) == best


def test_seeded_draws_repeat_and_follow_the_distribution(logits):
    params = SamplingParams(top_k=3, top_p=1.0, min_p=0.0, temperature=1.0, seed=42)
    a = [Sampler(params).sample(logits, []) for _ in range(3)]
    s1, s2 = Sampler(params), Sampler(params)
    assert [s1.sample(logits, []) for _ in range(50)] == [s2.sample(logits, []) for _ in range(50)]
    assert len(set(a)) == 1
    draws = np.array([s1.sample(logits, []) for _ in range(4000)])
    top = np.argsort(-logits)[:3]
    want = softmax(logits[top].astype(np.float64))
    got = np.array([(draws == t).mean() for t in top])
    np.testing.assert_allclose(got, want, atol=0.03)


def test_sample_from_uses_only_the_support():
    s = Sampler(SamplingParams(seed=3))
    p = np.zeros(100)
    p[[5, 70]] = [0.25, 0.75]
    draws = [s.sample_from(p) for _ in range(2000)]
    assert set(draws) == {5, 70}
    assert abs(np.mean(np.array(draws) == 70) - 0.75) < 0.04
    with pytest.raises(ValueError):
        s.sample_from(np.zeros(10))


def test_banned_tokens_are_never_drawn(logits):
    best = int(np.argmax(logits))
    assert Sampler(SamplingParams(temperature=0), banned=[best]).sample(logits, []) != best
    s = Sampler(SamplingParams(top_k=1, seed=0), banned=[best])
    assert all(s.sample(logits, []) != best for _ in range(20))


def test_greedy_with_banned_tokens_is_the_argmax_of_the_masked_row(logits):
    """The greedy draw reads the row as given (no masked copy) and masks only when its argmax is banned: the same
    token as the argmax after banned tokens are lowered to -inf, ties to the first index included."""
    order = np.argsort(-logits, kind="stable")
    tie = logits.copy()
    tie[order[1]] = tie[order[0]]      # two equal maxima: the banned one first, the other later
    first, second = sorted(order[:2])
    for row, banned in ((logits, [int(order[0])]), (logits, [int(order[5])]), (tie, [int(first)]),
                        (tie, [int(second)]), (logits, [])):
        masked = row.copy()
        masked[banned] = -np.inf
        token = Sampler(SamplingParams(temperature=0), banned=banned).sample(row, [3, 4])
        assert token == int(np.argmax(masked)) and token not in banned
    nan = logits.copy()
    nan[[7, 11]] = np.nan                # argmax takes the first NaN; banned, the masked row's first NaN is 11
    assert Sampler(SamplingParams(temperature=0), banned=[7]).sample(nan, []) == 11
    assert Sampler(SamplingParams(temperature=0), banned=[int(order[0])]).sample(nan, []) == 7


def test_greedy_with_banned_tokens_reads_the_row_without_a_masked_copy(logits, monkeypatch):
    """The argmax of the row as given, when no banned token is it: the masked path (a copy of the row each token)
    is not taken; it is when the argmax is banned."""
    masked = lambda *a: pytest.fail("masked a row whose argmax is allowed")   # noqa: E731
    s = Sampler(SamplingParams(temperature=0), banned=[int(np.argsort(logits)[0])])
    monkeypatch.setattr(s, "candidates", masked)
    assert s.sample(logits, [1, 2]) == int(np.argmax(logits))
    s = Sampler(SamplingParams(temperature=0), banned=[int(np.argmax(logits))])
    monkeypatch.setattr(s, "candidates", masked)
    with pytest.raises(pytest.fail.Exception):
        s.sample(logits, [1, 2])


def test_with_setting_parses_and_validates():
    p = SamplingParams()
    assert p.with_setting("temp", "0.5").temperature == 0.5
    assert p.with_setting("top_k", "7").top_k == 7
    assert p.with_setting("seed", "random").seed is None
    assert p.with_setting("greedy", "on").greedy is True
    for key, value in (("temp", "nan"), ("temp", "abc"), ("nope", "1"), ("top_k", "1.5"), ("greedy", "maybe")):
        with pytest.raises(UsageError):
            p.with_setting(key, value)


def test_temperature_is_exact_far_below_the_top():
    """Temperature scales the logits before they are exponentiated: tokens 100 and 150 nats below the top keep
    their share at a high temperature (e ** (1/T) of an underflowed float32 weight lost them)."""
    logits = np.full(64, -np.inf, dtype=np.float32)
    logits[[3, 7, 9]] = [200.0, 100.0, 50.0]
    ids, probs = Sampler(SamplingParams(temperature=50.0, top_k=0, top_p=1.0, min_p=0.0)).candidates(logits, [])
    got = dict(zip(ids.tolist(), probs.tolist()))
    want = np.exp(np.array([200.0, 100.0, 50.0]) / 50.0)
    np.testing.assert_allclose([got[3], got[7], got[9]], want / want.sum(), rtol=1e-9)
