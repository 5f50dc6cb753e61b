"""Block manager: paged counts, prefix sharing, fork + copy-on-write, LRU eviction, deferred free."""

import pytest

from localinfer.model.kv import kv_bytes_per_token
from localinfer.plan.paging import (
    block_bytes,
    blocks_for,
    blocks_in_budget,
    max_sequences,
    page_usage,
    shared_prefix_kv,
    tokens_held,
)
from localinfer.serve.block_manager import BlockManager, OutOfBlocks
from localinfer.units import GiB, KiB, MiB
from tests.support import chapter

LENGTHS = [9, 13, 5, 15]    # sequences A, B, C, D; each may grow to 16


def toks(n, base):
    return tuple(range(base, base + n))


def test_contiguous_reservation_and_paging():
    contiguous = BlockManager(8, block_tokens=16)
    for i, n in enumerate(LENGTHS):
        contiguous.allocate(i, toks(n, 1000 * i), reserve_tokens=16)
    assert contiguous.used * 16 == 64
    paged = BlockManager(64, block_tokens=4)
    for i, n in enumerate(LENGTHS):
        paged.allocate(i, toks(n, 1000 * i))
        paged.commit(i, toks(n, 1000 * i))
    assert paged.used * 4 == 52
    assert paged.tokens_in_use() == 42
    assert contiguous.used * 16 - 42 == 22 and paged.used * 4 - 42 == 10
    assert paged.used * 4 == page_usage(LENGTHS, 4).slots


def test_a_and_b_share_eight_tokens():
    bm = BlockManager(64, block_tokens=4)
    seqs = [toks(9, 0), toks(8, 0) + toks(5, 500), toks(5, 2000), toks(15, 3000)]
    hits = []
    for i, s in enumerate(seqs):
        hits.append(bm.allocate(i, s))
        bm.commit(i, s)
    assert hits == [0, 8, 0, 0]
    assert bm.used * 4 == 44
    assert bm.used == page_usage(LENGTHS, 4, shared_prefix=8, sharing=[0, 1]).physical_blocks
    assert bm.sharers(1) == [(0, 2)]


def test_four_branches_share_95_blocks():
    p = 16
    bm = BlockManager(200, block_tokens=p)
    prefix = toks(95 * p, 0)
    bm.allocate("trunk", prefix)
    bm.commit("trunk", prefix)
    for b in range(1, 4):
        bm.fork("trunk", b)
    for b in ["trunk", 1, 2, 3]:
        assert bm.grow(b, (95 + 9) * p) == []       # whole shared blocks: nothing to copy
    assert bm.references == 416
    assert bm.used == 131
    assert bm.used == 95 + 4 * 9


def test_copy_on_write_of_a_shared_partial_tail():
    bm = BlockManager(8, block_tokens=4)
    bm.allocate("a", toks(10, 0))
    bm.commit("a", toks(10, 0))
    bm.fork("a", "b")
    assert bm.used == 3
    copies = bm.grow("b", 11)
    assert len(copies) == 1 and copies[0].n_tokens == 2 and copies[0].src == bm.tables["a"][2]
    assert bm.tables["b"][2] == copies[0].dst and bm.tables["b"][:2] == bm.tables["a"][:2]
    assert bm.used == 4
    assert bm.grow("a", 11) == []                     # "a" is the tail's only holder now


def test_long_requests_sharing_6144_tokens(tmp_path):
    spec = chapter.spec(tmp_path)
    k = kv_bytes_per_token(spec)
    assert k == 144 * KiB
    held = tokens_held(8192, 256)
    bm = BlockManager(10_000, block_tokens=16)
    system = toks(6144, 0)
    for i in range(16):
        prompt = system + toks(8192 - 6144, 10_000 * (i + 1))
        bm.allocate(i, prompt, reserve_tokens=held)
        bm.commit(i, prompt)
    total = bm.used * block_bytes(k, 16)
    assert total == 6048 * MiB
    kv = shared_prefix_kv(spec, 6144, held, 16)
    assert (kv.prefix_bytes, kv.private_bytes, kv.total) == (864 * MiB, 324 * MiB, total)


