"""Summary statistics for timings."""

from __future__ import annotations

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
