"""A serving request with OpenAI's extra sampling knobs: banned EOS, logit bias, presence/frequency penalties,
logprobs, and a grammar (structured output, tool calls: :mod:`localinfer.generation.constraints`).

Penalties follow OpenAI's definition over the tokens generated so far
(``c[t]`` = times t was generated)::

    logit[t] -= c[t] * frequency_penalty + (c[t] > 0) * presence_penalty

A constrained request's mask applies first (the sampler's ``constraint``), and a
reply whose grammar is complete ends there with reason stop.  Logprobs are the model's own: log-softmax of the raw logits row (before
penalties, filters and temperature), as OpenAI and vLLM report them; the
top alternatives are the ``k`` largest of that row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from localinfer.generation.constraints import Constraint
from localinfer.generation.sampling import Sampler, SamplingParams
from localinfer.serve.request import FinishReason, Request


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]    # (token, logprob), likeliest first


@dataclass(eq=False)
class ServeRequest(Request):
    """A :class:`Request` whose sampler bans EOS (``ignore_eos``), applies penalties and records logprobs."""

    banned: frozenset[int] = frozenset()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int | None = None        # None: no logprobs recorded
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token, bias) added to the raw logits (OpenAI's logit_bias)
    constraint: Constraint | None = None    # the reply's grammar
    logprobs: list[TokenLogprob] = field(default_factory=list, init=False)

    @property
    def sampler(self) -> Sampler:
        if self._sampler is None:
            self._sampler = ServeSampler(self)
        return self._sampler

    def append(self, token: int, now: float) -> FinishReason | None:
        reason = super().append(token, now)
        c = self.constraint
        if reason is None and c is not None and (c.stopped_after(len(self.output)) or c.failed):
            return FinishReason.STOP
        return reason

    def finish(self, reason: FinishReason, now: float, error: str | None = None) -> None:
        """Finished: its grammar state goes with it (a server keeps a request's record until its reply is sent)."""
        super().finish(reason, now, error)
        self.constraint = None
        if self._sampler is not None:
            self._sampler.constraint = None


class ServeSampler(Sampler):
    def __init__(self, request: ServeRequest):
        super().__init__(request.sampling, banned=request.banned, constraint=request.constraint)
        self.request = request
        self._counts: dict[int, int] = {}
        self._seen = 0

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        r = self.request
        raw = logits
        if r.logit_bias:
            logits = np.array(logits, dtype=np.float32)
            for t, b in r.logit_bias:
                logits[t] += b
        if r.presence_penalty or r.frequency_penalty:
            logits = self._penalized(np.asarray(logits, dtype=np.float32))
        token = super().sample(logits, history)
        if r.top_logprobs is not None:
            r.logprobs.append(logprob_of(raw, token, r.top_logprobs))
        return token

    def _penalized(self, logits: np.ndarray) -> np.ndarray:
        out = self.request.output
        for t in out[self._seen:]:
            self._counts[t] = self._counts.get(t, 0) + 1
        self._seen = len(out)
        if not self._counts:
            return logits
        ids = np.fromiter(self._counts, dtype=np.int64, count=len(self._counts))
        c = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
        logits = logits.copy()
        logits[ids] -= c * self.request.frequency_penalty + self.request.presence_penalty
        return logits


def logprob_of(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """log p(token) and the k likeliest tokens' log p under softmax(logits)."""
    x = np.asarray(logits, dtype=np.float64)
    m = float(np.max(x))
    lse = m + float(np.log(np.sum(np.exp(x - m))))
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        ids = np.argpartition(-x, k - 1)[:k] if k < x.shape[0] else np.arange(x.shape[0])
        ids = ids[np.argsort(-x[ids], kind="stable")]
        top = tuple((int(i), float(x[i] - lse)) for i in ids)
    return TokenLogprob(int(token), float(x[token] - lse), top)


def sampling_for(params: SamplingParams, seed_offset: int) -> SamplingParams:
    """The i-th of n choices: the same parameters, the seed (if any) moved by i so choices differ."""
    if params.seed is None or not seed_offset:
        return params
    return params.with_(seed=(params.seed + seed_offset) % (1 << 64))
