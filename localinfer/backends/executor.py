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

A recurrent or hybrid model's state cannot be cut back to an earlier position the way
attention KV can: an executor that declares ``snapshots`` saves a slot's state at its
current position to host memory (``snapshot``, a :class:`SeqState`) and takes a slot back
to one (``rewind``: the state restored, positions past it dropped); a prefix shared by
``copy`` is then completed with ``rewind`` to the state saved at its end.

``interrupt`` (any thread) asks the step in flight to stop early: an executor
that ``interrupts_steps`` then raises :class:`StepInterrupted` from ``step``,
every slot left as it was before the step (a server stops a long prompt's step
whose requests have all been cancelled, instead of waiting it out).

What an executor can do beyond that is declared once, in :class:`ExecutorCaps`
(read as ``executor.caps``); :class:`ExecutorBase` gives every member of the
contract a safe default, and a wrapper forwards its inner executor's ``caps``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
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


@dataclass(frozen=True, eq=False)
class SeqState:
    """What a slot holds that positions cannot be cut back to (recurrent layers' state), saved at ``n_tokens``:
    ``data`` is the backend's own bytes (host memory), ``nbytes`` their size."""

    n_tokens: int
    nbytes: int
    data: object = None


@dataclass(frozen=True)
class ExecutorCaps:
    """What an executor can do beyond the core contract; the defaults are the safe answers."""

    n_cells: int = 0                      # KV cells in all (0: not counted in cells)
    slot_cells: int = 0                   # the most positions one slot holds (0: no limit of its own)
    block_size: int | None = None         # a paging executor's KV block (the block manager must use it)
    unified: bool = True                  # one pool of cells for every slot (False: a stream per slot)
    restores_cached_prefix: bool = False  # ``restore`` brings back a cached prefix no slot holds (a paged pool)
    verifies_drafts: bool = False         # honours ``Chunk.n_logits`` (several logits rows of one chunk)
    drops_tail: bool = False              # ``drop(slot, start > 0)`` cuts a slot's tail (not a recurrent model)
    parks_in_host: bool = False           # ``park`` moves a slot's KV to host memory (decided at load)
    interrupts_steps: bool = False        # ``interrupt`` stops the step in flight (StepInterrupted, no slot changed)
    cpu_threads: int = 0                  # CPU cores the forward pass keeps busy (0: it runs on an accelerator)
    snapshots: bool = False               # ``snapshot``/``rewind`` a state positions cannot be cut back to (recurrent)
    state_bytes: int = 0                  # bytes of one such state (a snapshot's size; 0 without ``snapshots``)


class StepInterrupted(Exception):
    """``step`` stopped early because ``interrupt`` asked it to; every slot holds what it held before the step."""


@runtime_checkable
class Executor(Protocol):
    n_slots: int              # sequence slots available
    n_vocab: int

    @property
    def caps(self) -> ExecutorCaps:
        """What this executor can do (see :class:`ExecutorCaps`)."""

    def step(self, chunks: Sequence[Chunk]) -> dict[int, np.ndarray]:
        """Append every chunk in one forward pass; logits rows (float32, n_vocab) by slot for those asking.  An
        executor may lend its rows (the serving llama.cpp executor's ``lend_rows``): read-only views of the backend's
        own buffer, valid until the next call into it, so a caller that keeps a row past that copies it."""

    def copy(self, src: int, dst: int, n_tokens: int, *, append: bool = False) -> int:
        """Slot ``dst`` (empty; with ``append``, already holding a prefix of the same tokens) shares positions up to
        ``n_tokens`` of slot ``src`` without recompute; the tokens dst holds after it (fewer than ``n_tokens`` only
        when a write-back from host memory found no cells: compute the rest)."""

    def drop(self, slot: int, start: int = 0) -> None:
        """Forget positions >= start of ``slot`` (0: the whole slot)."""

    def rebase(self, dst: int, src: int, n_tokens: int) -> None:
        """``dst`` computed its first ``n_tokens`` positions itself, the same tokens ``src`` holds there: it takes
        ``src``'s cells for them and frees its own (a prefix computed twice is held once again).  On a recurrent
        model ``dst``'s state is ``src``'s after it: ``rewind`` it to its own."""

    def park(self, slot: int) -> bool | None:
        """Move ``slot``'s KV to host memory: True when there, False when it does not fit beside the parked
        states, None when it never will (or the executor does not park in host memory)."""

    def restore(self, slot: int, n_tokens: int) -> None:
        """Bring positions up to ``n_tokens`` of ``slot`` back from the cached pool (``restores_cached_prefix``)."""

    def snapshot(self, slot: int) -> SeqState:
        """``slot``'s state that positions cannot be cut back to, at the positions it holds now (``snapshots``)."""

    def rewind(self, slot: int, state: SeqState) -> None:
        """``slot`` back to ``state.n_tokens`` positions: ``state`` restored, every position from there dropped
        (``snapshots``; the slot holds at least that many positions of the same tokens)."""

    def cells_used(self) -> int:
        """KV cells that hold a token of any slot."""

    def host_cells(self) -> int:
        """Positions the host memory for parked KV holds (0 without ``parks_in_host``)."""

    def host_tokens(self) -> int:
        """Positions parked in host memory now."""

    def clock(self) -> float:
        """Seconds on the executor's clock: wall time for real backends, virtual time for the simulator."""

    def idle_until(self, t: float) -> None:
        """Wait for the clock to reach ``t`` (nothing to compute before then): sleep, or advance a virtual clock."""

    def interrupt(self) -> None:
        """Ask the step in flight to stop early (any thread; ``interrupts_steps``): it raises StepInterrupted.
        A call after ``step`` was entered but before it computes anything stops it too; ``forget_interrupt``
        (the caller, once the step returned) drops one that came too late, so it stops no later step."""

    def forget_interrupt(self) -> None:
        """Drop an ``interrupt`` that came after the step in flight ended (called between steps)."""


