"""Quantization block layouts: what the `gguf` package lacks.

`gguf.GGML_QUANT_SIZES` gives (values per block, bytes per block) for every
type; this module adds only the split of a block into *value codes* (the bits
that select each value, high bits included) and *metadata* (scales, mins,
super-block scales, sub-block scales).  Float and integer types are all payload.

Example, Q2_K (256 values, 84 bytes)::

    | scales[16]: 4-bit scale | 4-bit min per 16 values |  16 B  metadata
    | qs[64]: 2-bit codes, 4 per byte                   |  64 B  codes
    | d: f16 super-scale | dmin: f16 super-min          |   4 B  metadata
                                                 → 64 codes + 20 metadata
"""

from __future__ import annotations

from dataclasses import dataclass

from ._constants import GGML_QUANT_SIZES
from ._constants import GGMLQuantizationType as T

# Bytes of value codes per block, for each quantized type.  Metadata is the rest.
#   *_0 / *_1 : one f16 scale (and an f16 min for *_1) per 32 values
#   Q8_1      : f32 d and f32 s = d·Σq per 32 values
#   Q5_x      : 4 bytes of high bits count as codes
#   K-quants  : 256-value super-blocks, 6/4-bit sub-block scales + f16 d (and dmin)
#   IQ*       : grid indices, signs and high bits are codes; block/sub-block scales are metadata
#   MXFP4     : one E8M0 exponent per 32 values; NVFP4: four UE4M3 scales per 64 values
_CODE_BYTES: dict[T, int] = {
    T.Q4_0: 16, T.Q4_1: 16, T.Q5_0: 20, T.Q5_1: 20, T.Q8_0: 32, T.Q8_1: 32,
    T.Q2_K: 64,      # qs[64]               | scales[16] + d + dmin
    T.Q3_K: 96,      # hmask[32] + qs[64]   | scales[12] + d
    T.Q4_K: 128,     # qs[128]              | d + dmin + scales[12]
    T.Q5_K: 160,     # qh[32] + qs[128]     | d + dmin + scales[12]
    T.Q6_K: 192,     # ql[128] + qh[64]     | scales[16] (int8) + d
    T.Q8_K: 256,     # qs[256]              | d (f32) + bsums[16] (int16)
    T.IQ2_XXS: 60,   # grid idx + 7-bit sign idx | d + 4-bit scale per 32
    T.IQ2_XS: 64,    # qs[32] u16           | d + scales[8]
    T.IQ2_S: 72,     # qs[64] + qh[8]       | d + scales[8]
    T.IQ3_XXS: 92,   # grid + signs         | d + 4-bit scale per 32
    T.IQ3_S: 104,    # qs[64] + qh[8] + signs[32] | d + scales[4]
    T.IQ1_S: 44,     # qs[32] + 12 of 16 qh bits  | d + 3-bit scale + delta sign per 32
    T.IQ1_M: 48,     # qs[32] + qh[16]      | scales[8] (carry the f16 scale)
    T.IQ4_NL: 16,    # qs[16]               | d
    T.IQ4_XS: 128,   # qs[128]              | d + scales_h + scales_l[4]
    T.TQ1_0: 52,     # qs[48] + qh[4] (base-3 trits) | d
    T.TQ2_0: 64,     # qs[64]               | d
    T.MXFP4: 16,     # qs[16] (E2M1)        | e (E8M0)
    T.NVFP4: 32,     # qs[32] (E2M1)        | 4 × UE4M3 sub-block scales
    T.Q1_0: 16,      # 1-bit signs          | d
}
_PLAIN = {T.F32, T.F16, T.BF16, T.F64, T.I8, T.I16, T.I32, T.I64}


@dataclass(frozen=True)
class QuantLayout:
    type: T
    block_values: int
    block_bytes: int
    code_bytes: int
    meta_bytes: int

    @property
    def quantized(self) -> bool:
        return self.type not in _PLAIN

    @property
    def bits_per_value(self) -> float:
        return self.block_bytes * 8 / self.block_values

    @property
    def meta_fraction(self) -> float:
        return self.meta_bytes / self.block_bytes

    def split(self, n_bytes: int) -> tuple[int, int]:
        """(code bytes, metadata bytes) of a tensor stored in n_bytes of this type."""
        blocks, rest = divmod(n_bytes, self.block_bytes)
        if rest:
            raise ValueError(f"{n_bytes} bytes is not a whole number of {self.type.name} blocks")
        return blocks * self.code_bytes, blocks * self.meta_bytes


def layout(qtype: T | int | str) -> QuantLayout:
    """Layout of one type, by enum, id or name (``"q8_0"``, ``"Q2_K"``)."""
    t = parse_type(qtype)
    values, size = GGML_QUANT_SIZES[t]
    if t in _PLAIN:
        return QuantLayout(t, values, size, size, 0)
    codes = _CODE_BYTES.get(t)
    if codes is None:
        raise KeyError(f"no code/metadata split known for {t.name}")
    return QuantLayout(t, values, size, codes, size - codes)


def parse_type(qtype: T | int | str) -> T:
    if isinstance(qtype, T):
        return qtype
    if isinstance(qtype, int):
        return T(qtype)
    try:
        return T[str(qtype).upper()]
    except KeyError:
        raise ValueError(f"unknown GGML type {qtype!r}") from None


def all_layouts() -> dict[T, QuantLayout]:
    """Every type the installed `gguf` package knows; raises if one is not covered."""
    return {t: layout(t) for t in GGML_QUANT_SIZES}


def tensor_bytes(qtype: T | str, n_elements: int) -> int:
    """Bytes to store n_elements in qtype (n_elements must fill whole blocks)."""
    t = parse_type(qtype)
    values, size = GGML_QUANT_SIZES[t]
    blocks, rest = divmod(n_elements, values)
    if rest:
        raise ValueError(f"{n_elements} values do not fill whole {t.name} blocks of {values}")
    return blocks * size


def row_bytes(qtype: T | str, row_length: int) -> int:
    """ggml_row_size: bytes of one row of row_length values."""
    return tensor_bytes(qtype, row_length)
