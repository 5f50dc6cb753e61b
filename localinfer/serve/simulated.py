"""An executor with no model: a virtual clock and deterministic tokens, for replaying traces.

Each ``step`` advances the clock by a step-time model over the chunks' shapes
(c new tokens after h held: N = c·h + c(c+1)/2 causal pairs) and returns, for
each row asked, a one-hot logits row whose token depends only on the sequence
(its last token and position), so a request gets the same output alone, in a
batch, or recomputed after a preemption.

KV cells are modelled as llama.cpp holds them: ``copy`` makes the destination
slot share the source's cells (a cell may carry several sequences), ``drop``
forgets them, and ``cells_used`` counts distinct cells.  ``restore`` brings back
a prefix kept in the cache pool that no slot holds any more (new cells).

With ``state_bytes`` the model has a recurrent state of that size per sequence (``snapshots``): ``snapshot``
saves it to host memory and ``rewind`` writes one back, each moving ``state_bytes`` over ``state_bandwidth``
bytes/s on the clock (SPEC.md §8.3's hybrid models: reuse only from a snapshot).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

import numpy as np

from localinfer.backends.executor import Chunk, ExecutorBase, SeqState
from localinfer.serve.step_model import StepModel


class SimulatedExecutor(ExecutorBase):
    restores_cached_prefix = True    # the KV pool keeps unreferenced cached blocks readable
    verifies_drafts = True           # honours Chunk.n_logits

    def __init__(self, step_model: StepModel, n_slots: int = 1024, n_vocab: int = 4096, start_s: float = 0.0,
                 state_bytes: int = 0, state_bandwidth: float = 32e9):
        if state_bytes < 0 or not state_bandwidth > 0:
            raise ValueError(f"a state of {state_bytes} bytes moved at {state_bandwidth} bytes/s")
        self.step_model = step_model
        self.state_bytes = int(state_bytes)
        self.snapshots = self.state_bytes > 0
        self.state_bandwidth = float(state_bandwidth)
        self.state_seconds = 0.0     # clock time spent saving and restoring states
        self.n_slots = n_slots
        self.n_vocab = n_vocab
        self.now = float(start_s)
        self.steps = 0
        self._cells: dict[int, list[int]] = {}
        self._last: dict[int, int] = {}
        self._ids = count()

    def token_for(self, last: int, position: int) -> int:
        """The deterministic next token after ``last`` at ``position``."""
        return (int(last) * 1_000_003 + position * 7919 + 1) % self.n_vocab

    def step(self, chunks: Sequence[Chunk]) -> dict[int, np.ndarray]:
        seen = set()
        for ch in chunks:
            if not 0 <= ch.slot < self.n_slots or ch.slot in seen or not ch.tokens:
                raise ValueError(f"bad chunk for slot {ch.slot}: slots must be distinct, below {self.n_slots}, "
                                 "with at least one token")
            held = len(self._cells.get(ch.slot, ()))
            if ch.start != held:
                raise ValueError(f"slot {ch.slot} holds {held} positions; a chunk cannot start at {ch.start}")
            seen.add(ch.slot)
        self.now += self.step_model.seconds([(len(ch.tokens), ch.start) for ch in chunks])
        self.steps += 1
        out = {}
        for ch in chunks:
            cells = self._cells.setdefault(ch.slot, [])
            cells.extend(next(self._ids) for _ in ch.tokens)
            self._last[ch.slot] = ch.tokens[-1]
            if ch.logits:
                n = len(ch.tokens)
                rows = np.zeros((ch.n_logits, self.n_vocab), dtype=np.float32)
                for i, j in enumerate(range(n - ch.n_logits, n)):
                    rows[i, self.token_for(ch.tokens[j], ch.start + j + 1)] = 1.0
                out[ch.slot] = rows[0] if ch.n_logits == 1 else rows
        return out

    def copy(self, src: int, dst: int, n_tokens: int, *, append: bool = False) -> int:
        cells = self._cells.get(src, [])
        if n_tokens > len(cells):
            raise ValueError(f"slot {src} holds {len(cells)} positions, cannot share {n_tokens}")
        have = self._cells.get(dst, [])
        if have and not append:
            raise ValueError(f"slot {dst} is not empty")
        self._cells[dst] = have + cells[len(have):n_tokens]
        return n_tokens

    def restore(self, slot: int, n_tokens: int) -> None:
        """Slot positions up to n_tokens come back from the cache pool (cells of their own)."""
        cells = self._cells.setdefault(slot, [])
        cells.extend(next(self._ids) for _ in range(n_tokens - len(cells)))

    def rebase(self, dst: int, src: int, n_tokens: int) -> None:
        """Slot ``dst``'s first positions become ``src``'s cells (it computed the same tokens itself)."""
        mine, theirs = self._cells.get(dst, []), self._cells.get(src, [])
        if not 0 < n_tokens <= min(len(mine), len(theirs)):
            raise ValueError(f"slots {src} and {dst} cannot share {n_tokens} positions")
        mine[:n_tokens] = theirs[:n_tokens]

    def snapshot(self, slot: int) -> SeqState:
        """The slot's state at the positions it holds: its bytes copied to host memory on the clock."""
        if not self.snapshots:
            raise ValueError("this simulated model has no recurrent state (state_bytes 0)")
        self._move_state()
        return SeqState(len(self._cells.get(slot, ())), self.state_bytes)

    def rewind(self, slot: int, state: SeqState) -> None:
        """The slot back to ``state.n_tokens`` positions, the state's bytes written back on the clock."""
        cells = self._cells.get(slot, [])
        if not 0 < state.n_tokens <= len(cells):
            raise ValueError(f"slot {slot} holds {len(cells)} positions; cannot rewind it to {state.n_tokens}")
        del cells[state.n_tokens:]
        self._move_state()

    def _move_state(self) -> None:
        dt = self.state_bytes / self.state_bandwidth
        self.now += dt
        self.state_seconds += dt

    def drop(self, slot: int, start: int = 0) -> None:
        if slot in self._cells:
            del self._cells[slot][start:]

    def cells_used(self) -> int:
        return len(set().union(*self._cells.values())) if self._cells else 0

    def clock(self) -> float:
        return self.now

    def idle_until(self, t: float) -> None:
        """Idle until ``t`` (nothing to compute before the next arrival): the virtual clock jumps there."""
        self.now = max(self.now, float(t))