@pytest.mark.parametrize("shared, admitted", [(True, 35), (False, 10)])
def test_12_gib_admits(tmp_path, shared, admitted):
    spec = chapter.spec(tmp_path)
    k = kv_bytes_per_token(spec)
    bm = BlockManager(blocks_in_budget(12 * GiB, k, 16), block_tokens=16)
    held, n = tokens_held(8192, 256), 0
    while True:
        prompt = (toks(6144, 0) if shared else toks(6144, 10**7 * (n + 1))) + toks(2048, 10_000 * (n + 1))
        if not bm.can_allocate(prompt, held):
            break
        bm.allocate(n, prompt, reserve_tokens=held)
        bm.commit(n, prompt)
        n += 1
    assert n == admitted
    kv = shared_prefix_kv(spec, 6144 if shared else 0, held)
    assert kv.max_sequences(12 * GiB) == admitted
    if not shared:
        assert max_sequences(12 * GiB, blocks_for(held) * block_bytes(k)) == admitted
    with pytest.raises(OutOfBlocks):
        bm.allocate("over", toks(8192, 7 * 10**8), reserve_tokens=held)


def test_hash_collisions_are_misses():
    bm = BlockManager(16, block_tokens=4, hash_fn=lambda parent, tokens: 7)
    bm.allocate("a", toks(12, 0))
    bm.commit("a", toks(12, 0))
    assert bm.match(toks(12, 100) + (1,)) == []
    assert len(bm.match(toks(12, 0) + (1,))) == 1      # only the block stored under the hash


def test_lru_eviction_deepest_first():
    bm = BlockManager(4, block_tokens=4)
    a = toks(8, 0)
    bm.allocate("a", a)
    bm.commit("a", a)
    bm.free("a")
    assert (bm.used, bm.num_cached, bm.num_free) == (0, 2, 4)
    assert len(bm.match(a + (9,))) == 2
    bm.allocate("b", toks(12, 100))
    assert bm.evictions == 1
    assert len(bm.match(a + (9,))) == 1                 # the root block survived
    bm.free("b")
    assert bm.allocate("c", a + (9,)) == 4


def test_deferred_free_until_the_step_completes():
    bm = BlockManager(4, block_tokens=4)
    bm.allocate("a", toks(16, 0), reserve_tokens=16)
    bm.begin_step()
    bm.free("a")
    assert bm.used == 0 and bm.num_free == 0
    assert not bm.can_allocate(toks(4, 50))
    bm.end_step()
    assert bm.num_free == 4


def test_preload_warms_the_cache():
    bm = BlockManager(8, block_tokens=4)
    assert bm.preload(toks(10, 0)) == 2
    assert (bm.used, bm.num_cached) == (0, 2)
    assert bm.allocate("x", toks(10, 0) + (5, 6)) == 8


def test_live_hits_only():
    bm = BlockManager(8, block_tokens=4, pool_hits=False)
    a = toks(8, 0)
    bm.allocate("a", a)
    bm.commit("a", a)
    assert bm.allocate("b", a + (1,)) == 8              # "a" still holds the blocks
    bm.free("a")
    bm.free("b")
    assert bm.num_cached == 2 and bm.match(a + (1,)) == []


def test_paging_helpers_the_block_manager_counts_with():
    k = 144 * KiB
    assert block_bytes(k, 16) == 2304 * KiB
    assert blocks_in_budget(12 * GiB, k, 16) == 12 * GiB // (16 * k) == 5461
    from localinfer.plan.paging import request_blocks

    assert request_blocks(8192, 256) == 528 and request_blocks(8192, 256, 16, cached_tokens=6144) == 144
    bm = BlockManager(600, 16)
    assert bm.blocks_needed(toks(8192, 0), tokens_held(8192, 256)) == request_blocks(8192, 256)


