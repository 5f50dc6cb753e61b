"""Paged KV accounting: blocks of ``p`` tokens, block tables, reference counts and a prefix cache.

A sequence of L tokens holds ⌈L / p⌉ blocks (``plan.paging.blocks_for``, the
planner's own count).  A full block is named by a chained hash
``h_i = H(h_{i-1}, tokens of block i)``, so equal hashes mean equal prefixes;
every hit is checked against the stored parent hash and tokens, so a hash
collision is a miss, never wrong KV.  Blocks nobody references but whose hash
is cached wait in an LRU queue and are evicted (oldest first, deepest block of
a chain before its parent) only when the free pool is empty.

A block whose last reference goes while a step is in flight (between
``begin_step`` and ``end_step``) may still be read by that step, so it joins
the pool only at ``end_step``.  Writing into a partly filled block that another
sequence shares (after ``fork``) copies it first (copy-on-write).

With ``pool_hits=False`` a hit stops at the first block no running sequence
holds and no parked sequence keeps: for backends that keep KV only in
sequences (every hit is then a copy from one of them).

Parked sequences (a :class:`~localinfer.serve.parking.Parking` given at
construction, for an engine that keeps finished requests' KV in spare sequence
slots): ``free(seq)`` then leaves the sequence's leading committed whole blocks
that the cache names (its *kept prefix*) backed by the parked sequence: unreferenced,
they wait in the LRU as cached blocks, and with ``pool_hits=False`` they stay
hits, since the parked sequence still holds their KV.  An unreferenced block no
parked sequence backs leaves the cache at once; evicting a backed block (LRU,
for an allocation) cuts every parked sequence holding it from that block on
(``Parking.evict``), so the KV cells and blocks agree: ``tokens_held``.  With
parking, a block whose parent in its own sequence is not the cached one (two
sequences computed one prefix at once) is not cached, so whoever holds a
cached block holds its whole chain and one copy seats any hit.

``max_used`` caps the blocks requests reference at once (the KV cells) below
``num_blocks``: the blocks past it only cache, for an executor that keeps
parked KV in host memory, so more parked requests stay hits than the cells
hold; ``num_free`` and ``capacity`` count within the cap.

On a recurrent or hybrid model (``snapshots``: :mod:`localinfer.serve.snapshots`) a hit ends at the deepest
matched block whose end has a saved state; a block leaving the cache takes its snapshot with it.

A block is hashed once per sequence: admission makes one ``match`` and hands
its hit to ``allocate``, and a ``PrefixHashes`` memo kept by the caller (a
request keeps its own) carries the hashes from ``match`` to later matches and
to ``commit``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from localinfer.errors import LocalinferError, UsageError
from localinfer.plan.paging import DEFAULT_BLOCK_TOKENS, blocks_for
from localinfer.serve.parking import Parking
from localinfer.serve.prefix_hashes import PrefixHashes, chain_hash
from localinfer.serve.snapshots import Snapshots

ROOT_HASH = 0


class OutOfBlocks(LocalinferError):
    """The KV pool has fewer free blocks than an allocation needs (needed vs available)."""


@dataclass
class Block:
    id: int
    ref: int = 0
    hash: int | None = None          # set once the block is full and computed
    parent: int | None = None        # the previous block's hash (ROOT_HASH for the first)
    tokens: tuple[int, ...] = ()     # a hashed block's tokens, for the collision check
    filled: int = 0                  # token slots written (a sequence's blocks fill in order: all full but its last)


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: ``n_tokens`` of block ``src`` go to the new block ``dst`` before the write."""

    src: int
    dst: int
    n_tokens: int


