"""Which steps made a stream's largest gaps between tokens: read from the engine's step records.

A request's token comes out when a step that sampled it ends, so its gaps are the times between
the ends of those steps, and what filled a gap is the steps that ended inside it (and the time
between them: parking, HTTP, the scheduler).  A step is described by its kinds: the prompt tokens it
prefilled, the decodes and lookup verifications it ran, the requests it seated; a decode-only step
in a gap is the decode share's, a gap with no step of its own is a wait (a prefix in flight, a
preemption, the queue).  Works alike on a replay's records and on ``serve --step-log`` lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Gap:
    request: str
    start_s: float            # the token before the gap came out
    end_s: float              # the next token came out
    steps: tuple[dict, ...]   # the steps that ended inside it: start_s, ms, predicted_ms, prefill, decodes, admitted

    @property
    def ms(self) -> float:
        return (self.end_s - self.start_s) * 1e3

    @property
    def between_ms(self) -> float:
        """Time in the gap outside its steps (parking, the server, waiting)."""
        return self.ms - sum(s["ms"] for s in self.steps)

    def describe(self) -> str:
        parts = []
        for s in self.steps:
            what = [f"{s['prefill']} prompt tokens" if s["prefill"] else "", f"{s['decodes']} decodes",
                    f"{len(s['admitted'])} seated" if s["admitted"] else ""]
            parts.append(f"{s['ms']:.0f} ms ({', '.join(w for w in what if w)})")
        rest = f" + {self.between_ms:.0f} ms between steps" if self.between_ms >= 1 else ""
        return f"{self.request}: {self.ms:.0f} ms = " + (" + ".join(parts) or "no step") + rest


def step_summary(record: Mapping) -> dict:
    """A step record (``StepRecord.as_json()``) in a gap: its time, prompt tokens, decodes and admissions."""
    prefill = sum(n for _, _, n, kind, _ in record["chunks"] if kind == "prefill")
    decodes = sum(1 for _, _, _, kind, _ in record["chunks"] if kind in ("decode", "verify"))
    predicted = record.get("predicted_s")
    return {"start_s": record["start_s"], "ms": (record["end_s"] - record["start_s"]) * 1e3,
            "predicted_ms": None if predicted is None else predicted * 1e3, "prefill": prefill, "decodes": decodes,
            "admitted": list(record.get("admitted", ()))}


def token_times(records: Iterable[Mapping]) -> dict[str, list[float]]:
    """Each request's token times: the ends of the steps that sampled it."""
    out: dict[str, list[float]] = {}
    for rec in records:
        for rid, _, _, _, sampled in rec["chunks"]:
            if sampled:
                out.setdefault(rid, []).append(rec["end_s"])
    return out


def largest_gaps(records: list[Mapping], top: int = 5) -> list[Gap]:
    """The ``top`` largest gaps between consecutive tokens of any request, with the steps that filled each."""
    records = sorted(records, key=lambda r: r["end_s"])
    ends = [r["end_s"] for r in records]
    gaps = []
    for rid, times in token_times(records).items():
        gaps += [(b - a, rid, a, b) for a, b in zip(times, times[1:])]
    out = []
    for _, rid, a, b in sorted(gaps, reverse=True)[:top]:
        inside = [step_summary(records[i]) for i in range(len(records)) if a < ends[i] <= b]
        out.append(Gap(rid, a, b, tuple(inside)))
    return out
