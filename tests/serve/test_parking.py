"""Parked sequences: a finished request's KV stays for later prefix hits (block manager, and the engine on an
executor that keeps KV only in its sequences, whose next token depends on every token its slot holds)."""

from itertools import count

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localinfer.serve.assembly import build_step_engine
from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine
from localinfer.serve.http.sampler import ServeRequest
from localinfer.serve.parking import Parking
from localinfer.serve.request import FinishReason, Request, State
from localinfer.serve.scheduler import Scheduler, SchedulerConfig
from localinfer.serve.simulated import SimulatedExecutor
from localinfer.serve.step_model import LinearStepModel
from tests.support.engine_ops import OPS, apply_ops

CARD = LinearStepModel.parse("26.22,30.4,3")
VOCAB = 4096


def toks(n, base):
    return tuple(range(base, base + n))


def _held(bm, seq, tokens):
    bm.allocate(seq, tokens, hit=bm.match(tokens))
    bm.commit(seq, tokens)


# ---- the block manager ------------------------------------------------------------------------------------
def test_a_parked_sequence_keeps_its_whole_committed_blocks_as_hits():
    bm = BlockManager(16, 4, pool_hits=False, parking=Parking())
    a = toks(10, 0)
    _held(bm, "a", a)
    bm.free("a")
    assert bm.parked == {"a": [0, 1]} and bm.used == 0 and bm.num_cached == 2 and bm.num_free == 16
    assert bm.tokens_held() == 8                          # the tail (2 tokens) is not kept
    assert len(bm.match(a + (7,))) == 2
    assert bm.allocate("b", a + (7,)) == 8
    assert bm.parked_sharers("b") == [("a", 2)] and bm.num_cached == 0
    bm.free("b")
    assert sorted(bm.parked) == ["a", "b"] and bm.num_cached == 2
    assert bm.unpark("a") == 0 and bm.num_cached == 2     # b still keeps them
    assert bm.unpark("b", 4) == 4 and bm.num_cached == 1 and bm.parked == {"b": [0]}
    assert bm.unpark("b") == 0 and bm.num_cached == 0 and bm.match(a + (7,)) == [] and bm.num_free == 16


def test_without_parking_live_hits_only_as_before():
    bm = BlockManager(16, 4, pool_hits=False)
    _held(bm, "a", toks(10, 0))
    bm.free("a")
    assert bm.parked == {} and bm.num_cached == 2 and bm.match(toks(10, 0)) == []


def test_an_unparked_sequence_leaves_nothing_cached():
    bm = BlockManager(16, 4, pool_hits=False, parking=Parking())
    _held(bm, "a", toks(12, 0))
    bm.begin_step()
    bm.free("a")                                          # while a step is in flight: released at its end
    assert bm.unpark("a") == 0
    bm.end_step()
    assert bm.num_cached == 0 and bm.num_free == 16 and bm.match(toks(12, 0) + (1,)) == []


def test_eviction_cuts_every_parked_sequence_holding_the_block():
    cut = []
    bm = BlockManager(6, 4, pool_hits=False, parking=Parking(on_evict=lambda seq, start: cut.append((seq, start))))
    a = toks(12, 0)
    _held(bm, "a", a)
    bm.free("a")                                          # parked: blocks 0, 1, 2
    _held(bm, "c", a[:8] + toks(4, 50))                   # hits 0, 1; its own third block
    bm.free("c")
    assert bm.parked == {"a": [0, 1, 2], "c": [0, 1, 3]} and bm.num_cached == 4 and bm.num_free == 6
    bm.allocate("d", toks(12, 100))                       # 3 blocks: 2 free, then the oldest cached (a's tail)
    assert cut == [("a", 8)] and bm.parked["a"] == [0, 1] and bm.evictions == 1
    bm.allocate("e", toks(8, 200))                        # c's tail, then block 1 (both parked sequences)
    assert cut[:2] == [("a", 8), ("c", 8)] and sorted(cut[2:]) == [("a", 4), ("c", 4)]
    assert bm.parked == {"a": [0], "c": [0]} and bm.tokens_held() == 4      # d and e wrote nothing yet
    assert len(bm.match(a + (1,))) == 1


