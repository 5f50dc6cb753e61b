"""Summary statistics for timings."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) of xs, interpolated linearly between ranks; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio_interval(ratios: Sequence[float], *, seed: int = 0, resamples: int = 2000,
                   level: float = 0.95) -> tuple[float, float, float] | None:
    """Paired ratios (one a/b a pair): their geometric mean and a bootstrap ``level`` interval of it (the
    percentile method over ``resamples`` resamplings, seeded: the same ratios give the same interval); None for
    no data.  ValueError for a ratio that is not a positive number."""
    if not 0 < level < 1 or isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"level must be in (0, 1) and resamples at least 1, got {level!r} and {resamples!r}")
    if not ratios:
        return None
    bad = [r for r in ratios if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < math.inf]
    if bad:
        raise ValueError(f"ratios must be positive finite numbers, got {bad[0]!r}")
    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    k = min(round((1.0 - level) / 2 * resamples), (resamples - 1) // 2)    # resamples left out at each end
    return math.exp(statistics.fmean(logs)), math.exp(means[k]), math.exp(means[resamples - 1 - k])
