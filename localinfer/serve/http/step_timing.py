"""Step times measured on the running server, fitted to the linear step model the scheduler predicts with.

The model is :class:`~localinfer.serve.step_model.LinearStepModel` (docs/serving.md:
``T = fixed + per_token·Σc + per_pair·ΣN + per_row_pair·ΣN' + per_seq·chunks + per_held·ΣH``, N the causal pairs
of each chunk of ``ROW_CHUNK`` tokens or more, N' those of shorter ones: decode rows, H the positions held before
each of the longer ones).
:class:`TimedExecutor` wraps the executor, times every step and keeps the last
``window`` (shape, seconds) pairs; read after ``refit`` more steps, a non-negative least-squares
fit over them replaces the coefficients, so deadline-aware admission and the
ITL-target chunk size follow what this machine really does (threads, other load).
Before any step the model is seeded by :func:`calibrate` (a prefill of ``n`` tokens, three decode steps, a
step of two one-token chunks, and a decode row and a prompt over placeholder positions).  A term per chunk keeps
decode rows and prompt tokens apart: on a CPU a decode row costs about twice a prompt token (its logits row, its
own pass over the KV), and a model with one per-token coefficient, fitted mostly on prompt steps, predicted a 6-row
decode step at 34 ms that took 46: deadline-aware admission then let a burst of prompts in that made each other
late (6 of 18 admitted requests cut at their deadline at 1 request/s on the 2-vCPU VM).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

from localinfer.backends.executor import Chunk, ExecutorWrapper
from localinfer.errors import LocalinferError
from localinfer.model.cost import attention_pairs
from localinfer.serve.step_model import LinearStepModel, features


class FittedStepModel:
    """A LinearStepModel whose coefficients are refitted from measured steps (thread-safe reads).

    The fit is made when the model is read (``model``, ``seconds``) and ``refit`` steps have been observed since the
    last one, not as steps are observed: the engine thread observes every step between two forward passes, and a
    server whose scheduler never predicts (no deadline, ITL target, gap bound or decode share) reads it only for
    the engine view.  Observing is an append under a lock that a fit holds only to copy the observations."""

    def __init__(self, initial: LinearStepModel, *, window: int = 512, refit: int = 32):
        self._model = initial
        self._obs: deque[tuple[float, ...]] = deque(maxlen=window)   # (step_model.features, seconds)
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
        row = (*features(shapes), seconds)
        with self._lock:
            self._obs.append(row)
            self._since += 1


def robust_fit(obs: np.ndarray, old: LinearStepModel, slack: float = 1.5) -> LinearStepModel:
    """:func:`_fit` without the steps the machine stalled: after a first fit, the observations more than ``slack``
    times their prediction (another process took the CPU, a page fault, a graph rebuilt) are dropped and the rest
    fitted again.  A plain least-squares fit follows them up: a few 2 s stalls among 35 ms steps doubled every
    prediction, and the gap bound (``max_gap_s``) then cut prompt chunks to nothing."""
    first = _fit(obs, old)
    calm = obs[obs[:, -1] <= slack * (_design(obs) @ np.array(first.coefficients)) + 1e-3]
    return _fit(calm, first) if len(calm) >= 8 and len(calm) < len(obs) else first


def _fit(obs: np.ndarray, old: LinearStepModel) -> LinearStepModel:
    """Least squares T ≈ a + b·tokens + c·pairs + e·row pairs + d·chunks + f·held (``step_model.features``) with every
    coefficient ≥ 0 (a term that comes out negative is dropped and the rest fitted again).  What the
    steps observed cannot tell apart keeps the old model's split: the fit moves the coefficients along the
    directions the observations leave open (:func:`_solve`) only as far as it must, each in proportion to its old
    value (a token's hardly: ``GIVE``).  With one decode row a step throughout (a long reply alone), tokens, chunks
    and the constant are one column: the row's measured time is split between the fixed time and a chunk, a prompt
    token and a prompt's pairs keeping their old price, where a minimum-norm solution halved it between the fixed
    time and a token and priced a 300-token prompt at 1.8 times its cost."""
    X, y = _design(obs), obs[:, -1]
    prior = np.array(old.coefficients)
    keep = list(range(X.shape[1]))
    for _ in range(X.shape[1]):
        coef = _solve(X[:, keep], y, prior[keep], GIVE[keep])
        coef[np.abs(coef) < 1e-15] = 0.0
        if (coef >= 0).all():
            full = np.zeros(X.shape[1])
            full[keep] = coef
            if full.sum() <= 0:
                return old
            fixed, token, pair, row, seq, held = (float(v) for v in full)
            return LinearStepModel(fixed, token, pair, seq, row, held)
        keep = [i for i, c in zip(keep, coef) if c >= 0] or [0]
    return old


# how readily each coefficient (fixed, token, pair, row pair, chunk, held) takes a change the steps leave open: a prompt
# token's price is told only by prompt steps, so in a window without one the fixed time and a chunk's take the decode
# rows' change (moved in proportion, a token's too, an intercept extrapolated from rows 300-1,000 positions long --
# where the machine's drift over one long reply reads as a slope -- priced a prompt 0.72x)
GIVE = np.array([1.0, 1e-3, 1.0, 1.0, 1.0, 1.0])


def _design(obs: np.ndarray) -> np.ndarray:
    """The observations' columns the coefficients weigh: a constant, then their features."""
    return np.column_stack([np.ones(len(obs)), obs[:, :-1]])


def _solve(X: np.ndarray, y: np.ndarray, prior: np.ndarray, give: np.ndarray, rcond: float = 1e-8) -> np.ndarray:
    """The least-squares coefficients of ``X`` for ``y`` nearest ``prior`` where the observations leave them open
    (``X``'s null space, its columns scaled to one size first, so a rare prompt step still tells a token from the
    constant): among the equally good fits, the one least far from ``prior`` in Σ (θ − prior)² / (prior·give),
    which moves each open coefficient in proportion to its prior value times its ``give`` (one at 0 stays)."""
    scale = np.sqrt(np.mean(X * X, axis=0))
    scale[scale == 0] = 1.0
    U, S, Vt = np.linalg.svd(X / scale, full_matrices=False)
    rank = int((S > S[0] * rcond).sum()) if S.size and S[0] > 0 else 0
    theta = Vt[:rank].T @ ((U[:, :rank].T @ y) / S[:rank]) / scale
    if rank < X.shape[1]:
        null = Vt[rank:].T / scale[:, None]                  # X @ null ≈ 0: the directions the steps leave open
        w = np.maximum(prior, 1e-6 * max(float(prior.max()), 1e-9)) * give
        shift, *_ = np.linalg.lstsq(null / np.sqrt(w)[:, None], (prior - theta) / np.sqrt(w), rcond=None)
        theta = theta + null @ shift
    return theta


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


WIDE = 2048     # positions of calibration's long decode row (from it: a row's cost per position it attends to)
DECODES = 3     # calibration's decode steps, the fastest taken: a server started beside its clients' start-up
                # (a load generator importing its libraries on the same two cores) timed its one decode at 85 ms
                # where it takes 11, and priced every step 8x until its first refit


def calibrate(executor, n: int = 64) -> LinearStepModel:
    """Seed coefficients from steps on slots 0 and 1 (a prefill of n tokens on slot 0, then ``DECODES`` decodes,
    the fastest; then, where there are two slots and cells for both, steps of slot 0's decode beside slot 1's first
    token, the faster of two, whose extra time over the decode is one more token and one more chunk; then a decode
    row and a prompt of n tokens ``WIDE`` positions in: :func:`_wide`), dropped afterwards.  A prompt's pairs and a
    decode row's are priced apart: its tiles share the walk over its cells (a CPU's row pays 4.8-6.4 µs a pair, a
    64-token chunk 1.4, a 512-token chunk ~0.7: its price from the 64 is on the safe side), and one price for both
    priced a 300-token prompt 27% long.  A held position's price (``per_held_s``) is left 0: one chunk length cannot
    tell it from a pair's, which takes it up.

    A paging executor (``block_size``) gets the pool's first blocks as the slots' tables (before any block
    manager hands blocks out)."""
    caps = executor.caps
    cells = min(c for c in (caps.n_cells, caps.slot_cells, n + DECODES) if c)
    n = max(2, min(n, cells - DECODES))
    decodes = max(1, min(DECODES, cells - n))
    tokens = tuple(i % max(1, executor.n_vocab - 1) + 1 for i in range(n))
    p = caps.block_size
    blocks = tuple(range(-(-(n + decodes) // p))) if p else ()
    t0 = executor.clock()
    executor.step([Chunk(0, tokens, 0, True, blocks=blocks)])
    prefill = executor.clock() - t0
    steps = []
    for k in range(decodes):
        t = executor.clock()
        executor.step([Chunk(0, (1,), n + k, True, blocks=blocks)])
        steps.append(executor.clock() - t)
    decode = min(steps)
    per_token = max(0.0, (prefill - decode) / (n - 1))
    per_seq = 0.0
    held = n + decodes                                                        # slot 0's positions now
    longer = tuple(range(-(-(held + 2) // p))) if p else ()                   # slot 0's after two more
    other = tuple(range(len(longer), len(longer) + -(-2 // p))) if p else ()  # slot 1's two
    need = (len(longer) + len(other)) * p if p else held + 4
    if (getattr(executor, "n_slots", 1) >= 2 and (not caps.n_cells or caps.n_cells >= need)
            and (not caps.slot_cells or caps.slot_cells >= held + 2)):
        pair = []
        for k in range(2):        # the first of a new shape may pay for its graph: the faster of two
            t = executor.clock()
            executor.step([Chunk(0, (1,), held + k, True, blocks=longer), Chunk(1, (1,), k, True, blocks=other)])
            pair.append(executor.clock() - t)
        executor.drop(1)
        per_seq = min(max(0.0, min(pair) - decode - per_token), max(0.0, decode - per_token - 1e-4))
        held += 2
    pairs = n + 1 + steps.index(decode)                 # the fastest decode's row: its position + 1
    per_row_pair, per_pair = _wide(executor, held, decode, pairs, tokens, prefill)
    executor.drop(0)
    fixed = max(decode - per_token - per_seq - per_row_pair * pairs, 1e-4)
    return LinearStepModel(fixed, per_token, per_pair, per_seq, per_row_pair)


def _wide(executor, held: int, decode: float, pairs: int, prompt: tuple, prefill: float,
          wide: int = WIDE) -> tuple[float, float]:
    """(a decode row's, a prompt's) cost per pair: a row ``wide`` positions long against calibrate's (``decode``
    seconds over ``pairs``), the faster of two, then ``prompt`` after it against its first prefill (``prefill``
    seconds from position 0).  Slot 1's positions are placeholders (``fill``: slot 0's K and V repeated, nothing
    computed).  (0, 0) where the executor cannot fill them or has no room."""
    fill, caps, n = getattr(executor, "fill", None), executor.caps, len(prompt)
    room = n + 2
    wide = min(wide, (caps.slot_cells or wide + room) - room, (caps.n_cells or wide + held + room) - held - room)
    if fill is None or caps.block_size or getattr(executor, "n_slots", 1) < 2 or wide <= 4 * pairs:
        return 0.0, 0.0
    rows, prompts = [], []
    try:
        got = fill(0, 1, wide)
        if got <= 4 * pairs:          # too few to tell a position's price from the steps' noise (a big model's KV)
            return 0.0, 0.0
        for k in range(3):            # two decodes (the faster taken), then the prompt once (a load-time prefill)
            t = executor.clock()
            executor.step([Chunk(1, (1,), got + k, True)] if k < 2 else [Chunk(1, prompt, got + 2, True)])
            (rows if k < 2 else prompts).append(executor.clock() - t)
    except (LocalinferError, ValueError, MemoryError):     # a measurement only: the model loads without it
        return 0.0, 0.0
    finally:
        executor.drop(1)
    per_row = max(0.0, (min(rows) - decode) / (got + 1 + rows.index(min(rows)) - pairs))
    return per_row, max(0.0, (min(prompts) - prefill) / (attention_pairs(n, got + 2) - attention_pairs(n, 0)))