def test_evicting_a_parent_first_makes_the_deeper_blocks_unmatchable():
    cut = []
    bm = BlockManager(4, 4, pool_hits=False, parking=Parking(on_evict=lambda seq, start: cut.append((seq, start))))
    a = toks(12, 0)
    _held(bm, "a", a)
    bm.free("a")
    bm._lru.move_to_end(1, last=False)                    # the middle block is the oldest (not the usual order)
    bm.allocate("x", toks(8, 100))                        # the free block, then block 1
    assert cut == [("a", 4)] and bm.parked == {"a": [0]}
    assert bm.num_cached == 1 and len(bm._free) == 1      # block 2 went back to the pool: no KV behind it
    assert len(bm.match(a + (1,))) == 1


def test_preload_parks_nothing():
    bm = BlockManager(8, 4, pool_hits=False, parking=Parking())
    assert bm.preload(toks(8, 0)) == 2
    assert bm.parked == {} and bm.num_cached == 0 and bm.match(toks(8, 0) + (1,)) == []


# ---- the engine -------------------------------------------------------------------------------------------
class ContentExecutor(SimulatedExecutor):
    """Keeps KV only in its slots (no restore), and each next token is a function of every (position, token)
    the slot holds: a wrong or missing cell after a copy, drop or park changes the output."""

    restores_cached_prefix = False
    drops_tail = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.cell_token: dict[int, int] = {}
        self._cell_ids = count()

    def step(self, chunks):
        super().step(chunks)          # the checks and the clock; cells are rebuilt below with their tokens
        out = {}
        for ch in chunks:
            cells = self._cells[ch.slot]
            del cells[ch.start:]
            for t in ch.tokens:
                c = next(self._cell_ids)
                self.cell_token[c] = t
                cells.append(c)
            if ch.logits:
                row = np.zeros(self.n_vocab, dtype=np.float32)
                row[_next(tuple(self.cell_token[c] for c in cells))] = 1.0
                out[ch.slot] = row
        return out


def _next(history: tuple[int, ...]) -> int:
    return hash(history) % VOCAB


def cold(prompt, n):
    out, seq = [], tuple(prompt)
    for _ in range(n):
        t = _next(seq)
        out.append(t)
        seq += (t,)
    return out


def parking_engine(n_blocks=40, p=4, max_running=2, park=2, **cfg):
    ex = ContentExecutor(CARD, n_slots=max_running + park, n_vocab=VOCAB)
    cfg = {"policy": "chunked", "chunk_tokens": 8, **cfg}
    return build_step_engine(ex, SchedulerConfig(max_running=max_running, **cfg), block_tokens=p, num_blocks=n_blocks,
                             park_slots=park)


def _run(e, check=True):
    while e.unfinished:
        if not e.step() and not e.scheduler.running:
            e._idle()
        if check:
            assert e.executor.cells_used() == e.blocks.tokens_held()


def test_a_finished_request_is_parked_and_a_later_one_copies_its_prefix():
    e = parking_engine()
    system = toks(13, 1000)
    a = e.add_request(Request("a", system + (1,), 5))
    _run(e)
    assert e.parked == 1 and e.blocks.used == 0 and e.blocks.num_cached == 4      # 14 + 4 tokens: 4 whole blocks
    assert e.executor.cells_used() == 16 == e.blocks.tokens_held()
    copies = []
    copy = e.executor.copy
    e.executor.copy = lambda s, d, n: copies.append((s, d, n)) or copy(s, d, n)
    b = e.add_request(Request("b", system + (2,), 5, arrival_s=e.executor.clock()))
    _run(e)
    assert b.cached == 12 and len(copies) == 1 and copies[0][2] == 12
    assert a.output == cold(a.prompt, 5) and b.output == cold(b.prompt, 5)
    again = e.add_request(Request("again", a.prompt, 5, arrival_s=e.executor.clock()))
    _run(e)
    assert again.cached == 12 and again.output == a.output      # the identical prompt: all but its last block


def test_multi_turn_hits_the_whole_previous_turn():
    e = parking_engine()
    t1 = e.add_request(Request("t1", toks(21, 1000), 6))
    _run(e)
    turn2 = t1.prompt + tuple(t1.output) + toks(7, 5000)
    t2 = e.add_request(Request("t2", turn2, 4, arrival_s=e.executor.clock()))
    _run(e)
    assert t2.cached == (21 + 6 - 1) // 4 * 4 == 24 and t2.output == cold(turn2, 4)


