"""Step times measured on the running server, fitted to the linear step model the scheduler predicts with.

The model is :class:`~localinfer.serve.step_model.LinearStepModel` (docs/serving.md:
``T = fixed + per_token·Σc + per_pair·ΣN``, N the causal pairs of each chunk).
:class:`TimedExecutor` wraps the executor, times every step and keeps the last
``window`` (shape, seconds) pairs; read after ``refit`` more steps, a non-negative least-squares
fit over them replaces the coefficients, so deadline-aware admission and the
ITL-target chunk size follow what this machine really does (threads, other load).
Before any step the model is seeded by :func:`calibrate` (one decode step and
one prefill of ``n`` tokens).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

from localinfer.model.cost import attention_pairs
from localinfer.backends.executor import Chunk, ExecutorWrapper
from localinfer.serve.step_model import LinearStepModel


class FittedStepModel:
    """A LinearStepModel whose coefficients are refitted from measured steps (thread-safe reads).

    The fit is made when the model is read (``model``, ``seconds``) and ``refit`` steps have been observed since the
    last one, not as steps are observed: the engine thread observes every step between two forward passes, and a
    server whose scheduler never predicts (no deadline, ITL target, gap bound or decode share) reads it only for
    the engine view.  Observing is an append under a lock that a fit holds only to copy the observations."""

    def __init__(self, initial: LinearStepModel, *, window: int = 512, refit: int = 32):
        self._model = initial
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)   # (tokens, pairs, seconds)
        self._refit, self._since = refit, 0
        self._lock = threading.Lock()

    @property
    def model(self) -> LinearStepModel:
        """The coefficients fitted to the last ``window`` steps (refitted here once ``refit`` more were observed)."""
        if self._since >= self._refit and len(self._obs) >= 8:
            with self._lock:                      # a copy under the lock, the fit outside it: observe never waits
                obs = np.array(self._obs) if self._since >= self._refit else None    # not fitted meanwhile
                self._since = 0
            if obs is not None:
                self._model = robust_fit(obs, self._model)
        return self._model

    def seconds(self, chunks: Sequence[tuple[int, int]]) -> float:
        return self.model.seconds(chunks)

    def observe(self, shapes: Sequence[tuple[int, int]], seconds: float) -> None:
        tokens = sum(c for c, _ in shapes)
        pairs = sum(attention_pairs(c, h) for c, h in shapes)
        with self._lock:
            self._obs.append((tokens, pairs, seconds))
            self._since += 1


def robust_fit(obs: np.ndarray, old: LinearStepModel, slack: float = 1.5) -> LinearStepModel:
    """:func:`_fit` without the steps the machine stalled: after a first fit, the observations more than ``slack``
    times their prediction (another process took the CPU, a page fault, a graph rebuilt) are dropped and the rest
    fitted again.  A plain least-squares fit follows them up: a few 2 s stalls among 35 ms steps doubled every
    prediction, and the gap bound (``max_gap_s``) then cut prompt chunks to nothing."""
    first = _fit(obs, old)
    pred = first.fixed_s + first.per_token_s * obs[:, 0] + first.per_pair_s * obs[:, 1]
    calm = obs[obs[:, 2] <= slack * pred + 1e-3]
    return _fit(calm, first) if len(calm) >= 8 and len(calm) < len(obs) else first


def _fit(obs: np.ndarray, old: LinearStepModel) -> LinearStepModel:
    """Least squares T ≈ a + b·tokens + c·pairs with a, b, c ≥ 0 (drop a term that comes out negative)."""
    X = np.column_stack([np.ones(len(obs)), obs[:, 0], obs[:, 1]])
    y = obs[:, 2]
    keep = [0, 1, 2]
    for _ in range(3):
        coef, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        if (coef >= 0).all():
            full = np.zeros(3)
            full[keep] = coef
            if full.sum() <= 0:
                return old
            return LinearStepModel(float(full[0]), float(full[1]), float(full[2]))
        keep = [k for k, c in zip(keep, coef) if c >= 0] or [0]
    return old


class TimedExecutor(ExecutorWrapper):
    """An executor that forwards every call and reports each step's shapes and wall time to a FittedStepModel."""

    def __init__(self, inner, model: FittedStepModel | None = None):
        super().__init__(inner)
        self.model = model
        self.steps = 0
        self.step_seconds = 0.0

    @property
    def decode_seconds(self) -> float:
        """Seconds inside the backend's forward passes (0 where it does not count them)."""
        return self.inner.decode_seconds

    def step(self, chunks: Sequence[Chunk]):
        t0 = self.inner.clock()
        try:
            rows = self.inner.step(chunks)
        finally:
            dt = self.inner.clock() - t0
            self.step_seconds += dt
            self.steps += 1
        if chunks and self.model is not None:
            self.model.observe([(len(c.tokens), c.start) for c in chunks], dt)
        return rows


def calibrate(executor, n: int = 64) -> LinearStepModel:
    """Seed coefficients from two steps on slot 0 (a prefill of n tokens, then one decode), dropped afterwards.

    A paging executor (``block_size``) gets the pool's first blocks as slot 0's table (before any block
    manager hands blocks out)."""
    caps = executor.caps
    cells = min(c for c in (caps.n_cells, caps.slot_cells, n + 1) if c)
    n = max(2, min(n, cells - 1))
    tokens = tuple(i % max(1, executor.n_vocab - 1) + 1 for i in range(n))
    p = caps.block_size
    blocks = tuple(range(-(-(n + 1) // p))) if p else ()
    t0 = executor.clock()
    executor.step([Chunk(0, tokens, 0, True, blocks=blocks)])
    t1 = executor.clock()
    executor.step([Chunk(0, (1,), n, True, blocks=blocks)])
    t2 = executor.clock()
    executor.drop(0)
    decode, prefill = t2 - t1, t1 - t0
    per_token = max(0.0, (prefill - decode) / (n - 1))
    return LinearStepModel(max(decode - per_token, 1e-4), per_token, 0.0)
