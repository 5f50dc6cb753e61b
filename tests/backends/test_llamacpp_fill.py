"""Placeholder positions (``LlamaCppExecutor.fill``: a slot's K and V repeated, nothing computed) and the load-time
calibration that times a decode row over them, on the embedded model."""

from __future__ import annotations

import numpy as np
import pytest

from localinfer.backends.executor import Chunk

pytest.importorskip("llama_cpp")

PROMPT = tuple(range(1, 41))


@pytest.fixture(scope="module")
def parking(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=4, n_ctx=1024, threads=1, park_host=True) as ex:
        yield ex


@pytest.fixture
def ex(parking):
    for s in range(parking.n_slots):
        parking.drop(s)
    parking.step([Chunk(0, PROMPT, 0)])
    return parking


def test_a_tiled_state_repeats_the_cells_and_cuts_back_to_the_original(ex):
    from localinfer.backends.llamacpp import seq_state
    from localinfer.backends.llamacpp.kv_state import cut_seq_state, tile_seq_state

    blob = seq_state.read_cells(ex.engine.context, 0, buffer=seq_state.scratch)
    tiled = tile_seq_state(blob, 100)
    assert np.array_equal(cut_seq_state(tiled, 0, 40)[0], blob)
    again, kept = cut_seq_state(tiled, 40, 80)         # cells 40-79 repeat cells 0-39's K and V
    assert kept == 40 and again.size == blob.size
    assert np.array_equal(again[-1000:], blob[-1000:])
    assert cut_seq_state(tiled, 0, 101)[1] == 100


def test_fill_holds_placeholder_positions_a_step_can_decode_after(ex):
    assert ex.fill(0, 1, 300) == 300
    assert ex.cells_used() == 340 and ex.slot_len(1) == 300
    rows = ex.step([Chunk(1, (7,), 300, True), Chunk(0, (7,), 40, True)])
    assert all(np.isfinite(rows[s]).all() for s in (0, 1))
    assert ex.fill(0, 1, 50) == 0              # a slot that holds positions is not filled
    assert ex.fill(2, 3, 50) == 0              # nor from an empty one
    assert ex.fill(0, 2, 30) == 0              # nor with no more positions than the source holds
    for src, dst in ((0, ex.n_slots), (-1, 2)):
        with pytest.raises(ValueError, match="outside"):
            ex.fill(src, dst, 300)
    ex.drop(1)
    assert ex.cells_used() == 41


def test_fill_needs_host_parking(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=2, n_ctx=512, threads=1) as plain:
        plain.step([Chunk(0, PROMPT, 0)])
        assert plain.fill(0, 1, 200) == 0 and plain.cells_used() == 40


def test_calibration_times_a_wide_row_and_leaves_no_cells(ex):
    """calibrate on llama.cpp: a decode row's pairs and a prompt's priced from a row and a prompt over placeholder
    positions, which it filled once and dropped with everything else."""
    from localinfer.serve.http.step_timing import calibrate

    ex.drop(0)
    fills = []

    class Recording:
        def __getattr__(self, name):
            return getattr(ex, name)

        def fill(self, src, dst, n):
            fills.append(ex.fill(src, dst, n))
            return fills[-1]

    model = calibrate(Recording())
    assert len(fills) == 1 and fills[0] > 600          # as wide as the 1,024 cells allow beside slot 0
    assert model.per_pair_s >= 0 and model.per_row_pair_s is not None and model.per_row_pair_s >= 0
    assert ex.cells_used() == 0 and all(ex.slot_len(s) == 0 for s in range(ex.n_slots))
