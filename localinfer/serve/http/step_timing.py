"""Step times measured on the running server, fitted to the linear step model the scheduler predicts with.

The model is :class:`~localinfer.serve.step_model.LinearStepModel` (docs/serving.md:
``T = fixed + per_token·Σc + per_pair·ΣN + per_seq·chunks``, N the causal pairs of each chunk).
:class:`TimedExecutor` wraps the executor, times every step and keeps the last
``window`` (shape, seconds) pairs; read after ``refit`` more steps, a non-negative least-squares
fit over them replaces the coefficients, so deadline-aware admission and the
ITL-target chunk size follow what this machine really does (threads, other load).
Before any step the model is seeded by :func:`calibrate` (a prefill of ``n`` tokens, one decode step, and a
step of two one-token chunks).  A term per chunk keeps decode rows and prompt tokens apart: on a CPU a decode row
costs about twice a prompt token (its logits row, its own pass over the KV), and a model with one per-token
coefficient, fitted mostly on prompt steps, predicted a 6-row decode step at 34 ms that took 46: deadline-aware
admission then let a burst of prompts in that made each other late (6 of 18 admitted requests cut at their
deadline at 1 request/s on the 2-vCPU VM).
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
        self._obs: deque[tuple[float, float, float, float]] = deque(maxlen=window)   # (tokens, pairs, chunks, s)
        self._refit, self._since = refit, 0
        self.fits = 0           # refits made (the scheduler's deadline predictions watch it)
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
                self.fits += 1
        return self._model

    def seconds(self, chunks: Sequence[tuple[int, int]]) -> float:
        return self.model.seconds(chunks)

    def observe(self, shapes: Sequence[tuple[int, int]], seconds: float) -> None:
        tokens = sum(c for c, _ in shapes)
        pairs = sum(attention_pairs(c, h) for c, h in shapes)
        with self._lock:
            self._obs.append((tokens, pairs, len(shapes), seconds))
            self._since += 1


def robust_fit(obs: np.ndarray, old: LinearStepModel, slack: float = 1.5) -> LinearStepModel:
    """:func:`_fit` without the steps the machine stalled: after a first fit, the observations more than ``slack``
    times their prediction (another process took the CPU, a page fault, a graph rebuilt) are dropped and the rest
    fitted again.  A plain least-squares fit follows them up: a few 2 s stalls among 35 ms steps doubled every
    prediction, and the gap bound (``max_gap_s``) then cut prompt chunks to nothing."""
    first = _fit(obs, old)
    pred = first.fixed_s + first.per_token_s * obs[:, 0] + first.per_pair_s * obs[:, 1] + first.per_seq_s * obs[:, 2]
    calm = obs[obs[:, 3] <= slack * pred + 1e-3]
    return _fit(calm, first) if len(calm) >= 8 and len(calm) < len(obs) else first


def _fit(obs: np.ndarray, old: LinearStepModel) -> LinearStepModel:
    """Least squares T ≈ a + b·tokens + c·pairs + d·chunks with a, b, c, d ≥ 0 (drop a term that comes out
    negative).  What the steps observed cannot tell apart keeps the old model's split: with as many chunks in every
    step, the fixed time and the chunks' (a + k·d); with one token a chunk throughout (decode steps only), a row's
    token and chunk (b + d)."""
    tokens, pairs, chunks, y = obs[:, 0], obs[:, 1], obs[:, 2], obs[:, 3]
    k = float(chunks[0])
    same_k = bool((chunks == k).all())
    rows = not same_k and bool(np.array_equal(tokens, chunks))
    cols = [np.ones(len(obs)), tokens, pairs] + ([] if same_k or rows else [chunks])
    X = np.column_stack(cols)
    keep = list(range(len(cols)))
    for _ in range(len(cols)):
        coef, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        if (coef >= 0).all():
            full = np.zeros(4)
            full[keep] = coef
            if full.sum() <= 0:
                return old
            if same_k:              # a = fixed + k·per_seq: the old per-chunk time, as much of it as a holds
                full[3] = min(old.per_seq_s, full[0] / k) if k > 0 else 0.0
                full[0] -= k * full[3]
            elif rows:              # b = per_token + per_seq: split as the old model split a row
                total = old.per_token_s + old.per_seq_s
                share = old.per_seq_s / total if total > 0 else 0.0
                full[1], full[3] = full[1] * (1 - share), full[1] * share
            return LinearStepModel(float(full[0]), float(full[1]), float(full[2]), float(full[3]))
        keep = [i for i, c in zip(keep, coef) if c >= 0] or [0]
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
    """Seed coefficients from steps on slots 0 and 1 (a prefill of n tokens on slot 0, then one decode; then,
    where there are two slots and cells for both, steps of slot 0's decode beside slot 1's first token, the
    faster of two, whose extra time over the decode is one more token and one more chunk), dropped afterwards.

    A paging executor (``block_size``) gets the pool's first blocks as the slots' tables (before any block
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
    decode, prefill = t2 - t1, t1 - t0
    per_token = max(0.0, (prefill - decode) / (n - 1))
    per_seq = 0.0
    longer = tuple(range(-(-(n + 3) // p))) if p else ()                      # slot 0's n + 3 positions
    other = tuple(range(len(longer), len(longer) + -(-2 // p))) if p else ()  # slot 1's two
    need = (len(longer) + len(other)) * p if p else n + 5
    if (getattr(executor, "n_slots", 1) >= 2 and (not caps.n_cells or caps.n_cells >= need)
            and (not caps.slot_cells or caps.slot_cells >= n + 3)):
        pair = []
        for k in range(2):        # the first of a new shape may pay for its graph: the faster of two
            t = executor.clock()
            executor.step([Chunk(0, (1,), n + 1 + k, True, blocks=longer), Chunk(1, (1,), k, True, blocks=other)])
            pair.append(executor.clock() - t)
        executor.drop(1)
        per_seq = min(max(0.0, min(pair) - decode - per_token), max(0.0, decode - per_token - 1e-4))
    executor.drop(0)
    return LinearStepModel(max(decode - per_token - per_seq, 1e-4), per_token, 0.0, per_seq)
