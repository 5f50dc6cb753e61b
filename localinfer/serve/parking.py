"""Parking: finished requests' KV kept in spare sequence slots, for later prefix hits.

For an executor that keeps KV only in its sequences (llama.cpp), a request that
finishes or is cancelled keeps its slot, cut to its *kept prefix*: the leading
committed whole blocks the prefix cache names.  Those blocks wait in the block
manager's LRU as cached blocks, and a later request whose prompt matches them is
seated by ``executor.copy`` from the parked slot.  The block manager's eviction
of such a block cuts every parked sequence keeping it from that block on, and
the slot's positions from there are dropped, so KV cells and blocks agree
(``BlockManager.tokens_held``).

On a recurrent or hybrid model (the block manager's ``snapshots``) a slot can only be cut back to a position
where its state was saved: a kept prefix ends at its deepest snapshot, and a cut rewinds the slot to one
(``executor.rewind``) or drops it whole.

When all ``slots`` are parked, one gives its slot up whole (:meth:`Parking.victim`).
A preempted request, or one that failed, is not parked.  An executor that
``parks_in_host`` moves a parked slot's KV out of its cells (``executor.park``);
when host memory is full, parked requests give theirs up.  Of two parked
requests where one's kept blocks begin the other's, only the longer keeps its
slot, so two ids never hold one conversation.

One part with two sides: the block side (kept prefixes and the blocks they back)
is driven by the :class:`~localinfer.serve.block_manager.BlockManager` it is given
to at construction; the slot side (which slot each parked request holds) by the
step engine, which attaches its executor and slots.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable

from localinfer.serve.request import FinishReason, Request, State


class Parking:
    """Up to ``slots`` parked requests; ``on_evict(seq, start)`` hears of every eviction cut (for tests)."""

    def __init__(self, slots: int = 0, *, on_evict: Callable[[object, int], None] | None = None):
        if slots < 0:
            raise ValueError(f"parked slots must be >= 0, got {slots}")
        self.slots = slots
        self.on_evict = on_evict
        self.kept: dict[object, list[int]] = {}             # parked sequence -> its kept prefix's blocks
        self._backers: dict[int, set] = {}                    # block -> parked sequences keeping it
        self.slot_of: OrderedDict[str, int] = OrderedDict()   # parked request -> its slot, least recently used first
        self._prompt_of: dict[str, int] = {}                  # parked request -> hash of its prompt
        self._blocks = None
        self._executor = None
        self._free_slots: deque[int] | None = None
        self._live_slots: dict[str, int] = {}

    def bind_blocks(self, blocks) -> None:
        """Called once by the BlockManager this part is given to."""
        if self._blocks is not None:
            raise ValueError("a Parking belongs to one BlockManager")
        self._blocks = blocks

    def bind_engine(self, executor, free_slots: deque[int], slot_of: dict[str, int]) -> None:
        """Called once by the step engine: its executor, its free slots and its running requests' slots."""
        if self._executor is not None:
            raise ValueError("a Parking belongs to one engine")
        self._executor, self._free_slots, self._live_slots = executor, free_slots, slot_of

    @property
    def in_host(self) -> bool:
        """The executor moves parked KV out of its cells (llama.cpp decides at load, from a probe)."""
        return bool(self.slots) and self._executor is not None and self._executor.caps.parks_in_host

    # ---- the block side --------------------------------------------------------
    def backs(self, block: int) -> bool:
        return block in self._backers

    def held_blocks(self) -> int:
        """Blocks only parked sequences keep (no request references them)."""
        return sum(1 for b in self._backers if self._blocks.blocks[b].ref == 0)

    def park_blocks(self, seq, table: list[int], n_tokens: int) -> None:
        """``seq`` was freed holding ``n_tokens`` in ``table``: keep its leading whole blocks the cache names."""
        self.unpark(seq)
        kept, bm = [], self._blocks
        for b in table[:n_tokens // bm.block_tokens]:
            if not bm.is_cached(b):
                break
            kept.append(b)
        if kept:
            self.kept[seq] = kept
            for b in kept:
                self._backers.setdefault(b, set()).add(seq)

    def unpark(self, seq, keep_tokens: int = 0) -> int:
        """Keep only the first ``keep_tokens`` (whole blocks) of parked ``seq`` (0: forget it); tokens it keeps."""
        kept = self.kept.get(seq)
        if kept is None:
            return 0
        k = min(len(kept), max(0, keep_tokens) // self._blocks.block_tokens)
        self._cut(seq, k)
        return k * self._blocks.block_tokens

    def sharers(self, table: list[int], n_blocks: int) -> list[tuple[object, int]]:
        """Parked sequences sharing the first of ``n_blocks`` of ``table``: (sequence, whole blocks in common),
        most first."""
        out = []
        for other, kept in self.kept.items():
            k, limit = 0, min(n_blocks, len(kept))
            while k < limit and kept[k] == table[k]:
                k += 1
            if k:
                out.append((other, k))
        return sorted(out, key=lambda x: -x[1])

    def evict(self, block: int) -> None:
        """Cached ``block`` is evicted: every parked sequence keeping it is cut from it on."""
        for seq in list(self._backers.get(block, ())):
            j = self.kept[seq].index(block)
            self._cut(seq, j)
            self._evicted(seq, j * self._blocks.block_tokens)

    def _cut(self, seq, k: int) -> None:
        """Parked ``seq`` keeps its first ``k`` blocks; a block nobody keeps any more, unreferenced, leaves the cache."""
        kept = self.kept[seq]
        gone = kept[k:]
        del kept[k:]
        if not kept:
            del self.kept[seq]
        for b in gone:
            backers = self._backers.get(b)
            if backers is None:
                continue
            backers.discard(seq)
            if not backers:
                del self._backers[b]
                self._blocks.uncache_if_unused(b)

    # ---- the slot side ---------------------------------------------------------
    def release(self, r: Request, slot: int | None) -> int | None:
        """``r`` leaves ``slot``: parked (cut to its kept prefix) if it finished without error; the slot for the
        engine to drop and free when it is not parked (None: parked, or r held none)."""
        park = self.slots and slot is not None and r.state is State.FINISHED and r.finish_reason is not FinishReason.ERROR
        kept = self.unpark(r.id, r.n_tokens if park else 0)
        state = None
        if kept and self._blocks.snapshots is not None:    # a recurrent state goes back only to where it was saved
            k, state = self._snapshot_at(r.id)
            kept = self.unpark(r.id, k * self._blocks.block_tokens)
        if slot is None:
            return None
        mine = self.kept.get(r.id, [])
        keeper = next((o for o in self.slot_of if mine == self.kept.get(o, [])[:len(mine)]), None) if mine else None
        if keeper is not None:                # r hit keeper's blocks and keeps no more: one id per conversation
            self.slot_of.move_to_end(keeper)
            kept = self.unpark(r.id)
        if not kept:
            return slot
        if state is not None:
            self._executor.rewind(slot, state)
        else:
            self._executor.drop(slot, kept)
        prompt = hash(r.prompt)
        if self.in_host and not self._to_host(slot, prompt):
            self.unpark(r.id)         # no room in host memory: not parked in cells either, where it would widen
            return slot               # what every step attends over
        self.slot_of[r.id] = slot
        self._prompt_of[r.id] = prompt
        for other in [o for o in self.slot_of if o != r.id]:   # older parked KV that r keeps all of
            theirs = self.kept.get(other)
            if theirs is not None and theirs == mine[:len(theirs)]:
                self.give_up(other)
        while len(self.slot_of) > self.slots:
            self.give_up(self.victim())
        return None

    def hit(self, rid: str, cached: int, have: int) -> tuple[int, int] | None:
        """The parked slot holding most of ``rid``'s cached prefix and how many tokens it gives, if more than
        ``have`` (it becomes the most recently used)."""
        bm = self._blocks
        n = min(len(bm.tables[rid]), bm.written(rid) // bm.block_tokens)
        for other, k in self.sharers(bm.tables[rid], n):
            if other in self.slot_of:
                if min(k * bm.block_tokens, cached) <= have:
                    return None
                self.slot_of.move_to_end(other)
                return self.slot_of[other], min(k * bm.block_tokens, cached)
        return None

    def victim(self, also: int | None = None) -> str:
        """The parked request to give its slot up: the least recently used one whose prompt another parked request
        (or the one being parked, whose prompt hash is ``also``) was sent too, a prompt answered again differently
        (a regenerate; a resend whose first token flipped): its prompt's blocks stay in the other, it loses only its
        answer's.  Else the least recently used.  Plain LRU would take an unrelated conversation, the next one
        wanted when prompts come back in turn."""
        seen = Counter(self._prompt_of.values())
        if also is not None:
            seen[also] += 1
        return next((rid for rid in self.slot_of if seen[self._prompt_of.get(rid)] > 1), next(iter(self.slot_of)))

    def give_up(self, rid: str) -> None:
        """Parked ``rid`` gives its slot up: its KV is dropped and its blocks leave the cache (unless shared)."""
        slot = self.slot_of.pop(rid)
        self._prompt_of.pop(rid, None)
        self.unpark(rid)
        self._executor.drop(slot)
        self._free_slots.append(slot)

    def _to_host(self, slot: int, prompt: int) -> bool:
        """Move ``slot``'s KV to host memory, parked requests giving theirs up (``victim``) while it does not fit
        beside them (``park`` False); False when it cannot go there (``park`` None: over the whole budget) or fits
        alone neither.  True also when the executor has just turned host parking off and the block pool is the
        cells alone: the KV then stays parked in its cells."""
        while (done := self._executor.park(slot)) is not True:
            if not self.in_host:
                return self._blocks.max_used is None
            if done is None or not self.slot_of:
                return False
            self.give_up(self.victim(also=prompt))
        return True

    def _snapshot_at(self, seq) -> tuple[int, object]:
        """(the leading blocks of parked ``seq``'s kept prefix that end at a snapshot, that snapshot or None)."""
        bm = self._blocks
        hashes = [bm.blocks[b].hash for b in self.kept.get(seq, ())]
        k = bm.snapshots.depth(hashes, len(hashes))
        return k, bm.snapshots.get(hashes[k - 1]) if k else None

    def _evicted(self, seq, start: int) -> None:
        """The block manager cut parked ``seq`` from position ``start`` on: drop that KV (with snapshots: back to the
        deepest one at or before it, or all of it)."""
        state = None
        if start and self._blocks.snapshots is not None:
            k, state = self._snapshot_at(seq)
            if k * self._blocks.block_tokens < start:
                self._cut(seq, k)
            start = k * self._blocks.block_tokens
        if self.on_evict is not None:
            self.on_evict(seq, start)
        if self._executor is None:
            return
        slot = self.slot_of.get(seq, self._live_slots.get(seq))    # live: freed in this schedule, released later
        if slot is None:
            return
        if state is not None:
            self._executor.rewind(slot, state)
        else:
            self._executor.drop(slot, start)
        if start == 0 and self.slot_of.get(seq) == slot:
            del self.slot_of[seq]
            self._prompt_of.pop(seq, None)
            self._free_slots.append(slot)
