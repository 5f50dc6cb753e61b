"""Measured speed, turned into something the speed model can use.

Decode is placed on a curve of step time against the bytes the step reads
(piecewise linear between measurements, as docs/speed.md interpolates its
efficiency table); prefill is a FLOP rate looked up by batch and context.
A measurement under the very condition asked about is used as it is.

Samples come from ``localinfer bench --json`` or ``llama-bench -o json|jsonl``
(``load_bench``), or are built by hand (``DecodeSample``, ``PrefillSample``).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from localinfer.model.cost import ModelCost, kv_pair

BASE_KV = {("f16", "f16"), ("bf16", "bf16")}
SAME = 0.005   # two conditions within 0.5% of each other's bytes/context are the same


@dataclass(frozen=True)
class DecodeSample:
    """One measured decode step: ``batch`` requests at mean context ``context``."""

    batch: int
    context: int
    seconds: float
    kv: str | tuple[str, str] = "f16"
    shared_prefix: int = 0

    @classmethod
    def from_request(cls, batch: int, input_tokens: int, output_tokens: int, seconds: float, **kw) -> DecodeSample:
        """A mean step measured over whole requests (context grows from L to L + G)."""
        return cls(batch, input_tokens + output_tokens // 2, seconds, **kw)

    @property
    def family(self) -> tuple[bool, tuple[str, str]]:
        return (self.shared_prefix > 0, kv_pair(self.kv))


@dataclass(frozen=True)
class PrefillSample:
    """One measured prefill: ``batch`` sequences of ``new_tokens`` after ``cached_tokens``."""

    batch: int
    new_tokens: int
    seconds: float
    cached_tokens: int = 0

    @classmethod
    def from_mfu(cls, cost: ModelCost, peak_flops: float, batch: int, new_tokens: int, mfu: float,
                 cached_tokens: int = 0) -> PrefillSample:
        """A prefill reported as a fraction of peak FLOP/s (an efficiency table row)."""
        flops = batch * cost.prefill_flops(new_tokens, cached_tokens)
        return cls(batch, new_tokens, flops / (peak_flops * mfu), cached_tokens)


@dataclass(frozen=True)
class Calibration:
    """Measurements of one model on one device."""

    decode: tuple[DecodeSample, ...] = ()
    prefill: tuple[PrefillSample, ...] = ()
    source: str = ""
    model: str = ""

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)

    def bind(self, cost: ModelCost) -> BoundCalibration:
        return BoundCalibration(self, cost)

    def split(self, keep) -> tuple[Calibration, Calibration]:
        """(samples where keep(sample) is true, the rest): calibrate on some, check the others."""
        a = Calibration(tuple(s for s in self.decode if keep(s)), tuple(s for s in self.prefill if keep(s)),
                        self.source, self.model)
        b = Calibration(tuple(s for s in self.decode if not keep(s)), tuple(s for s in self.prefill if not keep(s)),
                        self.source, self.model)
        return a, b


class Curve:
    """Seconds as a function of work, through measured (work, seconds) points.

    Inside the measured range: linear between neighbours.  Above it: the last
    point's efficiency (seconds ∝ work).  Below it: the first segment's line,
    never under the first point's efficiency.
    """

    def __init__(self, points: list[tuple[float, float]]):
        merged: dict[float, list[float]] = {}
        for x, y in points:
            merged.setdefault(float(x), []).append(float(y))
        self.xs = sorted(merged)
        self.ys = [sum(merged[x]) / len(merged[x]) for x in self.xs]

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1 or x >= xs[-1]:
            return ys[-1] * x / xs[-1]
        if x <= xs[0]:
            slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
            return max(ys[0] + slope * (x - xs[0]), ys[0] * x / xs[0])
        i = bisect.bisect_right(xs, x)
        t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + t * (ys[i] - ys[i - 1])


class BoundCalibration:
    """A Calibration placed on one model's bytes and FLOPs."""

    def __init__(self, cal: Calibration, cost: ModelCost):
        self.cal, self.cost = cal, cost
        self._decode = [(cost.step_bytes(s.batch, s.context, s.kv), s.seconds, s.family) for s in cal.decode]
        base = [(b, t) for b, t, fam in self._decode if not fam[0] and fam[1] in BASE_KV]
        if not base:
            base = [(b, t) for b, t, fam in self._decode if not fam[0]] or [(b, t) for b, t, _ in self._decode]
        self._base = Curve(base) if base else None
        self._prefill = [(s.batch, s.new_tokens, s.cached_tokens,
                          s.batch * cost.prefill_flops(s.new_tokens, s.cached_tokens) / s.seconds)
                         for s in cal.prefill if s.seconds > 0 and s.new_tokens > 0]

    @property
    def has_decode(self) -> bool:
        return self._base is not None

    @property
    def has_prefill(self) -> bool:
        return bool(self._prefill)

    def decode_seconds(self, step_bytes: int, shared: bool, kv: str | tuple[str, str]) -> tuple[float, str]:
        """Step time for a step reading ``step_bytes``, and whether it was measured or calibrated."""
        family = (shared, kv_pair(kv))
        same = [(b, t) for b, t, fam in self._decode if fam == family]
        base = self._base(step_bytes)
        if not same:
            return base, "calibrated"
        b0, t0 = min(same, key=lambda p: abs(math.log(p[0] / step_bytes)))
        source = "measured" if abs(b0 - step_bytes) <= SAME * step_bytes else "calibrated"
        return base * t0 / self._base(b0), source

    def prefill_rate(self, batch: int, new: int, cached: int) -> tuple[float, str]:
        """FLOP/s of a prefill of ``batch`` × ``new`` tokens after ``cached``.

        Taken from the measurements at the nearest batch size, interpolated in
        log(context) between the two nearest contexts.
        """
        for b, n, c, rate in self._prefill:
            if b == batch and n == new and c == cached:
                return rate, "measured"
        near = min(abs(math.log(b / batch)) for b, *_ in self._prefill)
        rows = sorted((math.log(n + c), rate) for b, n, c, rate in self._prefill
                      if abs(abs(math.log(b / batch)) - near) < 1e-9)
        x = math.log(new + cached)
        xs = [r[0] for r in rows]
        if x <= xs[0]:
            return rows[0][1], "calibrated"
        if x >= xs[-1]:
            return rows[-1][1], "calibrated"
        i = bisect.bisect_right(xs, x)
        (x0, r0), (x1, r1) = rows[i - 1], rows[i]
        return r0 + (x - x0) / (x1 - x0) * (r1 - r0) if x1 > x0 else r1, "calibrated"


@dataclass(frozen=True)
class LinearFit:
    """y = fixed + slope·x, e.g. an ITL fitted against context length."""

    fixed: float
    slope: float

    def at(self, x: float) -> float:
        return self.fixed + self.slope * x

    def crossover(self, other: LinearFit) -> float:
        """x where the two lines meet (inf when parallel)."""
        if self.slope == other.slope:
            return math.inf
        return (other.fixed - self.fixed) / (self.slope - other.slope)

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> LinearFit:
        """Least squares through (x, y) points (one point: a flat line)."""
        n = len(points)
        if n == 0:
            raise ValueError("no points to fit")
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
        return cls(my - slope * mx, slope)


@dataclass(frozen=True)
class StepFit:
    """Step time = fixed + per_token·(new tokens) + per_pair·(causal pairs), the fitted model of docs/speed.md."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float

    def step(self, new: int, cached: int = 0) -> float:
        from localinfer.model.cost import attention_pairs

        return self.fixed_s + self.per_token_s * new + self.per_pair_s * attention_pairs(new, cached)