def test_cancelled_requests_are_parked_too_and_their_uncommitted_tail_dropped():
    e = parking_engine()
    r = e.add_request(Request("r", toks(30, 1000), 50))
    for _ in range(6):
        e.step()
    assert e.cancel("r") and r.finish_reason is FinishReason.CANCELLED
    assert e.parked == 1 and e.executor.cells_used() == e.blocks.tokens_held() == r.computed // 4 * 4
    b = e.add_request(Request("b", r.view()[:r.computed] + (9,), 3, arrival_s=e.executor.clock()))
    _run(e)
    assert b.cached == r.computed // 4 * 4 and b.output == cold(b.prompt, 3)


def test_evicted_parked_blocks_drop_their_kv_and_a_later_prefix_gets_a_partial_correct_hit():
    e = parking_engine(n_blocks=12, max_running=1, park=2)
    a = e.add_request(Request("a", toks(40, 1000), 1))            # 10 whole blocks + nothing kept past them
    _run(e)
    assert e.blocks.num_cached == 10
    e.add_request(Request("f", toks(22, 7000), 3, arrival_s=e.executor.clock()))   # 6 blocks: 2 free, 4 of a's
    _run(e)
    assert e.blocks.evictions == 4 and e.executor.cells_used() == e.blocks.tokens_held() == 12 * 4
    kept = len(e.blocks.parked["a"])
    assert kept == 6
    late = e.add_request(Request("late", a.prompt + (5,), 4, arrival_s=e.executor.clock()))
    _run(e)
    assert late.cached == kept * 4 and late.output == cold(late.prompt, 4)


def test_the_least_recently_used_parked_request_gives_its_slot_up():
    e = parking_engine(max_running=1, park=2)
    for i in range(3):
        e.add_request(Request(f"p{i}", toks(9, 1000 * (i + 1)), 2, arrival_s=e.executor.clock()))
        _run(e)
    assert list(e._parked) == ["p1", "p2"] and sorted(e.blocks.parked) == ["p1", "p2"]
    assert e.executor.cells_used() == e.blocks.tokens_held() == 16
    r = e.add_request(Request("r", toks(9, 1000), 2, arrival_s=e.executor.clock()))
    _run(e)
    assert r.cached == 0                                          # p0's blocks left the cache with its slot


def test_a_prompt_sent_again_with_another_answer_gives_up_the_first_answer_not_another_conversation():
    """All ids parked, a prompt comes back and is answered differently (a regenerate; resent prompts whose first
    token flipped): the earlier answer's id goes, since its prompt stays in the new one, not the least recently
    used conversation, which would be the next one wanted when prompts come back in turn."""
    e = parking_engine(max_running=1, park=2)
    a = e.add_request(Request("a", toks(9, 1000), 7))        # 9 + 6 computed: blocks 1-2 the prompt, 3 its answer
    _run(e)
    b = e.add_request(Request("b", toks(9, 2000), 7, arrival_s=e.executor.clock()))
    _run(e)
    again = e.add_request(ServeRequest("a2", a.prompt, 7, arrival_s=e.executor.clock(), banned=frozenset(a.output[:1])))
    _run(e)
    assert again.cached == 8 and again.output[0] != a.output[0]
    assert list(e._parked) == ["b", "a2"] and sorted(e.blocks.parked) == ["a2", "b"]
    b2 = e.add_request(Request("b2", b.prompt, 7, arrival_s=e.executor.clock()))
    _run(e)
    assert b2.cached == 8 and b2.output == b.output == cold(b.prompt, 7)
    e.add_request(Request("c", toks(9, 3000), 7, arrival_s=e.executor.clock()))   # no pair left: plain LRU
    _run(e)
    assert list(e._parked) == ["b", "c"]       # b2 gave b its blocks back (the same answer): one id for both


def test_a_preempted_request_is_not_parked():
    e = parking_engine(n_blocks=10, max_running=2, park=2, admission="on_demand")
    reqs = [e.add_request(Request(f"r{i}", toks(14, 1000 * (i + 1)), 14)) for i in range(2)]
    preempted = set()
    while e.unfinished:
        e.step()
        preempted |= {r.id for r in reqs if r.state is State.WAITING and r.preemptions}
        assert e.executor.cells_used() == e.blocks.tokens_held()
        assert not preempted & set(e._parked) - {r.id for r in reqs if r.finished}
    assert preempted and all(r.output == cold(r.prompt, 14) for r in reqs)


