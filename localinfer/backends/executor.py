"""The executor contract: what the scheduler hands a backend each step, and what it gets back.

A step is one batch: for each scheduled request its sequence slot, the new
tokens to append at consecutive positions from ``start``, and whether the last
new token's logits are wanted (``n_logits`` > 1: the last n_logits tokens', as a
speculative step verifying drafts needs).  The executor appends every chunk in one
forward pass (llama.cpp: one ``llama_decode`` whose tokens carry their own
sequence id) and returns, per chunk that asked, one logits row (``n_logits`` 1)
or an ``[n_logits, n_vocab]`` array.

Sequence slots are small integers below ``n_slots``.  ``copy`` makes a slot share
another's first tokens without recomputing them (a prefix-cache hit; llama.cpp:
``llama_memory_seq_cp``, the cells gain a second sequence id); ``drop`` forgets a
slot's positions from ``start`` on (``llama_memory_seq_rm``).  ``cells_used`` is
the number of KV cells holding at least one sequence's token, so the block
manager's count can be checked against the backend's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from localinfer.errors import ContextFullError


@dataclass(frozen=True)
class Chunk:
    """New tokens of one request in one step."""

    slot: int
    tokens: tuple[int, ...]
    start: int                # position of tokens[0]: how many tokens the slot already holds
    logits: bool = False      # return the logits row of the last new token
    n_logits: int = 1         # with logits: rows for this many of the last new tokens (an array when > 1)
    blocks: tuple[int, ...] = ()  # the slot's block table after this step, for paging executors; others ignore it


@runtime_checkable
class Executor(Protocol):
    n_slots: int              # sequence slots available
    n_vocab: int

    def step(self, chunks: Sequence[Chunk]) -> dict[int, np.ndarray]:
        """Append every chunk in one forward pass; logits rows (float32, n_vocab) by slot for those asking."""

    def copy(self, src: int, dst: int, n_tokens: int) -> None:
        """Slot ``dst`` (empty) shares positions [0, n_tokens) of slot ``src`` without recompute (an executor that
        ``parks_in_host`` returns the tokens dst holds after it: fewer when a write-back found no cells)."""

    def drop(self, slot: int, start: int = 0) -> None:
        """Forget positions >= start of ``slot`` (0: the whole slot)."""

    def cells_used(self) -> int:
        """KV cells that hold a token of any slot."""

    def clock(self) -> float:
        """Seconds on the executor's clock: wall time for real backends, virtual time for the simulator."""


def check_slot(slot: int, n_slots: int) -> None:
    if not 0 <= slot < n_slots:
        raise ValueError(f"slot {slot} outside 0..{n_slots - 1}")


def check_chunks(chunks: Sequence, n_slots: int, n_vocab: int, capacity: int, hint: str) -> None:
    """What every executor refuses in a step: a slot out of range or twice, an empty chunk, a token id outside
    the vocabulary, or positions past the ``capacity`` a slot holds (ContextFullError, with ``hint``)."""
    seen: set[int] = set()
    for c in chunks:
        check_slot(c.slot, n_slots)
        if c.slot in seen:
            raise ValueError(f"slot {c.slot} appears twice in one step")
        seen.add(c.slot)
        if not c.tokens:
            raise ValueError(f"slot {c.slot}: a chunk needs at least one token")
        if c.logits and not 1 <= c.n_logits <= len(c.tokens):
            raise ValueError(f"slot {c.slot}: n_logits {c.n_logits} must lie in 1..{len(c.tokens)} (the new tokens)")
        if any(not 0 <= t < n_vocab for t in c.tokens):
            raise ValueError(f"slot {c.slot}: token ids must lie in 0..{n_vocab - 1}")
        end = c.start + len(c.tokens)
        if end > capacity:
            raise ContextFullError(f"slot {c.slot}: {end} positions exceed the {capacity} KV cells a slot can hold",
                                   needed=end, available=capacity, hint=hint)
