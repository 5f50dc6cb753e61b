"""Grammar masks in the serving step: every constrained request the step samples, filled before any is sampled.

A request's grammar state follows its output tokens (:class:`~localinfer.generation.constraints.Constraint`
syncs to them), so preemption, recompute and prefix-cache hits need nothing here; prompt-lookup drafts are
cut to what the grammar allows before they are verified (:mod:`localinfer.serve.speculation`).

A step's masks depend only on the tokens its requests already have (and its drafts), never on the logits the
step computes, so :class:`StepMasks` fills them on a worker thread while the executor runs the forward pass
(llguidance and the backends release the GIL) and the step waits only for what is left of the fill when its
logits come back.  A mask's cost is the walk of llguidance's token trie from the grammar's state: tens of
microseconds in most states, milliseconds inside a length-bounded string on a large vocabulary
(``docs/structured.md``); beside the forward pass, that is off the step's critical path.

Only where a core is free for it (:func:`spare_core`): a forward pass on the CPU whose threads take every core
waits for its slowest thread, so a fill that takes a core from one of them costs the whole pass more than the
fill's own time (``docs/structured.md``); there the masks are filled after the pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from localinfer.generation.constraints import fill_masks
from localinfer.generation.load import usable_cores
from localinfer.serve.request import State


def spare_core(cpu_threads: int) -> bool:
    """Whether a mask thread has a core of its own beside a forward pass that keeps ``cpu_threads`` cores busy
    (``ExecutorCaps.cpu_threads``: 0 on an accelerator)."""
    return usable_cores() > cpu_threads


def step_mask_items(chunks: Sequence) -> list:
    """(constraint, output, draft) of each scheduled chunk that samples, is constrained and needs its masks
    before it samples: a row with a draft to verify, or one whose sampler cannot try a draw without the mask
    first (``Sampler.draws_unmasked_first``: greedy and plain temperature can, and fill a mask only when the
    grammar refuses that draw)."""
    items = []
    for c in chunks:
        r = c.request
        s = r.sampler
        if (c.samples and r.state is State.RUNNING and s.constraint is not None
                and (c.draft or not s.draws_unmasked_first)):
            items.append((s.constraint, r.output, c.draft))
    return items


class StepMasks:
    """The masks of one step at a time: ``start(step_mask_items(chunks))`` before the executor's step,
    ``finish()`` after it and before any row is sampled.  With ``overlap`` the fill runs on one worker thread in between; without, in
    ``finish``.  ``wait_s`` is what the last ``finish`` took: the masks' share of the step's critical path.

    The worker touches only the step's constraints, which nothing else touches until ``finish`` returns (outputs
    change when the step's tokens are appended, after it); a step whose executor fails still calls ``finish``,
    so no fill outlives its step."""

    def __init__(self, overlap: bool = True):
        self.overlap = overlap
        self.wait_s = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._items: list = []

    def start(self, items: list) -> None:
        """Begin filling the masks of (constraint, output, draft) ``items`` (:func:`fill_masks`)."""
        if items and self.overlap:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="localinfer-masks")
            self._pending = self._pool.submit(fill_masks, items)
        else:
            self._items = items

    def finish(self) -> None:
        """Wait for the masks started last (or fill them now); a fill's exception is raised here."""
        t0 = time.perf_counter()
        pending, items = self._pending, self._items
        self._pending, self._items = None, []
        try:
            if pending is not None:
                pending.result()
            elif items:
                fill_masks(items)
        finally:
            self.wait_s = time.perf_counter() - t0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
