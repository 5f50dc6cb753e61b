"""One decoding step, plain or speculative, behind one signature.

State between steps (per sequence)::

    engine KV  = context            (tokens already evaluated)
    pending    = one token          (emitted, not yet evaluated)

A step evaluates ``pending`` (plus any draft tokens) and returns the new
tokens it emits; the last returned token is the new ``pending``.  After the
step the KV holds ``context + [pending] + accepted drafts`` - exactly the
returned tokens minus the last are new in the cache.  So the last token of a
finished reply is never written to the KV (docs/memory.md counts it so), and a
caller that stops early in the returned list trims the KV with ``engine.trim``.

The runner prefills the whole prompt with logits for its last token only,
samples the first reply token from them, and starts with that token as
``pending``.  (``prefill()`` below is the other valid start: evaluate
``prompt[:-1]`` and let the first step evaluate ``prompt[-1]``.)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from localinfer.backends.engine import Engine


class TokenSampler(Protocol):
    """What decoders need from sampling (implemented in localinfer.generation.sampling)."""

    greedy: bool
    constraint: object | None      # a generation.constraints.Constraint the draws keep to, or None

    def probs(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The final next-token distribution (after penalties, temperature, top-k/p, min-p)."""

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """Draw one token (argmax when greedy)."""

    def sample_from(self, probs: np.ndarray) -> int:
        """Draw one token from an already-final distribution (uses the sampler's RNG)."""


class History(Sequence):
    """``base[:n] + extra``, the history a sampler reads, without copying the context.

    A sampler reads at most its last ``repeat_last_n`` tokens; a slice copies only what it covers (a list,
    whatever sequence ``base`` is: a list, or a serving request's token view).
    """

    __slots__ = ("_base", "_extra", "_n")

    def __init__(self, base: Sequence[int], n: int, extra: list[int]):
        self._base, self._n, self._extra = base, n, extra

    def __len__(self) -> int:
        return self._n + len(self._extra)

    def __getitem__(self, i):
        n = self._n
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            head = list(self._base[start:min(stop, n)]) if start < n else []
            return head + self._extra[max(start - n, 0):max(stop - n, 0)]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._base[i] if i < n else self._extra[i - n]


@dataclass
class DecodeStats:
    """Per-generation counters; speculative decoders fill the draft fields."""

    rounds: int = 0            # engine evaluations during decode
    emitted: int = 0           # tokens returned by steps
    drafted: int = 0           # draft tokens proposed
    accepted: int = 0          # draft tokens accepted
    eval_seconds: float = 0.0  # time inside engine.eval during decode
    lookup_seconds: float = 0.0
    round_times: list[float] = field(default_factory=list, repr=False)

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def seconds_per_token(self) -> float:
        """Σ T_r / Σ N_r: the mean per-token time (not the mean of per-round ratios)."""
        total = sum(self.round_times)
        return total / self.emitted if self.emitted else 0.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "emitted": self.emitted, "drafted": self.drafted,
            "accepted": self.accepted, "acceptance": round(self.acceptance, 4),
            "tokens_per_round": round(self.tokens_per_round, 4),
            "seconds_per_token": self.seconds_per_token,
            "eval_seconds": self.eval_seconds, "lookup_seconds": self.lookup_seconds,
        }


class Decoder(Protocol):
    stats: DecodeStats

    def start(self, prompt: Sequence[int]) -> None:
        """Called once per generation with the whole prompt (lets drafters index it)."""

    def step(self, engine: Engine, context: list[int], pending: int, sampler: TokenSampler, seq: int = 0) -> list[int]:
        """Evaluate pending (+ drafts) and return the emitted tokens (>= 1)."""


class PlainDecoder:
    """One token per engine evaluation."""

    def __init__(self):
        self.stats = DecodeStats()

    def start(self, prompt: Sequence[int]) -> None:
        self.stats = DecodeStats()

    def step(self, engine: Engine, context: list[int], pending: int, sampler: TokenSampler, seq: int = 0) -> list[int]:
        t0 = time.perf_counter()
        logits = engine.eval([pending], seq=seq)[0]
        t1 = time.perf_counter()
        token = sampler.sample(logits, History(context, len(context), [pending]))
        self.stats.rounds += 1
        self.stats.emitted += 1
        self.stats.eval_seconds += t1 - t0
        self.stats.round_times.append(time.perf_counter() - t0)
        return [token]


def prefill(engine: Engine, prompt: Sequence[int], seq: int = 0) -> int:
    """Evaluate prompt[:-1] (no logits) and return prompt[-1] as the pending token."""
    if not prompt:
        raise ValueError("empty prompt")
    if len(prompt) > 1:
        engine.eval(list(prompt[:-1]), logits_at=[], seq=seq)
    return prompt[-1]
