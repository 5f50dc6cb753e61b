"""Compaction of the unified KV cache (compaction.py): each sequence's cells in one run again after a churn.

Embedded model, 1 thread, flash attention on, chunks under 64 rows (ggml's one-row kernel: each row sums over its
own cells in cache order).  In a churned cache a row's new cell lands in a hole below some of its sequence's cells,
where it would not alone, so the same row gives other logits in a batch than alone; once compacted the free cells
lie above every sequence and a row in a batch equals the row alone, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from localinfer.backends.executor import Chunk

pytest.importorskip("llama_cpp")

ROWS = 4


@pytest.fixture(scope="module")
def executor(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=ROWS + 1, n_ctx=1024, threads=1, flash_attn=True) as ex:
        yield ex


@pytest.fixture
def ex(executor):
    for s in range(executor.n_slots):
        executor.drop(s)
    executor.compaction.auto = True
    return executor


def runs(ex) -> dict[int, int]:
    """Per slot, the runs of adjacent cells its cells form (cells() lists them in cache order)."""
    got: dict[int, int] = {}
    last = None
    for _pos, slots in ex.cells():
        assert len(slots) == 1
        if slots[0] != last:
            got[slots[0]] = got.get(slots[0], 0) + 1
        last = slots[0]
    return got


def churn(ex, steps: int, seed: int = 0) -> list[int]:
    """ROWS sequences out of step: each starts 6 steps after the one before, decodes 20 tokens after a 24-token
    prompt (in chunks of 12) and is replaced by a fresh prompt; the slots' lengths at the end."""
    rng = np.random.default_rng(seed)
    lens, left = [0] * ROWS, [0] * ROWS
    for step in range(steps):
        chunks = []
        for s in range(ROWS):
            if step < 6 * s:
                continue
            if left[s] == 0 and lens[s]:
                ex.drop(s)
                lens[s] = 0
            if lens[s] < 24:
                chunks.append(Chunk(s, tuple(int(t) for t in rng.integers(100, 20000, 12)), lens[s], lens[s] == 12))
                left[s] = 20
            else:
                chunks.append(Chunk(s, (int(rng.integers(100, 20000)),), lens[s], True))
                left[s] -= 1
        ex.step(chunks)
        for c in chunks:
            lens[c.slot] = c.start + len(c.tokens)
    return lens


def next_logits(ex, lens, slots=range(ROWS)):
    """Each slot's next-token logits in one batch, and each alone (every added position dropped again)."""
    batch = ex.step([Chunk(s, (7,), lens[s], True) for s in slots])
    alone = {}
    for s in slots:
        ex.drop(s, lens[s])
    for s in slots:
        alone[s] = ex.step([Chunk(s, (7,), lens[s], True)])[s]
        ex.drop(s, lens[s])
    return batch, alone


def positions(ex) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for pos, slots in ex.cells():
        got.setdefault(slots[0], []).append(pos)
    return got


def test_compaction_lays_each_sequence_in_one_run_in_its_order(ex):
    ex.compaction.auto = False
    lens = churn(ex, 90)
    assert max(runs(ex).values()) > 10            # the churn interleaved them
    used, order = ex.cells_used(), positions(ex)
    assert any(p != sorted(p) for p in order.values())    # prompts spread into holes below their own cells
    assert ex.compact()
    assert runs(ex) == dict.fromkeys(range(ROWS), 1)
    assert ex.cells_used() == used and positions(ex) == order
    assert [ex.slot_len(s) for s in range(ROWS)] == lens
    batch, alone = next_logits(ex, lens)
    for s in range(ROWS):
        assert np.array_equal(batch[s], alone[s]), s
    assert ex.compaction.count >= 1 and ex.compaction.bytes > 0


def test_the_policy_compacts_a_churn_by_itself(ex):
    ex.compaction.auto = False
    churn(ex, 120, seed=1)
    off = max(runs(ex).values())
    for s in range(ex.n_slots):
        ex.drop(s)
    ex.compaction.auto = True
    count = ex.compaction.count
    churn(ex, 120, seed=1)
    assert ex.compaction.count > count
    on = runs(ex)
    # since the last compaction each step of several sequences added at most one run to each, its prompt chunks two
    assert max(on.values()) <= 1 + ex.compaction.interleaved + 2
    assert max(on.values()) < off


def test_cells_two_slots_share_are_never_compacted(ex):
    ex.compaction.auto = False
    lens = churn(ex, 60, seed=2)
    ex.copy(0, ROWS, lens[0])                   # seq_cp: slot 0's cells now held by two slots
    layout = ex.cells()
    assert not ex.compact()
    assert ex.cells() == layout
    ex.drop(ROWS)                               # the copy goes: slot 0's cells are its own again
    order = positions(ex)
    assert ex.compact()
    assert runs(ex) == dict.fromkeys(range(ROWS), 1) and positions(ex) == order
    batch, alone = next_logits(ex, lens)
    for s in range(ROWS):
        assert np.array_equal(batch[s], alone[s]), s
