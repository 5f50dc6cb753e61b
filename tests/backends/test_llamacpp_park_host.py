"""The llama.cpp executor parking a slot's KV in host memory (``park_host``, the server's): embedded model, 1 thread.

A parked slot holds no cell; ``copy`` from it writes the wanted positions back into fresh cells of another slot
(the blob cut to those positions), appended to what that slot already holds.  Logits after a write-back are
compared bit for bit with a slot that computed the same tokens: the bytes are llama.cpp's own, and every ubatch
stays under 64 rows (ggml's one-row flash-attention kernel, each row over its own cells in position order).
"""

from __future__ import annotations

import numpy as np
import pytest

from localinfer.backends.executor import Chunk

pytest.importorskip("llama_cpp")

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find its friends"


@pytest.fixture(scope="module", params=[True, False], ids=["flash-attn", "no-flash-attn (transposed V)"])
def executor(default_model, request):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=4, n_ctx=256, threads=1, flash_attn=request.param,
                               park_host=True) as ex:
        assert ex.parks_in_host
        yield ex


@pytest.fixture
def ex(executor):
    for s in range(executor.n_slots):
        executor.drop(s)
    assert executor.cells_used() == 0 and executor.host_tokens() == 0
    return executor


def _tokens(ex):
    t = tuple(ex.engine.tokenize(TEXT, add_bos=True))
    assert len(t) >= 20
    return t


def _fill(ex, slot, tokens):
    for i in range(0, len(tokens), 16):       # chunks under 64 rows: the one-row kernel
        ex.step([Chunk(slot, tokens[i:i + 16], i)])


def _next(ex, slot, token, pos):
    return ex.step([Chunk(slot, (token,), pos, True)])[slot]


def test_a_parked_slot_holds_no_cell_and_a_write_back_equals_the_computed_kv(ex):
    t = _tokens(ex)
    n = len(t)
    _fill(ex, 0, t)
    _fill(ex, 1, t[:12])
    want = _next(ex, 1, t[12], 12)           # slot 1 computed 12 tokens itself
    ex.drop(1)
    ex.park(0)
    assert ex.cells_used() == 0 and ex.host_tokens() == n
    assert ex.copy(0, 2, 12) == 12           # positions [0, 12) written back
    assert ex.cells_used() == 12 and ex.slot_len(2) == 12 and ex.host_tokens() == n
    assert np.array_equal(_next(ex, 2, t[12], 12), want)
    assert ex.copy(0, 3, n) == n and ex.cells_used() == 13 + n   # a second write-back, all of it


def test_a_write_back_appends_to_a_prefix_shared_from_a_running_slot(ex):
    t = _tokens(ex)
    _fill(ex, 1, t[:16])                     # running, in cells 0-15 (its first 8 are the same KV as slot 0's)
    _fill(ex, 0, t)                          # then parked: its cells, above slot 1's, become free
    ex.park(0)
    ex.copy(1, 2, 8)                         # slot 2 shares slot 1's cells for [0, 8)
    with pytest.raises(ValueError, match="holds 8 tokens"):
        ex.copy(0, 2, 16)                    # only as an explicit append
    assert ex.copy(0, 2, 16, append=True) == 16   # [8, 16) back from the parked slot, in freed cells above
    assert ex.cells_used() == 24             # 16 of slot 1 + 8 written back: no duplicate of the shared part
    # the same logits as slot 1's own 16 tokens: slot 2's cells are in position order (a freed cell below the
    # shared ones would change the one-row kernel's summation order: ~0.7 on this model)
    assert np.array_equal(_next(ex, 2, t[16], 16), _next(ex, 1, t[16], 16))


def test_a_write_back_without_free_cells_shares_nothing_and_the_slot_stays_usable(ex):
    t = _tokens(ex)
    _fill(ex, 0, t)
    ex.park(0)
    filler = tuple((i % 500) + 10 for i in range(ex.n_cells - 8))
    _fill(ex, 1, filler)                     # 8 cells left, the copy needs 16
    assert ex.copy(0, 2, 16) == 0
    assert ex.cells_used() == len(filler) and ex.slot_len(2) == 0
    ex.drop(1)
    assert ex.copy(0, 2, 16) == 16 and ex.cells_used() == 16   # the blob is intact


def test_drop_shortens_or_forgets_a_parked_slot_and_misuse_is_refused(ex):
    t = _tokens(ex)
    _fill(ex, 3, t[:10])
    want = _next(ex, 3, t[10], 10)           # slot 3 computed 10 tokens itself
    ex.drop(3)
    _fill(ex, 0, t)
    ex.park(0)
    size = ex._host[0].size
    ex.drop(0, 10)        # evicted from position 10 on: positions < 10 stay; the blob is cut only when written back
    assert ex.host_tokens() == 10 and ex._host[0].size == size
    with pytest.raises(ValueError, match="holds 10 tokens"):
        ex.copy(0, 1, 12)
    with pytest.raises(ValueError, match="parked in host memory"):
        ex.step([Chunk(0, (5,), 10)])
    _fill(ex, 2, t[:4])
    with pytest.raises(ValueError, match="parked in host memory"):
        ex.copy(2, 0, 4)
    assert ex.copy(0, 1, 10) == 10 and ex.cells_used() == 14
    assert np.array_equal(_next(ex, 1, t[10], 10), want)
    ex.drop(1, 10)
    ex.drop(0)
    assert ex.host_tokens() == 0 and ex.cells_used() == 14
    _fill(ex, 0, t[:4])                      # the slot is an ordinary one again
    assert ex.cells_used() == 18


