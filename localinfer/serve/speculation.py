"""Prompt-lookup speculative decoding inside the serving engine's steps.

A decoding request whose history (prompt + output) repeats an n-gram gets a
draft of the tokens that followed it (:class:`~localinfer.generation.lookup.LookupDecoder`,
the same proposer ``run --lookup`` uses, one per request).  The scheduler sends
the pending token and the draft as one chunk of the step, asking for the logits
of every position (``Chunk.n_logits``); the engine draws each position with the
request's own sampler, exactly as plain decoding would, and keeps drafts while
the draw equals the draft: the first draw that differs, or one bonus draw after
the last draft, ends the round (greedy: the longest agreeing prefix plus the
model's token; sampling: the output distribution is plain sampling's, and a
seeded sampler consumes its random stream as plain decoding does —
docs/speculation.md).  The rejected drafts' KV is dropped after the step.

How long a draft is comes from the proposer's marginal rule (lengthen while the
step's extra time per expected extra token stays under the step's time per
token) over the learnt acceptance and the step model's time of *this* step with
the draft in it, so drafts that do not pay on the machine (a CPU, where
verifying m tokens costs nearly m decode steps) shrink to nothing.  Drafts only
use what is left: they never preempt a request, take blocks that are not free,
or push the step past its token budget, and a draft never reaches past the
request's ``max_tokens`` (its reserved blocks).  Under ``on_demand`` admission the
blocks grown for rejected drafts go back at once, so they cannot cause a later
preemption either.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from localinfer.errors import UsageError
from localinfer.generation.decoding import History
from localinfer.generation.lookup import CostModel, Draft, LookupDecoder
from localinfer.plan.speculation import MAX_DRAFT

DRAFT_MAX = 8           # serve --lookup's default --draft-max
PRIOR_SLOPE = 0.25      # without a step model: T(m) = 1 + 0.25·(m − 1), a GPU-like verify cost


DRAFT_LIMIT = 32        # a step verifies at most this many drafts per request (run --lookup allows MAX_DRAFT)


def check_draft_max(n: int, flag: str = "--draft-max") -> int:
    limit = min(DRAFT_LIMIT, MAX_DRAFT)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
        raise UsageError(f"{flag} must be a whole number from 1 to {limit}, got {n!r}", flag=flag)
    return n


class Drafter:
    """One prompt-lookup proposer per decoding request, and the counts of drafted and accepted tokens."""

    def __init__(self, draft_max: int = DRAFT_MAX, ngram_max: int = 4, ngram_min: int = 2):
        self.draft_max = check_draft_max(draft_max)
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self._decoders: dict[str, LookupDecoder] = {}
        self._drafts: dict[str, Draft] = {}
        self.drafted = 0       # draft tokens sent for verification
        self.accepted = 0      # of those, kept
        self.rounds = 0        # chunks that carried a draft

    def propose(self, r, room: int, step_seconds=None) -> tuple[int, ...]:
        """A draft of at most ``room`` tokens after r's pending token (empty: decode plainly this step).

        ``step_seconds(m)``: the predicted time of the step with r verifying m tokens (m = 1: plainly).
        """
        room = min(room, self.draft_max)
        if room <= 0:
            return ()
        dec = self._decoders.get(r.id)
        if dec is None:
            dec = self._decoders[r.id] = LookupDecoder(self.ngram_max, self.ngram_min, self.draft_max)
        dec.cost = (CostModel.fixed([1.0 + PRIOR_SLOPE * m for m in range(room + 1)]) if step_seconds is None
                    else CostModel.predicted(step_seconds, room + 1))
        n = r.n_tokens
        draft = dec.propose(r.view(n - 1), r.view()[n - 1], room=room, is_eos=lambda t: t in r.stop_tokens)
        grammar = r.sampler.constraint
        if grammar is not None and draft.tokens:      # verify only what the grammar allows
            grammar.sync(r.output)
            keep = grammar.valid_prefix(draft.tokens)
            if keep < len(draft.tokens):
                draft = Draft(draft.tokens[:keep], draft.source, draft.agreement)
        self._drafts[r.id] = draft
        return tuple(draft.tokens)

    def verify(self, r, rows: np.ndarray, draft: Sequence[int]) -> list[int]:
        """Draw each verified position as plain decoding would; stop at the first draw that is not the draft."""
        view, out = r.view(), []
        for i in range(len(draft) + 1):
            tok = r.sampler.sample(rows[i], History(view, len(view), out))
            out.append(tok)
            if i == len(draft) or tok != draft[i] or tok in r.stop_tokens:
                break
        self.rounds += 1
        self.drafted += len(draft)
        self.accepted += len(out) - 1
        return out

    def observe(self, r, emitted: Sequence[int]) -> None:
        """Teach r's proposer what this step emitted (drafted or not), so its index follows the history."""
        dec, draft = self._decoders.get(r.id), self._drafts.pop(r.id, None)
        if dec is not None and draft is not None:
            dec.observe(draft, emitted)

    def forget(self, request_id: str) -> None:
        self._decoders.pop(request_id, None)
        self._drafts.pop(request_id, None)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None
