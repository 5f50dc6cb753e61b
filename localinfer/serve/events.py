"""What a step produces: each request's stream events (a token, or its finish), and the step's record."""

from __future__ import annotations

from dataclasses import dataclass

from localinfer.serve.request import FinishReason


@dataclass(frozen=True)
class StreamChunk:
    """One event of a request's stream: a new token, or its finish (token None)."""

    request_id: str
    token: int | None
    time_s: float
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass(frozen=True)
class StepRecord:
    """What one step computed: (request id, start, new tokens) per chunk, and when; each chunk's kind ("prefill",
    "decode", or "verify" with lookup drafts), whether it yielded the request's next token, the requests admitted
    (seated) and preempted in it, and the step model's prediction of its time (None without one).  ``interrupted``:
    the step was stopped in flight, its requests all cancelled, and computed none of its chunks."""

    start_s: float
    end_s: float
    chunks: tuple[tuple[str, int, int], ...]
    kinds: tuple[str, ...] = ()
    sampled: tuple[bool, ...] = ()
    admitted: tuple[str, ...] = ()
    predicted_s: float | None = None
    preempted: tuple[str, ...] = ()
    interrupted: bool = False

    def as_json(self) -> dict:
        out = {"start_s": self.start_s, "end_s": self.end_s, "predicted_s": self.predicted_s,
               "chunks": [[rid, start, n, kind, got] for (rid, start, n), kind, got
                          in zip(self.chunks, self.kinds, self.sampled)], "admitted": list(self.admitted),
               "preempted": list(self.preempted)}
        if self.interrupted:
            out["interrupted"] = True
        return out