def test_without_park_host_park_keeps_the_cells(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=2, n_ctx=128, threads=1) as ex:
        _fill(ex, 0, tuple(range(10, 30)))
        ex.park(0)
        assert not ex.parks_in_host and ex.cells_used() == 20 and ex.host_tokens() == 0


def _blob(streams, v_trans=0, n_layer=2, row=4, seq=3):
    """A one-sequence state as llama.cpp writes it: per stream the cells' (pos, 1, seq) and K/V rows whose bytes
    are the cell's position (so a cut shows which rows it kept)."""
    import struct

    from localinfer.backends.llamacpp.kv_state import IO_MAGIC

    out = struct.pack("<IiI", IO_MAGIC, seq, len(streams))
    for positions in streams:
        out += struct.pack("<I", len(positions))
        if not positions:
            continue
        out += b"".join(struct.pack("<iIi", p, 1, seq) for p in positions)
        out += struct.pack("<II", v_trans, n_layer)
        for _ in range(n_layer):                     # K: type, row bytes, one row per cell
            out += struct.pack("<iQ", 1, row) + b"".join(bytes([p]) * row for p in positions)
        for _ in range(n_layer):                     # V: the same, or transposed (element-major)
            if v_trans:
                out += struct.pack("<iII", 1, 1, row) + b"".join(bytes(positions) for _ in range(row))
            else:
                out += struct.pack("<iQ", 1, row) + b"".join(bytes([p]) * row for p in positions)
    return np.frombuffer(out, np.uint8).copy()


@pytest.mark.parametrize("v_trans", [0, 1])
def test_cut_seq_state_keeps_the_cells_of_the_positions_asked_for(v_trans):
    from localinfer.backends.llamacpp.kv_state import cut_seq_state

    positions = [5, 0, 1, 7, 2, 6]                   # cache order need not be position order
    whole = _blob([positions, [], [9, 8]], v_trans)
    same, n = cut_seq_state(whole, 0, 100)
    assert np.array_equal(same, whole) and n == 8
    cut, n = cut_seq_state(whole, 1, 6)
    assert n == 3 and np.array_equal(cut, _blob([[5, 1, 2], [], []], v_trans))   # the last stream: its count only
    assert cut_seq_state(whole, 20, 30)[1] == 0


def test_cut_seq_state_refuses_a_layout_it_does_not_know():
    from localinfer.backends.llamacpp.kv_state import cut_seq_state
    from localinfer.errors import UnsupportedModelError

    whole = _blob([[0, 1, 2]])
    with pytest.raises(UnsupportedModelError, match="unread bytes"):
        cut_seq_state(np.concatenate([whole, np.zeros(4, np.uint8)]), 0, 2)    # e.g. a second cache after it
    with pytest.raises(UnsupportedModelError, match="magic"):
        cut_seq_state(np.zeros(64, np.uint8), 0, 2)


def test_a_full_budget_first_cuts_the_tails_drop_gave_up(ex):
    t = _tokens(ex)
    _fill(ex, 0, t)
    assert ex.park(0) is True
    whole = ex._host[0].size
    ex.drop(0, 8)                            # the saved state still holds all of t
    _fill(ex, 1, t)
    ex.host_budget = 2 * whole - 1           # both whole states do not fit; 8 positions and one whole do
    try:
        assert ex.park(1) is True and ex._host[0].size < whole / 2 and ex.host_tokens() == 8 + len(t)
        assert ex.copy(0, 2, 8) == 8 and ex.copy(1, 3, len(t)) == len(t)
        ex.host_budget = whole // 2          # under one state: it never fits, said apart from "no room yet"
        ex.step([Chunk(2, t[8:16], 8)])
        assert ex.park(2) is None and ex.cells_used() == 16 + len(t)
    finally:
        ex.host_budget = None


def test_past_the_host_budget_a_parked_slot_keeps_its_cells(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=3, n_ctx=128, threads=1, park_host=True) as ex:
        t = _tokens(ex)
        _fill(ex, 0, t)
        ex.host_budget = 1024                    # under one parked request's state
        assert ex.park(0) is None
        assert ex.cells_used() == len(t) and ex.host_tokens() == 0
        assert ex.copy(0, 1, 16) == 16 and ex.cells_used() == len(t)   # a plain seq_cp: shared cells
        ex.host_budget = None                    # the default: HOST_CACHE_MAX or half the free RAM
        ex.drop(1)
        assert ex.park(0) is True and ex.park(0) is True     # parked, and already parked
        assert ex.cells_used() == 0 and ex.host_tokens() == len(t)


def test_the_probe_measures_a_positions_bytes_and_the_servers_cache_reaches_as_far_as_the_host_budget(ex):
    from localinfer.serve.http.config import ServeConfig, build_engine

    t = _tokens(ex)
    _fill(ex, 0, t)
    _fill(ex, 1, t[:8])
    assert ex.park(0) is True and ex.park(1) is True
    assert ex._host[0].size - ex._host[1].size == (len(t) - 8) * ex.position_bytes > 0    # a state grows by it
    ex.drop(0)
    ex.drop(1)
    p = 16
    cells = ex.n_cells // p
    try:
        ex.host_budget = 5 * p * ex.position_bytes + p // 2        # five blocks of positions, and a part
        assert ex.host_cells() == 5 * p
        _, engine, _ = build_engine(ex, ServeConfig.build(parallel=2, park=2, block_tokens=p))
        assert engine.blocks.num_blocks == cells + 5 and engine.blocks.capacity == cells
        ex.host_budget = 1 << 40                                   # then the parked ids' slots bound it
        _, engine, _ = build_engine(ex, ServeConfig.build(parallel=2, park=2, block_tokens=p))
        assert engine.blocks.num_blocks == cells + 2 * ex.slot_cells // p
    finally:
        ex.host_budget = None