def test_prefix_cache_off_or_no_spare_slots_parks_nothing():
    ex = ContentExecutor(CARD, n_slots=4, n_vocab=VOCAB)
    e = StepEngine(ex, Scheduler(SchedulerConfig(max_running=2),
                                 BlockManager(40, 4, prefix_cache=False, pool_hits=False, parking=Parking(2))))
    e.add_request(Request("a", toks(13, 0), 3))
    _run(e)
    assert e.parked == 0 and ex.cells_used() == 0 and e.blocks.num_cached == 0
    with pytest.raises(ValueError, match="exceed"):
        StepEngine(ContentExecutor(CARD, n_slots=3), Scheduler(SchedulerConfig(max_running=2),
                                                               BlockManager(40, 4, pool_hits=False, parking=Parking(2))))
    with pytest.raises(ValueError, match="pool_hits=False"):
        StepEngine(SimulatedExecutor(CARD, n_slots=4), Scheduler(SchedulerConfig(max_running=2),
                                                                 BlockManager(40, 4, parking=Parking(2))))


@settings(max_examples=40, deadline=None)
@given(OPS, st.sampled_from(["reserve", "on_demand"]), st.integers(1, 3))
def test_random_add_step_cancel_with_parking_keeps_cells_equal_to_blocks(seq, admission, park):
    e = parking_engine(n_blocks=24, max_running=3, park=park, admission=admission)

    def check(e):
        assert e.blocks.used <= e.blocks.num_blocks and e.parked <= park
        assert e.executor.cells_used() == e.blocks.tokens_held()     # every cell is a block's, every block's cells

    apply_ops(e, seq, tuple(range(500, 512)), check)
    _run(e)
    assert e.blocks.used == 0 and e.executor.cells_used() == e.blocks.num_cached * 4 == e.blocks.tokens_held()
    for r in e.scheduler.requests.values():
        assert r.finish_reason in (FinishReason.LENGTH, FinishReason.CANCELLED, FinishReason.ERROR)
        assert r.output == cold(r.prompt, len(r.output))


# ---- the server's settings --------------------------------------------------------------------------------
def test_serve_config_gives_the_executor_ids_for_parked_sequences_and_build_engine_parks_in_them():
    from localinfer.serve.http.config import DEFAULT_PARKED, ServeConfig, build_engine

    assert (ServeConfig.build(parallel=4).n_slots, ServeConfig.build(parallel=4, park=4).n_slots) == (4 + DEFAULT_PARKED, 8)
    assert ServeConfig.build(parallel=4, park=0).n_slots == ServeConfig.build(parallel=4, prefix_cache=False).n_slots == 4
    assert ServeConfig.build(parallel=200, park=100).park_slots == 56        # llama.cpp's 256 sequence ids
    inner = ContentExecutor(CARD, n_slots=6, n_vocab=VOCAB)
    inner.n_cells, inner.drops_tail = 256, True
    _, engine, _ = build_engine(inner, ServeConfig.build(parallel=2, park=2))
    assert engine.park_slots == 2 and engine.scheduler.config.max_running == 2 and engine.blocks.parking
    _, engine, _ = build_engine(inner, ServeConfig.build(parallel=2, park=8))
    assert engine.park_slots == 4                                      # what the executor has beyond --parallel
    inner.drops_tail = False                                           # a recurrent model: nothing parked
    _, engine, _ = build_engine(inner, ServeConfig.build(parallel=2))
    assert engine.park_slots == 0 and not engine.blocks.parking


def test_a_failed_prefix_copy_ends_that_steps_requests_in_error_and_the_engine_goes_on():
    ex = SimulatedExecutor(CARD, n_slots=3)
    e = StepEngine(ex, Scheduler(SchedulerConfig(max_running=2, policy="chunked"),
                                 BlockManager(40, 4, pool_hits=False, parking=Parking(1))))
    first = e.add_request(Request("a", toks(12, 0), 2))
    e.run()
    assert e.parked == 1 and first.finish_reason is FinishReason.LENGTH
    copy = ex.copy

    def broken(*a, **kw):
        raise RuntimeError("no cells")

    ex.copy = broken
    hit = e.add_request(Request("b", toks(12, 0) + (9,), 2))         # seated by a copy from the parked one
    with pytest.raises(RuntimeError, match="no cells"):
        e.step()
    assert hit.finish_reason is FinishReason.ERROR and "no cells" in hit.error and not e.scheduler.running
    ex.copy = copy
    again = e.add_request(Request("c", toks(12, 0) + (8,), 2))
    e.run()
    assert again.finish_reason is FinishReason.LENGTH and again.cached == 12 and e.blocks.used == 0   # a still parked
