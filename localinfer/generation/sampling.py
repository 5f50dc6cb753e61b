"""Next-token sampling: one parameter dataclass and a numpy sampler.

The order follows llama.cpp's default chain: repetition penalty over the last
``repeat_last_n`` tokens, then top-k, top-p and min-p on the untempered
distribution, then temperature over the survivors, and a draw.
``temperature == 0`` (or ``greedy=True``) is argmax.  Filtering works on a
small candidate set: a step costs a partial sort of the vocabulary, not a full one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

from localinfer.errors import UsageError

MAX_TEMPERATURE = 100.0
MAX_REPEAT_PENALTY = 100.0
MAX_SEED = 2**64 - 1
MAX_TOKENS_LIMIT = 1 << 24  # no context is longer (spec.MAX_SANE_CONTEXT)
_PARTIAL = 256              # candidates sorted before falling back to a full sort for top-p


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.  Defaults are llama.cpp's.

    ``top_k=0``, ``top_p=1`` and ``min_p=0`` switch those filters off;
    ``repeat_penalty=1`` switches the penalty off; ``seed=None`` draws one.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    greedy: bool = False

    def __post_init__(self):
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE, "--temp")
        _check_int("top_k", self.top_k, 0, MAX_TOKENS_LIMIT, "--top-k")
        _check_float("top_p", self.top_p, 0.0, 1.0, "--top-p", low_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0, "--min-p")
        _check_float("repeat_penalty", self.repeat_penalty, 0.0, MAX_REPEAT_PENALTY, "--repeat-penalty", low_open=True)
        _check_int("repeat_last_n", self.repeat_last_n, 0, MAX_TOKENS_LIMIT, "--repeat-last-n")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED, "--seed")
        if not isinstance(self.greedy, bool):
            raise UsageError(f"greedy must be true or false, got {self.greedy!r}", flag="--greedy")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    def with_(self, **changes) -> SamplingParams:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def with_setting(self, key: str, text: str) -> SamplingParams:
        """A copy with one field parsed from text (for ``/set key=value``)."""
        key = _ALIASES.get(key, key)
        if key not in self.names():
            raise UsageError(f"unknown setting {key!r}", hint="settable: " + ", ".join(self.names()))
        kind = type(getattr(SamplingParams(), key))
        try:
            if key == "seed":
                value: Any = None if text.strip().lower() in ("none", "random", "-1") else int(text)
            elif key == "greedy":
                if text.strip().lower() not in ("true", "false", "1", "0", "on", "off"):
                    raise ValueError
                value = text.strip().lower() in ("true", "1", "on")
            elif kind is int:
                value = int(text)
            else:
                value = float(text)
        except ValueError:
            raise UsageError(f"{key} needs a {'number' if kind is float else 'whole number'}, got {text!r}") from None
        return self.with_(**{key: value})


_ALIASES = {"temp": "temperature", "repeat-penalty": "repeat_penalty",
            "top-k": "top_k", "top-p": "top_p", "min-p": "min_p"}


def _check_float(name, v, lo, hi, flag, low_open=False):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise UsageError(f"{name} must be a finite number, got {v!r}", flag=flag)
    if v < lo or v > hi or (low_open and v == lo):
        span = f"{'(' if low_open else '['}{lo:g}, {hi:g}]"
        raise UsageError(f"{name} must be in {span}, got {v!r}", flag=flag)


def check_max_tokens(n, flag: str = "--max-tokens") -> int:
    """Validate a reply length limit (at least 1, at most the longest possible context)."""
    _check_int("max_tokens", n, 1, MAX_TOKENS_LIMIT, flag)
    return int(n)


def _check_int(name, v, lo, hi, flag):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise UsageError(f"{name} must be a whole number, got {v!r}", flag=flag)
    if not lo <= v <= hi:
        raise UsageError(f"{name} must be between {lo} and {hi}, got {v}", flag=flag)


class Sampler:
    """Implements :class:`localinfer.generation.decoding.Sampler` for one SamplingParams."""

    def __init__(self, params: SamplingParams | None = None, *, banned: Iterable[int] = (), constraint=None):
        self.params = params or SamplingParams()
        self.constraint = constraint      # a generation.constraints.Constraint: its mask applies first
        self.banned = np.fromiter(banned, dtype=np.int64)
        self._banned = frozenset(int(t) for t in self.banned)
        seed = self.params.seed
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
        self.rng = np.random.Generator(np.random.PCG64(self.seed))

    @property
    def greedy(self) -> bool:
        return self.params.is_greedy

    @property
    def draws_unmasked_first(self) -> bool:
        """Whether a constrained draw may be made without the grammar's mask and kept when the grammar allows it:
        exactly the masked draw when greedy (the likeliest allowed token is the likeliest token if that one is
        allowed) and when only temperature and penalties shape the distribution (a draw from p kept only inside
        the allowed set A is a draw from p restricted to A: rejection sampling).  Not with top-k, top-p or min-p,
        which the mask must narrow first."""
        p = self.params
        return self.greedy or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0)

    # ---- the candidate set ---------------------------------------------------
    def _penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        p = self.params
        if len(self.banned):
            logits = logits.astype(np.float32, copy=True)
            logits[self.banned] = -np.inf
        if p.repeat_penalty == 1.0 or p.repeat_last_n == 0 or not history:
            return logits
        recent = np.unique(np.asarray(history[-p.repeat_last_n:], dtype=np.int64))
        recent = recent[(recent >= 0) & (recent < logits.shape[0])]
        out = logits.astype(np.float32, copy=True)
        vals = out[recent]
        out[recent] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        return out

    def candidates(self, logits: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) left after all filters; most likely first when top-p is on."""
        p = self.params
        logits = self._penalize(np.asarray(logits, dtype=np.float32), history)
        if self.greedy:
            return np.array([int(np.argmax(logits))]), np.ones(1)
        n = logits.shape[0]
        k = p.top_k if 0 < p.top_k < n else n
        ids = np.argpartition(-logits, k - 1)[:k] if k < n else np.arange(n)
        z = logits[ids]
        e = np.exp(z - z.max(), dtype=np.float32).astype(np.float64) if k == n else np.exp((z - z.max()).astype(np.float64))
        total = e.sum()
        if p.min_p > 0.0:
            keep = e >= p.min_p
            ids, e = ids[keep], e[keep]
        if p.top_p < 1.0:
            ids, e = _nucleus(ids, e, p.top_p * total)
        if p.temperature == 1.0:
            probs = e
        else:    # from the logits, not e ** (1/T): e underflows 87 nats below the top, e ** (1/T) would not
            probs = np.exp((logits[ids] - z.max()).astype(np.float64) / p.temperature)
        return ids, probs / probs.sum()

    # ---- the decoding.Sampler protocol ---------------------------------------
    def probs(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The final next-token distribution over the whole vocabulary."""
        if self.constraint is not None:
            logits = self.constraint.apply(logits)
        ids, pr = self.candidates(logits, history)
        out = np.zeros(np.asarray(logits).shape[0], dtype=np.float64)
        out[ids] = pr
        return out

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """One token: argmax when greedy, else a draw from the filtered distribution.  With a constraint, the
        draw is among the tokens its grammar allows, and the constraint consumes it: where that is the same (see
        ``draws_unmasked_first``), a draw without the mask is tried first and kept if the grammar allows it, so
        most tokens of a reply that follows its grammar cost no mask at all."""
        c = self.constraint
        if c is None:
            return self._draw(logits, history)
        if self.draws_unmasked_first:
            token = self._draw(logits, history)
            if c.allows(token):
                c.consume(token)
                return token
        token = self._draw(c.apply(logits), history)
        c.consume(token)
        return token

    def _draw(self, logits: np.ndarray, history: Sequence[int]) -> int:
        if self.greedy and (self.params.repeat_penalty == 1.0 or not history):
            token = int(np.argmax(logits))    # a banned token lowered to -inf moves the first maximum only if it is it
            if token not in self._banned:
                return token
        ids, pr = self.candidates(logits, history)
        if len(ids) == 1:
            return int(ids[0])
        return int(ids[min(int(np.searchsorted(np.cumsum(pr), self.rng.random(), side="right")), len(ids) - 1)])

    def sample_from(self, probs: np.ndarray) -> int:
        """Draw from an already-final distribution (e.g. speculative residuals)."""
        probs = np.asarray(probs, dtype=np.float64)
        nz = np.flatnonzero(probs > 0)
        if len(nz) == 0:
            raise ValueError("cannot sample from an all-zero distribution")
        cum = np.cumsum(probs[nz])
        return int(nz[min(int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right")), len(nz) - 1)])

    def argmax(self, logits: np.ndarray) -> int:
        return int(np.argmax(logits))


def _nucleus(ids: np.ndarray, e: np.ndarray, mass: float) -> tuple[np.ndarray, np.ndarray]:
    """The most likely candidates whose weights e first reach mass, largest first.

    Sorts the top few hundred first; the full sort runs only when they fall short.
    """
    m = len(e)
    if m > _PARTIAL:
        part = np.argpartition(-e, _PARTIAL - 1)[:_PARTIAL]
        part = part[np.argsort(-e[part], kind="stable")]
        cum = np.cumsum(e[part])
        if cum[-1] >= mass:
            cut = int(np.searchsorted(cum, mass)) + 1
            return ids[part[:cut]], e[part[:cut]]
    order = np.argsort(-e, kind="stable")
    cum = np.cumsum(e[order])
    cut = min(m, int(np.searchsorted(cum, mass)) + 1)
    return ids[order[:cut]], e[order[:cut]]
