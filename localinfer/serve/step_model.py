"""How long one batched step takes: the simulator's clock and the scheduler's predictions.

A step computes chunks; a chunk is ``c`` new tokens of one request after ``h``
tokens it already holds, with N(c, h) = c·h + c(c+1)/2 causal (query, key)
pairs (a decode token after h cached ones: h + 1).  Two models:

- ``LinearStepModel``: T = fixed + per_token·Σc + per_pair·ΣN (e.g. 26.22 ms +
  30.4 µs/token + 3 ns/pair: 26.26 ms for one decode at 2K, 94.8 ms for a 2K prefill), plus per_seq for each
  chunk (a sequence's own work in the step: its logits row, its rows of the mask; 0 unless fitted: on a CPU a
  decode row costs about twice a prompt token, 6.5 against 3.6 ms for SmolLM2 on two cores), and, where given,
  per_row_pair for the pairs of chunks shorter than ``ROW_CHUNK`` in place of per_pair (serve's fitted model: on
  a CPU such rows walk their cells one by one, a pair 4.8-6.4 µs for SmolLM2 on two cores, while a prompt's
  tiles share the walk and its pairs cost nearly nothing beside its tokens: one per_pair for both priced a
  300-token prompt 27% long once set from a decode row), and per_held for each position a chunk of ``ROW_CHUNK``
  tokens or more finds already held (0 unless fitted: on a CPU such a chunk pays once for every cell before it,
  whatever its own length, so one price a pair fits one chunk length only: a 64-token chunk 2,048 positions
  in cost SmolLM2 on two cores 1.45 µs a pair more than at 0, a 512-token one 0.94; fitted on such chunks with
  a constant and per_held, 0.88 µs a pair and 35 µs a held position: benchmarks/prompt_held.py);
- ``SpeedStepModel``: a device profile's roofline (``plan.speed.SpeedModel``):
  one decode round for the one-token chunks plus each prompt chunk's prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from localinfer.errors import UsageError
from localinfer.model.cost import attention_pairs

ChunkShape = tuple[int, int]    # (new tokens c, tokens already held h)
ROW_CHUNK = 64                  # chunks shorter than this are computed row by row (ggml-cpu's flash attention tiles
                                # the query only in ubatches of 64 rows or more; llama.cpp's executor runs them apart)


def features(chunks: Sequence[ChunkShape]) -> tuple[float, float, float, float, float]:
    """A step's (tokens, pairs of chunks of ``ROW_CHUNK`` tokens or more, pairs of shorter ones, chunks, positions
    held before the chunks of ``ROW_CHUNK`` tokens or more)."""
    tokens = pairs = rows = held = 0
    for c, h in chunks:
        tokens += c
        if c < ROW_CHUNK:
            rows += attention_pairs(c, h)
        else:
            pairs += attention_pairs(c, h)
            held += h
    return float(tokens), float(pairs), float(rows), float(len(chunks)), float(held)


class StepModel(Protocol):
    def seconds(self, chunks: Sequence[ChunkShape]) -> float:
        """Predicted time of one step computing these chunks (0 for none)."""


@dataclass(frozen=True)
class LinearStepModel:
    fixed_s: float
    per_token_s: float
    per_pair_s: float
    per_seq_s: float = 0.0      # each chunk of the step (fitted by serve's step timing; --step-model leaves it 0)
    per_row_pair_s: float | None = None     # a pair of a chunk shorter than ROW_CHUNK (None: per_pair_s)
    per_held_s: float = 0.0     # a position held before a chunk of ROW_CHUNK tokens or more (fitted; else 0)

    @property
    def coefficients(self) -> tuple[float, float, float, float, float, float]:
        """(fixed, per token, per pair, per row pair, per chunk, per held position): what :func:`features` are
        weighed by."""
        row = self.per_pair_s if self.per_row_pair_s is None else self.per_row_pair_s
        return self.fixed_s, self.per_token_s, self.per_pair_s, row, self.per_seq_s, self.per_held_s

    def predict(self, feats: Sequence[float], steps: float = 1.0) -> float:
        """The time of ``steps`` steps whose :func:`features` sum to ``feats``."""
        fixed, *per = self.coefficients
        return steps * fixed + sum(c * f for c, f in zip(per, feats))

    @classmethod
    def parse(cls, text: str, flag: str = "--step-model") -> LinearStepModel:
        """``"FIXED_MS,PER_TOKEN_US,PER_PAIR_NS"``, e.g. ``"26.22,30.4,3"``."""
        parts = str(text).split(",")
        try:
            ms, us, ns = (float(x) for x in parts)
        except ValueError:
            raise UsageError(f"{flag} needs three numbers FIXED_MS,PER_TOKEN_US,PER_PAIR_NS, got {text!r}",
                             flag=flag, hint=f"e.g. {flag} 26.22,30.4,3") from None
        if not all(math.isfinite(v) for v in (ms, us, ns)) or min(ms, us, ns) < 0 or ms + us + ns <= 0:
            raise UsageError(f"{flag} coefficients must be finite, non-negative and not all zero, got {text!r}",
                             flag=flag, hint=f"e.g. {flag} 26.22,30.4,3")
        return cls(ms * 1e-3, us * 1e-6, ns * 1e-9)

    def seconds(self, chunks: Sequence[ChunkShape]) -> float:
        """:meth:`predict` of the chunks' :func:`features`, summed in one pass (the scheduler asks it many times a
        step)."""
        if not chunks:
            return 0.0
        pair, token, held = self.per_pair_s, self.per_token_s, self.per_held_s
        row = pair if self.per_row_pair_s is None else self.per_row_pair_s
        t = self.fixed_s + self.per_seq_s * len(chunks)
        for c, h in chunks:
            t += token * c + (row * attention_pairs(c, h) if c < ROW_CHUNK else pair * attention_pairs(c, h) + held * h)
        return t


class SpeedStepModel:
    """A step on a device profile: decode round of the one-token chunks + a prefill per longer chunk."""

    def __init__(self, speed):
        self.speed = speed

    def seconds(self, chunks: Sequence[ChunkShape]) -> float:
        decodes = [h + 1 for c, h in chunks if c == 1]
        t = 0.0
        if decodes:
            t += self.speed.decode_step(len(decodes), -(-sum(decodes) // len(decodes))).seconds
        for c, h in chunks:
            if c > 1:
                t += self.speed.prefill(1, c, h).seconds
        if math.isnan(t):
            raise UsageError("the device profile has no speed figures for this model", flag="--device",
                             hint="use --step-model FIXED_MS,PER_TOKEN_US,PER_PAIR_NS instead")
        return t


def chunk_for_target(model: StepModel, target_s: float, others: Sequence[ChunkShape], cached: int,
                     limit: int) -> int:
    """Largest c ≤ limit whose step (``others`` plus a chunk of c after ``cached``) stays ≤ target_s; 0 if none.
    Searched below ``ROW_CHUNK`` and from it apart: a row's pairs may cost more than a prompt's (``per_row_pair_s``),
    so a step can take less time with a chunk of 64 tokens than with one of 63, and the time grows with c only
    within each range."""
    def largest(lo: int, hi: int) -> int:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if model.seconds([*others, (mid, cached)]) <= target_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    if limit >= ROW_CHUNK and model.seconds([*others, (ROW_CHUNK, cached)]) <= target_s:
        return largest(ROW_CHUNK, limit)
    return largest(0, min(limit, ROW_CHUNK - 1))