class BlockManager:
    """The KV pool of one model: ``num_blocks`` blocks of ``block_tokens`` tokens."""

    def __init__(self, num_blocks: int, block_tokens: int = DEFAULT_BLOCK_TOKENS, *, prefix_cache: bool = True,
                 pool_hits: bool = True, hash_fn: Callable[[int, tuple[int, ...]], int] = chain_hash,
                 max_used: int | None = None, parking: Parking | None = None, snapshots: Snapshots | None = None):
        if num_blocks < 0 or block_tokens <= 0 or not 0 <= (max_used or 0) <= num_blocks:
            raise UsageError(f"need a non-negative block count, a positive block size and at most that many "
                             f"referenced, got {num_blocks} blocks of {block_tokens} ({max_used})", flag="--block")
        if parking is not None and pool_hits:
            raise ValueError("parking is for executors that keep KV only in sequences: build the BlockManager "
                             "with pool_hits=False")
        self.block_tokens = block_tokens
        self.prefix_cache = prefix_cache
        self.pool_hits = pool_hits
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()    # cached, unreferenced; oldest first
        self._cache: dict[int, int] = {}                      # hash -> block id
        self._deferred: list[int] = []
        self._in_flight = False
        self.tables: dict[object, list[int]] = {}
        self._chain: dict[object, tuple[int, int]] = {}       # per sequence: (whole blocks hashed, last hash)
        self.used = 0                                         # blocks with a reference
        self.parking = parking                                # free() parks into it
        if parking is not None:
            parking.bind_blocks(self)
        self.peak_used = 0
        self.evictions = 0
        self.max_used = max_used      # referenced blocks at most (the KV cells); the rest only cache (host memory)
        self.snapshots = snapshots    # saved recurrent states: a hit ends at the deepest one (None: attention only)

    # ---- counts --------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def capacity(self) -> int:
        """The most blocks requests can reference at once."""
        return len(self.blocks) if self.max_used is None else self.max_used

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: the free pool plus evictable cached blocks (within ``max_used``)."""
        n = len(self._free) + len(self._lru)
        return n if self.max_used is None else max(0, min(n, self.max_used - self.used))

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def references(self) -> int:
        """Block-table entries over all sequences."""
        return sum(len(t) for t in self.tables.values())

    def tokens_in_use(self) -> int:
        """Token slots written in referenced blocks, each physical block once (what KV cells hold)."""
        return sum(block.filled for block in self.blocks if block.ref)

    def tokens_held(self) -> int:
        """``tokens_in_use`` plus the whole blocks that only parked sequences keep (what KV cells hold then)."""
        parked = self.parking.held_blocks() if self.parking is not None else 0
        return self.tokens_in_use() + self.block_tokens * parked

    @property
    def parked(self) -> dict[object, list[int]]:
        """Parked sequence -> its kept prefix's blocks (empty without parking)."""
        return self.parking.kept if self.parking is not None else {}

    def written(self, seq) -> int:
        """Tokens ``seq`` holds computed: its blocks are full up to its last written one."""
        table, blocks = self.tables[seq], self.blocks
        if table and blocks[table[-1]].filled:       # most often: blocks taken as the KV grows, the last one written
            return (len(table) - 1) * self.block_tokens + blocks[table[-1]].filled
        unwritten = bisect_left(table, True, key=lambda b: blocks[b].filled == 0)     # its first unwritten block
        return (unwritten - 1) * self.block_tokens + blocks[table[unwritten - 1]].filled if unwritten else 0

    def has_hash(self, h: int) -> bool:
        """A block with chain hash ``h`` is in the prefix cache."""
        return h in self._cache

    def is_cached(self, b: int) -> bool:
        """Block ``b`` is the prefix cache's block for its hash."""
        h = self.blocks[b].hash
        return h is not None and self._cache.get(h) == b

    def _backed(self, b: int) -> bool:
        return self.parking is not None and self.parking.backs(b)

    # ---- the prefix cache ----------------------------------------------------
    def match(self, tokens: Sequence[int], hashes: PrefixHashes | None = None) -> list[int]:
        """Cached blocks holding the longest run of whole leading blocks of ``tokens`` (with ``snapshots``: up to
        the deepest of them that ends at a snapshot).

        At least one token is left to compute, so a hit never covers the whole sequence.
        ``hashes`` (the memo of these tokens) supplies the hashes computed before and keeps new ones.
        """
        return self.match_cut(tokens, hashes)[0]

    def match_cut(self, tokens: Sequence[int], hashes: PrefixHashes | None = None) -> tuple[list[int], int]:
        """``match`` and the matched blocks past its end that no snapshot reaches (0 without ``snapshots``)."""
        found = self._match(tokens, hashes)
        if self.snapshots is None or not found:
            return found, 0
        k = self.snapshots.depth([self.blocks[b].hash for b in found], len(found))
        return found[:k], len(found) - k

    def cached_run(self, tokens: Sequence[int], hashes: PrefixHashes | None = None) -> list[int]:
        """Cached blocks holding the leading whole blocks of ``tokens``, every one of them (none left to compute,
        no snapshot bound)."""
        return self._match(tokens, hashes, len(tokens) // self.block_tokens)

    def adopt(self, seq, blocks: Sequence[int]) -> None:
        """``seq`` computed its leading blocks itself, the same tokens as the cached ``blocks`` (a prefix no
        snapshot reached, computed again): its table takes those (referenced) and its own copies go back to the
        pool, so its later blocks chain to the cached ones and enter the cache."""
        table = self.tables[seq]
        for i, b in enumerate(blocks):
            if table[i] != b:
                self._ref(b)
                old, table[i] = table[i], b
                self._unref(old)

    def _match(self, tokens: Sequence[int], hashes: PrefixHashes | None, n_blocks: int | None = None) -> list[int]:
        if not self.prefix_cache:
            return []
        memo = self._memo(hashes)
        p, found, parent = self.block_tokens, [], ROOT_HASH
        for i in range((len(tokens) - 1) // p if n_blocks is None else n_blocks):
            h = self._block_hash(tokens, i, parent, memo)
            b = self._cache.get(h)
            if b is None:
                break
            block = self.blocks[b]
            if block.parent != parent or block.tokens != tuple(tokens[i * p:(i + 1) * p]):
                break
            if not self.pool_hits and block.ref == 0 and not self._backed(b):
                break
            found.append(b)
            parent = h
        return found

    def blocks_needed(self, tokens: Sequence[int], reserve_tokens: int | None = None,
                      hit: list[int] | None = None) -> int:
        """Free blocks ``allocate(tokens, reserve_tokens)`` would take (cached hits that are unreferenced count).

        ``hit`` is ``match(tokens)`` made since the pool last changed (matched now if not given).
        """
        if hit is None:
            hit = self.match(tokens)
        total = blocks_for(max(reserve_tokens or 0, len(tokens)), self.block_tokens)
        return total - len(hit) + sum(1 for b in hit if self.blocks[b].ref == 0)

    def can_allocate(self, tokens: Sequence[int], reserve_tokens: int | None = None,
                     hit: list[int] | None = None) -> bool:
        return self.blocks_needed(tokens, reserve_tokens, hit) <= self.num_free

    # ---- sequences -----------------------------------------------------------
    def allocate(self, seq, tokens: Sequence[int], reserve_tokens: int | None = None,
                 hit: list[int] | None = None) -> int:
        """Give ``seq`` a block table for ``tokens`` (and room up to ``reserve_tokens``); the tokens found cached.

        ``hit`` is ``match(tokens)`` made since the pool last changed (matched now if not given).
        """
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} already has blocks")
        if hit is None:
            hit = self.match(tokens)
        elif any(self._cache.get(self.blocks[b].hash) != b for b in hit):
            raise ValueError("the prefix hit is stale: a block in it left the cache since the match")
        need = self.blocks_needed(tokens, reserve_tokens, hit)
        if need > self.num_free:
            raise OutOfBlocks(f"KV pool: {need} blocks needed, {self.num_free} free", needed=need,
                              available=self.num_free, hint="lower --max-running or raise --kv-budget")
        for b in hit:
            self._ref(b)
        total = blocks_for(max(reserve_tokens or 0, len(tokens)), self.block_tokens)
        self.tables[seq] = hit + [self._take() for _ in range(total - len(hit))]
        if hit:
            self._chain[seq] = (len(hit), self.blocks[hit[-1]].hash)
        return len(hit) * self.block_tokens

    def grow_needed(self, seq, n_tokens: int) -> int:
        """Free blocks ``grow(seq, n_tokens)`` would take."""
        table, n = self.tables[seq], self.written(seq)
        extra = max(0, blocks_for(n_tokens, self.block_tokens) - len(table))
        tail = n // self.block_tokens
        cow = n_tokens > n and n % self.block_tokens and tail < len(table) and self.blocks[table[tail]].ref > 1
        return extra + bool(cow)

    def grow(self, seq, n_tokens: int) -> list[BlockCopy]:
        """Make room for ``seq`` to hold ``n_tokens``; the copies to make first (copy-on-write of a shared tail)."""
        need = self.grow_needed(seq, n_tokens)
        if need > self.num_free:
            raise OutOfBlocks(f"KV pool: {need} blocks needed, {self.num_free} free", needed=need,
                              available=self.num_free, hint="lower --max-running or raise --kv-budget")
        table, n, p = self.tables[seq], self.written(seq), self.block_tokens
        copies = []
        tail = n // p
        if n_tokens > n and n % p and tail < len(table) and self.blocks[table[tail]].ref > 1:
            new = self._take()
            self.blocks[new].filled = n % p
            copies.append(BlockCopy(table[tail], new, n % p))
            self._unref(table[tail])
            table[tail] = new
        while len(table) < blocks_for(n_tokens, p):
            table.append(self._take())
        return copies

    def shrink(self, seq, n_tokens: int) -> int:
        """Give back ``seq``'s blocks past what ``n_tokens`` need (grown for drafts that were rejected); how many."""
        table, keep = self.tables[seq], blocks_for(max(n_tokens, self.written(seq)), self.block_tokens)
        extra = table[keep:]
        del table[keep:]
        for b in reversed(extra):
            self._unref(b)
        return len(extra)

    def commit(self, seq, tokens: Sequence[int], hashes: PrefixHashes | None = None) -> None:
        """``seq`` now holds ``tokens`` (computed); newly full blocks enter the prefix cache.

        ``hashes`` is the memo of these tokens, as given to ``match``.
        """
        p, table = self.block_tokens, self.tables[seq]
        if len(tokens) > len(table) * p:
            raise ValueError(f"sequence {seq!r} holds {len(table)} blocks, not enough for {len(tokens)} tokens")
        n, before = len(tokens), self.written(seq)
        if n == before + 1 and n % p and (not self.prefix_cache or self._chain.get(seq, (0,))[0] >= n // p):
            self.blocks[table[before // p]].filled = n % p       # a decode inside its block: no block fills
            return
        for i in range(min(before, n) // p, blocks_for(max(before, n), p)):
            self.blocks[table[i]].filled = min(p, max(0, n - i * p))
        if not self.prefix_cache:
            return
        memo = self._memo(hashes)
        done, parent = self._chain.get(seq, (0, ROOT_HASH))
        for i in range(done, len(tokens) // p):
            block = self.blocks[table[i]]
            h = self._block_hash(tokens, i, parent, memo)
            if block.hash is None:
                chunk = tuple(tokens[i * p:(i + 1) * p])
                cached = self._cache.get(h)
                if (cached is not None and not self.pool_hits and self.blocks[cached].ref == 0
                        and not self._backed(cached)):
                    self._unhash(cached, keep_snapshot=True)   # a live copy serves hits better than one nobody holds
                # parking: a block whose parent in this sequence is not the cached one (both computed at once)
                # stays out, so that whoever holds a cached block holds its whole chain (one copy seats a hit)
                own = self.parking is None or i == 0 or self._cache.get(parent) == table[i - 1]
                if h not in self._cache and own:
                    block.hash, block.parent, block.tokens = h, parent, chunk
                    self._cache[h] = block.id
                elif self.snapshots is not None and h not in self._cache:
                    self.snapshots.discard(h)    # kept for a block that did not take the hash over after all
            parent = h
        self._chain[seq] = (max(done, len(tokens) // p), parent)

    def fork(self, parent, child) -> None:
        """``child`` shares the blocks ``parent`` has written (parallel branches); writes copy a shared partial
        tail, and each takes its own blocks past it (``grow``): a block both could write would hold one's tokens."""
        if child in self.tables:
            raise ValueError(f"sequence {child!r} already has blocks")
        self.tables[child] = self.tables[parent][:blocks_for(self.written(parent), self.block_tokens)]
        if parent in self._chain:
            self._chain[child] = self._chain[parent]
        for b in self.tables[child]:
            self._ref(b)

    def free(self, seq) -> None:
        """Drop ``seq``'s references; its blocks return to the pool now, or at ``end_step`` if a step is in flight.

        With ``parking`` the sequence is parked: its kept prefix (leading committed whole blocks
        the cache names) stays backed by ``seq`` until ``unpark`` or eviction.
        """
        n = self.written(seq)
        table = self.tables.pop(seq)
        self._chain.pop(seq, None)
        if self.parking is not None:
            self.parking.park_blocks(seq, table, n)
        for b in reversed(table):   # the tail first: it is the first to be evicted
            self._unref(b)

    def unpark(self, seq, keep_tokens: int = 0) -> int:
        """Keep only the first ``keep_tokens`` (whole blocks) of parked ``seq`` (0: forget it); tokens it keeps.

        An unreferenced block no parked sequence backs any more leaves the cache (to the free pool).
        """
        return self.parking.unpark(seq, keep_tokens) if self.parking is not None else 0

    def parked_sharers(self, seq) -> list[tuple[object, int]]:
        """Parked sequences sharing ``seq``'s leading blocks: (parked sequence, whole blocks in common), most first."""
        if self.parking is None:
            return []
        table = self.tables[seq]
        return self.parking.sharers(table, min(len(table), self.written(seq) // self.block_tokens))

    def sharers(self, seq) -> list[tuple[object, int]]:
        """Other sequences sharing ``seq``'s leading blocks: (sequence, whole blocks in common), most first."""
        table, p, out = self.tables[seq], self.block_tokens, []
        mine = self.written(seq) // p
        for other, theirs in self.tables.items():
            k = 0
            limit = min(len(table), len(theirs), self.written(other) // p, mine)
            while k < limit and table[k] == theirs[k]:
                k += 1
            if other != seq and k:
                out.append((other, k))
        return sorted(out, key=lambda x: -x[1])

    def preload(self, tokens: Sequence[int]) -> int:
        """Put the whole blocks of ``tokens`` in the prefix cache, unreferenced (a warm cache); blocks stored."""
        n = len(tokens) // self.block_tokens * self.block_tokens
        if n == 0 or not self.prefix_cache:
            return 0
        key, whole, memo = object(), tuple(tokens[:n]), PrefixHashes()
        self.allocate(key, whole, hit=self.match(whole, memo))
        self.commit(key, whole, memo)
        self.free(key)
        self.unpark(key)     # no sequence holds a preloaded block's KV
        return n // self.block_tokens

    def _memo(self, hashes: PrefixHashes | None) -> PrefixHashes | None:
        return None if hashes is None else hashes._for((self.block_tokens, self.hash_fn))

    def _block_hash(self, tokens: Sequence[int], i: int, parent: int, memo: PrefixHashes | None) -> int:
        """The chain hash of whole block ``i`` of ``tokens`` (``parent``: block i − 1's), from the memo if it has it."""
        if memo is not None and i < len(memo.values):
            return memo.values[i]
        p = self.block_tokens
        h = self.hash_fn(parent, tuple(tokens[i * p:(i + 1) * p]))
        if memo is not None and i == len(memo.values):
            memo.values.append(h)
        return h

    # ---- steps in flight -----------------------------------------------------
    def begin_step(self) -> None:
        self._in_flight = True

    def end_step(self) -> None:
        """The step in flight completed: blocks freed during it join the pool."""
        self._in_flight = False
        deferred, self._deferred = self._deferred, []
        for b in deferred:
            self._release(b)

    # ---- blocks --------------------------------------------------------------
    def _ref(self, b: int) -> None:
        block = self.blocks[b]
        if block.ref == 0:
            self._lru.pop(b, None)
            self.used += 1
            self.peak_used = max(self.peak_used, self.used)
        block.ref += 1

    def _unref(self, b: int) -> None:
        block = self.blocks[b]
        block.ref -= 1
        if block.ref == 0:
            self.used -= 1
            if self._in_flight:
                self._deferred.append(b)
            else:
                self._release(b)

    def _release(self, b: int) -> None:
        block = self.blocks[b]
        if block.ref:
            return   # referenced again (a cache hit) before the deferred release
        if (block.hash is not None and self._cache.get(block.hash) == b
                and (self.pool_hits or self.parking is None or self._backed(b))):
            self._lru[b] = None
        else:
            self._reset(block)
            self._free.append(b)

    def uncache_if_unused(self, b: int) -> None:
        """Block ``b`` lost its last parked backer: unreferenced and waiting in the LRU, it leaves the cache."""
        if self.blocks[b].ref == 0 and b in self._lru:
            self._unhash(b)

    def _unhash(self, b: int, keep_snapshot: bool = False) -> None:
        """Take unreferenced block ``b`` out of the prefix cache (into the free pool, unless a release is pending);
        ``keep_snapshot``: its hash's snapshot stays, for the block that takes the hash over."""
        block = self.blocks[b]
        self._uncache(block.hash, keep_snapshot)
        if b in self._lru:
            del self._lru[b]
            self._reset(block)
            self._free.append(b)

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._lru.popitem(last=False)
            self.evictions += 1
            if self.parking is not None:
                self.parking.evict(b)
            self._reset(self.blocks[b])
        self._ref(b)
        return b

    def _uncache(self, h: int, keep_snapshot: bool = False) -> None:
        """Hash ``h`` leaves the prefix cache, and its snapshot with it (unless ``keep_snapshot``)."""
        del self._cache[h]
        if self.snapshots is not None and not keep_snapshot:
            self.snapshots.discard(h)

    def _reset(self, block: Block) -> None:
        if block.hash is not None and self._cache.get(block.hash) == block.id:
            self._uncache(block.hash)
        block.hash, block.parent, block.tokens, block.filled = None, None, (), 0