class ExecutorBase:
    """The contract with its safe defaults: an executor subclasses this and sets what it can do."""

    n_slots: int
    n_vocab: int
    n_cells: int = 0
    slot_cells: int = 0
    block_size: int | None = None
    unified: bool = True
    restores_cached_prefix: bool = False
    verifies_drafts: bool = False
    drops_tail: bool = False
    parks_in_host: bool = False
    interrupts_steps: bool = False
    cpu_threads: int = 0
    snapshots: bool = False
    state_bytes: int = 0
    decode_seconds: float = 0.0          # seconds inside the backend's forward passes (0: not counted)
    vocab = None                         # the model's tokenizer (tokenize, token_bytes, eos_ids), where it has one

    @property
    def caps(self) -> ExecutorCaps:
        return ExecutorCaps(**{f.name: getattr(self, f.name) for f in fields(ExecutorCaps)})

    def step(self, chunks: Sequence[Chunk]) -> dict[int, np.ndarray]:
        raise NotImplementedError

    def copy(self, src: int, dst: int, n_tokens: int, *, append: bool = False) -> int:
        raise NotImplementedError

    def drop(self, slot: int, start: int = 0) -> None:
        raise NotImplementedError

    def rebase(self, dst: int, src: int, n_tokens: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot share cells a slot computed itself")

    def park(self, slot: int) -> bool | None:
        return None

    def restore(self, slot: int, n_tokens: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps KV only in its slots: it restores no cached prefix")

    def snapshot(self, slot: int) -> SeqState:
        raise NotImplementedError(f"{type(self).__name__} holds no state that needs a snapshot")

    def rewind(self, slot: int, state: SeqState) -> None:
        raise NotImplementedError(f"{type(self).__name__} holds no state that needs a snapshot")

    def cells_used(self) -> int:
        raise NotImplementedError

    def host_cells(self) -> int:
        return 0

    def host_tokens(self) -> int:
        return 0

    def clock(self) -> float:
        return time.perf_counter()

    def idle_until(self, t: float) -> None:
        time.sleep(max(0.0, min(t - self.clock(), 0.05)))

    def interrupt(self) -> None:
        pass

    def forget_interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ExecutorWrapper(ExecutorBase):
    """An executor around another: every call and ``caps`` forwarded to ``inner`` (override what it adds)."""

    def __init__(self, inner):
        self.inner = inner
        self.n_slots = inner.n_slots
        self.n_vocab = inner.n_vocab

    @property
    def caps(self) -> ExecutorCaps:
        return self.inner.caps

    @property
    def vocab(self):
        return self.inner.vocab

    def step(self, chunks: Sequence[Chunk]) -> dict[int, np.ndarray]:
        return self.inner.step(chunks)

    def copy(self, src: int, dst: int, n_tokens: int, *, append: bool = False) -> int:
        return self.inner.copy(src, dst, n_tokens, append=True) if append else self.inner.copy(src, dst, n_tokens)

    def drop(self, slot: int, start: int = 0) -> None:
        self.inner.drop(slot, start)

    def rebase(self, dst: int, src: int, n_tokens: int) -> None:
        self.inner.rebase(dst, src, n_tokens)

    def park(self, slot: int) -> bool | None:
        return self.inner.park(slot)

    def restore(self, slot: int, n_tokens: int) -> None:
        self.inner.restore(slot, n_tokens)

    def snapshot(self, slot: int) -> SeqState:
        return self.inner.snapshot(slot)

    def rewind(self, slot: int, state: SeqState) -> None:
        self.inner.rewind(slot, state)

    def cells_used(self) -> int:
        return self.inner.cells_used()

    def host_cells(self) -> int:
        return self.inner.host_cells()

    def host_tokens(self) -> int:
        return self.inner.host_tokens()

    def clock(self) -> float:
        return self.inner.clock()

    def idle_until(self, t: float) -> None:
        self.inner.idle_until(t)

    def interrupt(self) -> None:
        self.inner.interrupt()

    def forget_interrupt(self) -> None:
        self.inner.forget_interrupt()

    def close(self) -> None:
        self.inner.close()


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


def pack_rows(chunks: Sequence[Chunk], n_batch: int, n_outputs: int) -> list[list[tuple[int, int, int, bool]]]:
    """Rows (token, position, slot, wants logits) in groups of <= n_batch rows and <= n_outputs logit rows.

    Rows keep the order of the chunks; a step within both limits is one group
    (one ``llama_decode``), and a long chunk may straddle two groups.
    """
    if len(chunks) <= min(n_batch, n_outputs) and all(len(c.tokens) == 1 for c in chunks):
        return [[(int(c.tokens[0]), c.start, c.slot, c.logits) for c in chunks]]     # decodes within both: one group
    groups: list[list[tuple[int, int, int, bool]]] = [[]]
    outs = 0
    for c in chunks:
        last = len(c.tokens) - 1
        for i, t in enumerate(c.tokens):
            w = c.logits and i > last - c.n_logits
            if len(groups[-1]) == n_batch or (w and outs == n_outputs):
                groups.append([])
                outs = 0
            groups[-1].append((int(t), c.start + i, c.slot, w))
            outs += w
    return groups