def test_a_live_block_takes_over_the_hash_of_one_nobody_holds():
    """Without pool hits, a finished request's cached block must not hide an identical live one."""
    bm = BlockManager(64, 4, pool_hits=False)
    p = tuple(range(100, 116))
    bm.allocate("a", p + (1,))
    bm.commit("a", p + (1,))
    bm.free("a")
    bm.allocate("b", p + (2,))
    bm.commit("b", p + (2,))
    hit = bm.match(p + (3,))
    assert len(hit) == 4 and hit == bm.tables["b"][:4]
    assert bm.num_free == 64 - len(bm.tables["b"])        # a's old blocks went back to the pool


def test_max_used_caps_the_referenced_blocks_and_the_rest_only_cache():
    """A pool of 12 blocks of which requests may reference 4 (the cells): admission counts within the cap, and
    released blocks stay cached past it (parked KV in host memory), to be hit again."""
    bm = BlockManager(12, 4, max_used=4)
    assert bm.capacity == 4 and bm.num_free == 4
    a, b, c = toks(8, 0), toks(8, 100), toks(8, 200)
    for name, t in (("a", a), ("b", b), ("c", c)):
        bm.allocate(name, t)                  # 2 blocks each
        bm.commit(name, t)
        if name == "a":
            assert bm.num_free == 2 and not bm.can_allocate(toks(12, 300))   # 3 blocks: over the cap
        bm.free(name)
    assert bm.used == 0 and bm.num_cached == 6 > bm.capacity          # all three stay cached
    assert len(bm.match(a + (1,))) == len(bm.match(b + (1,))) == len(bm.match(c + (1,))) == 2
    hit = bm.match(a + (1,))
    bm.allocate("a2", a + (1,), hit=hit)      # the hit's 2 cached blocks plus one new: 3 referenced
    assert bm.used == 3 and bm.num_free == 1


def test_forked_branches_count_their_own_tokens():
    """A fork shares what the parent wrote; each branch then writes its own blocks, so neither's writes change
    what the other holds (``written`` is read off the blocks)."""
    for start in (20, 32):                       # a partial tail shared, and a block boundary
        bm = BlockManager(20, 16)
        first = list(range(start))
        bm.allocate("a", first, reserve_tokens=48)
        bm.commit("a", first)
        bm.fork("a", "b")
        assert bm.written("b") == start
        bm.grow("a", 40)
        bm.commit("a", list(range(40)))
        assert (bm.written("a"), bm.written("b")) == (40, start)
        bm.grow("b", start + 1)
        bm.commit("b", first + [99])
        assert (bm.written("a"), bm.written("b")) == (40, start + 1)
        assert bm.tokens_in_use() == 40 + 1 + start % 16      # b's copied tail block (or its fresh one)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_decode_committed_token_by_token_ends_as_one_commit(prefix_cache):
    """A token written inside a block skips the chain (commit's fast exit for a decode): the blocks' fill, hashes
    and the cache end as one commit of the same tokens leaves them, with a hit at the start and blocks filled
    past it."""
    seqs = []
    for by_token in (True, False):
        bm = BlockManager(16, block_tokens=4, prefix_cache=prefix_cache)
        bm.allocate("w", toks(8, 0))
        bm.commit("w", toks(8, 0))
        tokens = toks(8, 0) + toks(22, 50)
        assert bm.allocate("a", tokens[:11], reserve_tokens=30) == (8 if prefix_cache else 0)
        bm.commit("a", tokens[:11])
        for n in range(12, 31) if by_token else (30,):
            bm.commit("a", tokens[:n])
            assert bm.written("a") == n
        seqs.append(([(b.ref, b.filled, b.hash, b.parent, b.tokens) for b in bm.blocks], bm.num_cached,
                     bm.tables["a"], len(bm.match(tokens + (1,)))))
    assert seqs[0] == seqs[1]
    assert seqs[0][3] == (7 if prefix_cache else 0)
