"""llama.cpp's quantized matmuls on the CPU, rounding for rounding (x86 AVX2 + FMA builds): q4_0/q4_1/q8_0
weights in their GGUF block layout (:class:`BlockMatrix`), activations quantized to q8_0/q8_1 blocks
(:func:`quantize_q8`), integer lane sums and one FMA per block (:func:`linear`), and Q4_0 matrices as
llama.cpp repacks them.  Part of :mod:`cuda_backend.ggml_numerics`, which re-exports these names and says
what was checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_CHUNK_TERMS = 1 << 23           # partial products held at once (64 MiB in float64)

_BLOCK = 32
# block bytes, offset of the codes, and whether a min follows the scale
_LAYOUT = {"Q8_0": (34, 2), "Q4_0": (18, 2), "Q4_1": (20, 4)}
EMULATED_TYPES = frozenset(_LAYOUT)


def repacked_by_llamacpp(name: str, type_name: str, rows: int) -> bool:
    """Whether llama.cpp's x86 CPU backend multiplies this matrix with its repacked
    gemm/gemv_q4_0_8x8_q8_0 kernels (ggml_repack_get_optimal_repack_type for AVX2: Q4_0
    with rows % 8 == 0; every such matrix a MUL_MAT reads, token_embd as a tied output
    included).  ``name`` is for the record: no emulated type depends on it today."""
    del name
    return type_name == "Q4_0" and rows % 8 == 0


@dataclass(frozen=True)
class BlockMatrix:
    """A GGUF q8_0/q4_0/q4_1 matrix kept as its integer codes (float32; q4_0 already minus 8),
    f16 scales ``d`` and, for q4_1, mins ``m`` [out, nb].  The codes are stored as
    ``lanes`` [nb·8, 4, out] — the 4 values each AVX lane sums — for one batched matmul."""

    lanes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    kind: str
    repacked: bool = False      # multiplied as llama.cpp's repacked q4_0x8 kernels do (see repacked_by_llamacpp)

    @classmethod
    def from_blocks(cls, raw, type_name: str, rows: int, device: torch.device | str = "cpu",
                    repacked: bool = False) -> BlockMatrix:
        """Parse a matrix's GGUF bytes (uint8, rows × row bytes)."""
        size, start = _LAYOUT[type_name]
        blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, size)
        nb = blocks.shape[1]

        def half(lo: int) -> torch.Tensor:
            return torch.from_numpy(blocks[..., lo:lo + 2].copy().view(np.float16)[..., 0].astype(np.float32))

        qs = blocks[..., start:]
        if type_name == "Q8_0":
            codes = qs.view(np.int8).astype(np.float32)
        else:
            codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
            if type_name == "Q4_0":
                codes -= 8
        lanes = torch.from_numpy(codes).reshape(rows, nb * 8, 4).permute(1, 2, 0).contiguous()
        return cls(lanes.to(device), half(0).to(device), half(2).to(device) if type_name == "Q4_1" else None,
                   type_name, repacked and type_name == "Q4_0")

    @property
    def codes(self) -> torch.Tensor:
        """The codes as [out, nb, 32] (a view)."""
        return self.lanes.permute(2, 0, 1).reshape(self.lanes.shape[2], -1, _BLOCK)

    @property
    def shape(self) -> tuple[int, int]:
        return self.lanes.shape[2], self.lanes.shape[0] * 4

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lanes, self.d, self.m) if t is not None)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (ggml's get_rows): d·q (+ m), exact in float32."""
        flat = index.reshape(-1)
        values = self.lanes[:, :, flat].permute(2, 0, 1).reshape(flat.shape[0], -1, _BLOCK) * self.d[flat, :, None]
        if self.m is not None:
            values = values + self.m[flat, :, None]
        return values.reshape(*index.shape, -1)


def quantize_q8(x: torch.Tensor, with_sum: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """quantize_row_q8_0 / q8_1 (AVX2): codes [..., nb, 32], f16 scale d [..., nb] and, for
    q8_1, the f16 s = d·Σq (d before its f16 rounding)."""
    g = x.float().unflatten(-1, (-1, _BLOCK))
    amax = g.abs().amax(-1)
    inv = torch.where(amax != 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(g * inv.unsqueeze(-1))
    d = amax / 127.0
    s = (d * q.sum(-1)).half().float() if with_sum else None
    return q, d.half().float(), s


def _hsum8(acc: torch.Tensor) -> torch.Tensor:
    r = acc[..., 4:] + acc[..., :4]
    return (r[..., 0] + r[..., 2]) + (r[..., 1] + r[..., 3])


def linear(x: torch.Tensor, w: BlockMatrix) -> torch.Tensor:
    """x [..., K] · wᵀ as ggml's CPU vec_dot for w's type computes it: [..., out] float32."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, _CHUNK_TERMS // (w.lanes.shape[0] * w.lanes.shape[2]))
    kernel = _linear_rows_repacked if w.repacked else _linear_rows
    parts = [kernel(rows[i:i + step], w) for i in range(0, rows.shape[0], step)]
    out = torch.cat(parts) if parts else rows.new_zeros(0, w.lanes.shape[2])
    return out.reshape(*lead, w.lanes.shape[2])


def _linear_rows(x: torch.Tensor, w: BlockMatrix) -> torch.Tensor:
    xq, dx, sx = quantize_q8(x, w.kind == "Q4_1")
    t, nb = xq.shape[0], xq.shape[1]
    n_out = w.lanes.shape[2]
    # lanes: exact integer sums of 4 neighbouring products, as [nb, 8, t, out]
    xy = torch.bmm(xq.reshape(t, nb * 8, 4).transpose(0, 1), w.lanes).view(nb, 8, t, n_out)
    scale = (dx.t()[:, None, :, None] * w.d.t()[:, None, None, :]).double()     # exact: f16·f16
    terms = scale * xy.double()                                                  # exact in float64
    acc = terms[0].float()
    for ib in range(1, nb):                      # one FMA per block: a single rounding to float32
        acc = (acc + terms[ib]).float()          # float32 + float64 adds in float64
    out = _hsum8(acc.permute(1, 2, 0))
    if w.m is not None:
        mins_s = (sx.t()[:, :, None] * w.m.t()[:, None, :])                      # exact: f16·f16
        summs = mins_s[0]
        for ib in range(1, nb):
            summs = summs + mins_s[ib]
        out = out + summs
    return out


def _linear_rows_repacked(x: torch.Tensor, w: BlockMatrix) -> torch.Tensor:
    """gemm/gemv_q4_0_8x8_q8_0 (AVX2): per output, acc = fma(Σ_block x_q·w_q, d_w·d_x, acc) over the blocks."""
    xq, dx, _ = quantize_q8(x, False)
    nb = xq.shape[1]
    n_out = w.lanes.shape[2]
    dots = torch.bmm(xq.transpose(0, 1), w.lanes.reshape(nb, _BLOCK, n_out))          # [nb, t, out], exact
    scale = (dx.t()[:, :, None] * w.d.t()[:, None, :]).double()                        # f32 d_w·d_x: exact
    terms = scale * dots.double()                                                       # exact in float64
    acc = terms[0].float()
    for ib in range(1, nb):
        acc = (acc + terms[ib]).float()
    return acc


# ---- SwiGLU --------------------------------------------------------------------------------------
#
# ggml_vec_swiglu_f32 (AVX2 + FMA) computes silu(x)·g as x / (1 + e(−x)) · g with
# e = ggml_v_expf, a vectorised exp (range reduction x = n·ln2 + b with the
# round-to-integer trick, a degree-5 polynomial in b, scaling by 2^n through
# the exponent bits); values not in whole groups of 8 go through libm's expf.
