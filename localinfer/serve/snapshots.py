"""Snapshots: the recurrent state of a hybrid or recurrent model, saved at block-aligned positions for prefix reuse.

Attention KV can be cut back to any position, so a prefix hit reuses every matched block.  A recurrent layer's
state has no positions: it is the sum of everything before, and cannot be cut back.  A hit on such a model
reuses the attention blocks only up to a position where the state was saved (a *snapshot*), and recomputes the
rest (SPEC.md §8.3: a match at 10,752 tokens with snapshots at 4096 and 8192 restores 8192 and recomputes 2560).

Where snapshots are taken is the :class:`SnapshotPolicy`: every ``stride`` tokens of a prompt, at the last whole
block of each prompt (``prompt_end``: what a regenerate or a second choice of the same prompt starts from), and at
the last whole block of each reply (``reply_end``: what the next chat turn, which repeats the reply, starts from;
while a reply is decoded only its latest block boundary's state is kept).  A prompt's chunks are cut at those
positions, so the state after a chunk is the state there.  (Before each lookup verify the executor keeps the state
itself, to roll a rejected draft back.)

:class:`Snapshots` keeps them in host memory, keyed like the prefix cache's blocks (the chain hash of the block a
snapshot ends: model, positions and tokens), least recently used first, within a byte budget.  A snapshot lives
no longer than its block in the prefix cache: the block manager drops it when the block leaves the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from localinfer.errors import UsageError

DEFAULT_STRIDE = 1024        # tokens between a long prompt's snapshots (llama-server's checkpoint min step is 512)


@dataclass(frozen=True)
class SnapshotPolicy:
    """Where a prompt's state is saved: every ``stride`` tokens (0: not by stride) and at its last whole block;
    ``reply_end``: also at the last whole block a reply reaches."""

    stride: int = DEFAULT_STRIDE
    prompt_end: bool = True
    reply_end: bool = True

    def __post_init__(self):
        if isinstance(self.stride, bool) or not isinstance(self.stride, int) or self.stride < 0:
            raise UsageError(f"the snapshot stride must be a whole number of tokens >= 0, got {self.stride!r}",
                             flag="--snapshot-stride", hint="e.g. 1024, or 0 for prompt ends only")

    def boundaries(self, n_tokens: int, block: int) -> list[int]:
        """Positions, in order, where a sequence of ``n_tokens`` to compute is snapshotted (block-aligned, > 0)."""
        out = set()
        if self.stride:
            step = max(block, self.stride // block * block)
            out.update(range(step, n_tokens + 1, step))
        if self.prompt_end:     # the last whole block before the last token (a resend's hit), and the end's own
            out.update(b for b in ((n_tokens - 1) // block * block, n_tokens // block * block) if b > 0)
        return sorted(out)

    def next_boundary(self, start: int, n_tokens: int, block: int) -> int | None:
        """The first snapshot position past ``start`` of a sequence of ``n_tokens`` (None: none is left)."""
        return next((b for b in self.boundaries(n_tokens, block) if b > start), None)

    def request_points(self, r, block: int) -> list[int]:
        """A request's snapshot positions: its boundaries, and where its prompt's match in the prefix cache ended
        past the deepest snapshot (``past_snapshot``): prompts part there (a shared system prompt's end), so the
        next request sharing it restores that state instead of computing it again."""
        points = self.boundaries(r.n_tokens, block)
        if r.past_snapshot:
            points = sorted({*points, r.cached + r.past_snapshot})
        return points


class Snapshots:
    """Saved states by the hash of the block each ends, least recently used first, at most ``budget`` bytes."""

    def __init__(self, policy: SnapshotPolicy | None = None, budget: int = 1 << 30):
        if budget < 0:
            raise UsageError(f"the snapshot budget must be >= 0 bytes, got {budget}")
        self.policy = policy or SnapshotPolicy()
        self.budget = budget
        self._states: OrderedDict[int, object] = OrderedDict()    # block hash -> SeqState
        self.bytes = 0
        self.taken = 0          # snapshots stored
        self.restored = 0       # hits that restored one
        self.evicted = 0        # given up for the budget (not those whose block left the cache)
        self.recomputed = 0     # prompt tokens matched past the deepest snapshot, so computed again

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: int) -> bool:
        return key in self._states

    def keys(self) -> list[int]:
        """The block hashes snapshots are kept under, least recently used first."""
        return list(self._states)

    def put(self, key: int, state) -> bool:
        """Keep ``state`` (an executor's SeqState) under block hash ``key``, giving up the least recently used
        ones while over the budget; False when it alone exceeds the budget."""
        if key in self._states:
            self._states.move_to_end(key)
            return True
        if state.nbytes > self.budget:
            return False
        while self._states and self.bytes + state.nbytes > self.budget:
            _, old = self._states.popitem(last=False)
            self.bytes -= old.nbytes
            self.evicted += 1
        self._states[key] = state
        self.bytes += state.nbytes
        self.taken += 1
        return True

    def get(self, key: int):
        """The state under ``key`` (now the most recently used), or None."""
        state = self._states.get(key)
        if state is not None:
            self._states.move_to_end(key)
        return state

    def discard(self, key: int) -> None:
        """Forget the state under ``key`` (its block left the prefix cache)."""
        state = self._states.pop(key, None)
        if state is not None:
            self.bytes -= state.nbytes

    def depth(self, hashes: Sequence[int], n_blocks: int) -> int:
        """The most leading blocks, at most ``n_blocks`` of the chain ``hashes``, that end at a snapshot (0: none)."""
        for k in range(min(n_blocks, len(hashes)), 0, -1):
            if hashes[k - 1] in self._states:
                return k
        return 0

    def as_json(self) -> dict:
        return {"count": len(self._states), "bytes": self.bytes, "budget_bytes": self.budget, "taken": self.taken,
                "restored": self.restored, "evicted": self.evicted, "recomputed_tokens": self.recomputed,
                "stride": self.policy.stride, "prompt_end": self.policy.prompt_end,
                "reply_end": self.policy.reply_end}
