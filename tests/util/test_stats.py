"""util.stats: percentiles, and the paired-ratio interval benchmarks/serve_paired.py reports."""

import math

import pytest

from localinfer.util.stats import percentile, ratio_interval


def test_percentile_interpolates_between_ranks():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.25) == 2.5


def test_the_geometric_mean_of_ratios_treats_a_gain_and_the_same_loss_alike():
    geo, lo, hi = ratio_interval([2.0, 0.5, 2.0, 0.5])
    assert geo == pytest.approx(1.0)
    assert lo < 1.0 < hi


def test_equal_ratios_give_a_point_interval_and_the_interval_holds_the_mean():
    assert ratio_interval([1.25] * 7) == pytest.approx((1.25, 1.25, 1.25))
    xs = [0.95, 0.97, 0.99, 1.01, 0.96, 0.98, 0.94, 1.0]
    geo, lo, hi = ratio_interval(xs)
    assert min(xs) <= lo <= geo <= hi <= max(xs)
    assert geo == pytest.approx(math.exp(sum(map(math.log, xs)) / len(xs)))


def test_the_interval_is_seeded_and_narrows_with_more_pairs():
    xs = [0.9, 1.1, 0.95, 1.05, 1.0, 0.92, 1.08, 0.97]
    assert ratio_interval(xs, seed=3) == ratio_interval(xs, seed=3)
    _, lo8, hi8 = ratio_interval(xs)
    _, lo64, hi64 = ratio_interval(xs * 8)
    assert hi64 - lo64 < (hi8 - lo8) / 2


def test_no_ratios_is_none_and_a_ratio_that_is_not_positive_is_refused():
    assert ratio_interval([]) is None
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="positive finite"):
            ratio_interval([1.0, bad])


def test_the_interval_leaves_the_same_share_out_at_each_end_and_checks_its_settings():
    xs = [float(i) for i in range(1, 21)]
    _, lo, hi = ratio_interval(xs, resamples=1, level=0.5)      # one resample: its mean is both ends
    assert lo == hi
    narrow, wide = ratio_interval(xs, level=0.5), ratio_interval(xs, level=0.99)
    assert wide[1] < narrow[1] < narrow[2] < wide[2]
    for level, resamples in ((1.0, 100), (0.0, 100), (1.5, 100), (0.95, 0), (0.95, 2.5)):
        with pytest.raises(ValueError, match="level must be"):
            ratio_interval(xs, level=level, resamples=resamples)
