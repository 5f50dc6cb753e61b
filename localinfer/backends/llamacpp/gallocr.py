"""ggml's graph allocator (``ggml_gallocr``, ggml-alloc.c) replayed in pure Python: one arena per backend.

Tensors are placed best-fit in a growing arena (``ggml_dyn_tallocr``: free blocks sorted by offset, the last
one the unbounded tail, a freed block merged with its neighbours), freed after their last consumer, and some
ops write in place over a parent that has no other consumer.  An arena's size is its high-water mark, holes
included.  :mod:`.compute_buffer` replays one backend's graph with it, :mod:`.split_compute` a graph cut
across devices.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence


class Arena:
    """One backend's buffer: best-fit allocation among free blocks, then the tail."""

    def __init__(self, align: int):
        self.align = align
        self.blocks: list[list[int]] = [[0, 1 << 62]]   # [offset, size], sorted by offset; the last: the tail
        self.high = 0

    def pad(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def take(self, nbytes: int) -> int:
        blocks, nbytes = self.blocks, self.pad(nbytes)
        best, best_size = -1, None
        for i in range(len(blocks) - 1):
            s = blocks[i][1]
            if s >= nbytes and (best_size is None or s <= best_size):
                best, best_size = i, s
        if best < 0:
            best = len(blocks) - 1
        off = blocks[best][0]
        blocks[best][0] += nbytes
        blocks[best][1] -= nbytes
        if blocks[best][1] == 0:
            del blocks[best]
        self.high = max(self.high, off + nbytes)
        return off

    def give(self, off: int, nbytes: int) -> None:
        blocks, nbytes = self.blocks, self.pad(nbytes)
        for i, (o, s) in enumerate(blocks):
            if o + s == off:
                blocks[i][1] += nbytes
                if i + 1 < len(blocks) and blocks[i][0] + blocks[i][1] == blocks[i + 1][0]:
                    blocks[i][1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if off + nbytes == o:
                blocks[i] = [off, s + nbytes]
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == off:
                    blocks[i - 1][1] += blocks[i][1]
                    del blocks[i]
                return
        j = 0
        while j < len(blocks) and blocks[j][0] < off:
            j += 1
        blocks.insert(j, [off, nbytes])


def replay(aligns: Sequence[int], leafs: Sequence[int], nodes: Sequence[int], bid: list[int], flags: Sequence[int],
           src: Sequence[Sequence[int]], view_src: Sequence[int | None], size: Sequence[int], layout: Sequence,
           inplace: Callable[[int], bool], dep_view: Collection[int] = ()) -> list[int]:
    """Each backend's high-water mark in bytes.

    Tensors are indices; ``bid`` is each one's backend (an in-place result takes its parent's: updated),
    ``flags`` 1 input, 2 output (never freed), 4 external (weights, KV cache: never allocated here);
    ``dep_view`` are views that only keep their source alive until a copy reads it (not counted as views)."""
    n = len(size)
    children, views = [0] * n, [0] * n
    allocated, offset = [False] * n, [0] * n
    arenas = [Arena(a) for a in aligns]

    def alloc(t: int, b: int) -> None:
        if allocated[t] or flags[t] & 4 or view_src[t] is not None:
            return
        allocated[t] = True
        if inplace(t):
            for p in src[t]:
                if not allocated[p] or flags[p] & 2 or layout[p] != layout[t]:
                    continue
                if children[p] != 1 or views[p] != 0:
                    continue
                offset[t] = offset[p]
                bid[t] = bid[p]
                allocated[p] = False
                arena = arenas[bid[p]]
                extra = arena.pad(size[p]) - arena.pad(size[t])
                if extra > 0:
                    arena.give(offset[t] + arena.pad(size[t]), extra)
                return
        bid[t] = b
        offset[t] = arenas[b].take(size[t])

    def free(t: int) -> None:
        if flags[t] & 2:
            return
        arenas[bid[t]].give(offset[t], size[t])
        allocated[t] = False

    for t in leafs:
        alloc(t, bid[t])
    for t in nodes:
        if view_src[t] is not None and t not in dep_view:
            views[view_src[t]] += 1
        for s in src[t]:
            children[s] += 1
    for t in nodes:
        b = bid[t]
        for s in src[t]:
            alloc(s, b)
        alloc(t, b)
        for s in src[t]:
            children[s] -= 1
            if children[s] == 0 and views[s] == 0:
                vs = view_src[s]
                if vs is not None and s not in dep_view:
                    views[vs] -= 1
                    if views[vs] == 0 and children[vs] == 0 and allocated[vs]:
                        free(vs)
                elif vs is None and allocated[s]:
                    free(s)
    return [a.high for a in arenas]
