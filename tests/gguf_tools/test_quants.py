"""Quant layouts: every gguf type covered; the code/metadata split checked against gguf.quants."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from gguf import GGMLQuantizationType as T

from gguf_tools.quants import all_layouts, layout, parse_type, row_bytes, tensor_bytes

FLOATS_AND_INTS = (T.F32, T.F16, T.BF16, T.F64, T.I8, T.I16, T.I32, T.I64)
# Types that pack a 4-bit group scale into bytes shared with sign/grid bits:
# the table counts the scale bits as metadata, so byte probing sees those bytes as "mixed".
MIXED_BYTES = {T.IQ2_XXS: 8, T.IQ3_XXS: 8, T.IQ1_S: 8}


def test_every_gguf_type_is_covered():
    layouts = all_layouts()
    assert set(layouts) == set(GGML_QUANT_SIZES) == set(GGMLQuantizationType)
    for t, lay in layouts.items():
        values, size = GGML_QUANT_SIZES[t]
        assert (lay.block_values, lay.block_bytes) == (values, size)
        assert lay.code_bytes + lay.meta_bytes == lay.block_bytes
        assert 0 < lay.code_bytes <= lay.block_bytes and lay.meta_bytes >= 0


@pytest.mark.parametrize("t, codes, meta, bits", [
    (T.Q2_K, 64, 20, 2.625),
    (T.Q8_0, 32, 2, 8.5),
    (T.Q4_0, 16, 2, 4.5),
    (T.Q4_1, 16, 4, 5.0),
    (T.Q5_0, 20, 2, 5.5),
    (T.Q5_1, 20, 4, 6.0),
    (T.Q3_K, 96, 14, 3.4375),
    (T.Q4_K, 128, 16, 4.5),
    (T.Q5_K, 160, 16, 5.5),
    (T.Q6_K, 192, 18, 6.5625),
    (T.Q8_K, 256, 36, 9.125),
])
def test_named_layouts(t, codes, meta, bits):
    lay = layout(t)
    assert (lay.code_bytes, lay.meta_bytes, lay.bits_per_value) == (codes, meta, bits)
    assert lay.quantized


def test_q2_k_metadata_is_about_a_quarter():
    assert round(layout("q2_k").meta_fraction, 3) == round(20 / 84, 3)
    assert round(layout("Q2_K").meta_fraction * 100) == 24


@pytest.mark.parametrize("t", FLOATS_AND_INTS)
def test_floats_and_ints_are_all_payload(t):
    lay = layout(t)
    assert lay.meta_bytes == 0 and lay.code_bytes == lay.block_bytes and not lay.quantized


def test_parse_and_sizes():
    assert parse_type("q8_0") is parse_type("Q8_0") is parse_type(int(T.Q8_0)) is T.Q8_0
    with pytest.raises(ValueError):
        parse_type("q9_9")
    assert tensor_bytes("q8_0", 4096 * 4096) == 4096 * 4096 // 32 * 34
    assert row_bytes(T.Q2_K, 4096) == 16 * 84
    with pytest.raises(ValueError):
        tensor_bytes("q2_k", 100)
    assert layout("q4_0").split(18 * 10) == (160, 20)
    with pytest.raises(ValueError):
        layout("q4_0").split(19)


def _values_touched(t: T, seeds: int = 2) -> np.ndarray:
    """For each byte of a block: how many dequantized values change when one of its bits flips."""
    values, size = GGML_QUANT_SIZES[t]
    touched = np.zeros(size, dtype=int)
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        for _ in range(100):
            block = rng.integers(0, 256, size, dtype=np.uint8)
            with np.errstate(all="ignore"):
                base = quants.dequantize(block[None, :], t).reshape(-1)
            if np.all(np.isfinite(base)):
                break
        flips = np.repeat(block[None, :], size * 8, axis=0)
        rows = np.arange(size * 8)
        flips[rows, rows // 8] ^= (1 << (rows % 8)).astype(np.uint8)
        with np.errstate(all="ignore"):
            out = quants.dequantize(flips, t).reshape(size * 8, values)
        changed = (out != base[None, :]).sum(axis=1).reshape(size, 8).max(axis=1)
        touched = np.maximum(touched, changed)
    return touched


def _dequantizable():
    for t in GGML_QUANT_SIZES:
        if t in FLOATS_AND_INTS:
            continue
        try:
            quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[t][1]), dtype=np.uint8), t)
        except NotImplementedError:
            continue
        yield t


@pytest.mark.parametrize("t", list(_dequantizable()), ids=lambda t: t.name)
def test_code_bytes_touch_few_values_and_metadata_bytes_many(t):
    """A code byte selects at most 8 values; a scale/min byte moves a whole group (16 or more)."""
    touched = _values_touched(t)
    code_like = int((touched <= 8).sum())
    assert touched.max() > 8                                        # some byte is a scale
    mixed = MIXED_BYTES.get(t, 0)
    assert layout(t).code_bytes == code_like + mixed // 2          # mixed bytes: 4 code bits + 4 scale bits
