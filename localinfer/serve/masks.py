"""Grammar masks in the serving step: every constrained request the step samples, filled before any is sampled.

A request's grammar state follows its output tokens (:class:`~localinfer.generation.constraints.Constraint`
syncs to them), so preemption, recompute and prefix-cache hits need nothing here; prompt-lookup drafts are
cut to what the grammar allows before they are verified (:mod:`localinfer.serve.speculation`).
"""

from __future__ import annotations

from collections.abc import Sequence

from localinfer.generation.constraints import fill_masks
from localinfer.serve.request import State


def fill_step_masks(chunks: Sequence) -> None:
    """Fill the next-token masks (draft positions included) of the scheduled chunks that sample and are
    constrained, before their rows are sampled."""
    items = []
    for c in chunks:
        r = c.request
        if c.samples and r.state is State.RUNNING and r.sampler.constraint is not None:
            items.append((r.sampler.constraint, r.output, c.draft))
    fill_masks(items)
