"""q8_0 and q4_0 blocks in torch, byte for byte the GGUF layout.

Both types cut a row into groups of 32 values; each group is one block::

    q8_0 (34 B):  | d: f16 scale | qs[32]: int8 codes            |   value = d · q
    q4_0 (18 B):  | d: f16 scale | qs[16]: two 4-bit codes a byte |   value = d · (q − 8)
                  qs[j] low nibble = value j, high nibble = value j + 16

The rounding follows ggml's reference quantizers (``quantize_row_q8_0_ref``,
``quantize_row_q4_0_ref``), so a KV cache written here holds what llama.cpp's
would.  Tensors are uint8 with a trailing ``[n_blocks, block_bytes]`` pair.
"""

from __future__ import annotations

import torch

from gguf_tools.quants import layout, parse_type

from . import ggml_numerics

GROUP = layout(parse_type("q8_0")).block_values
BLOCK_BYTES = {k: layout(parse_type(k)).block_bytes for k in ("q8_0", "q4_0")}


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves go away from zero (torch.round goes to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _pack(d: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    scale_bytes = d.to(torch.float16).unsqueeze(-1).view(torch.uint8)
    return torch.cat([scale_bytes, codes], dim=-1)


def _scale(blocks: torch.Tensor) -> torch.Tensor:
    """The f16 scale of each block as float32 [..., n_blocks, 1]."""
    return blocks[..., :2].view(torch.float16).float()


def quantize(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Blocks of x's last dimension (a multiple of 32): uint8 [..., n/32, block bytes]."""
    if x.shape[-1] % GROUP:
        raise ValueError(f"{kind} needs rows that are a multiple of {GROUP} values, got {x.shape[-1]}")
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    if kind == "q8_0":
        d = g.abs().amax(dim=-1) / 127
        inv = torch.where(d > 0, torch.reciprocal(d), torch.zeros_like(d))
        q = _round_away(g * inv.unsqueeze(-1)).to(torch.int8).view(torch.uint8)
        return _pack(d, q)
    if kind == "q4_0":
        idx = g.abs().argmax(dim=-1, keepdim=True)
        d = torch.gather(g, -1, idx).squeeze(-1) / -8
        inv = torch.where(d != 0, torch.reciprocal(d), torch.zeros_like(d))
        q = (g * inv.unsqueeze(-1) + 8.5).to(torch.int8).clamp(max=15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        return _pack(d, packed)
    raise ValueError(f"no torch block format for {kind!r}")


def dequantize(blocks: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of uint8 blocks [..., n_blocks, block bytes] as [..., n_blocks · 32] in dtype."""
    d = _scale(blocks)
    if kind == "q8_0":
        q = blocks[..., 2:].view(torch.int8).float()
    elif kind == "q4_0":
        qs = blocks[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float() - 8
    else:
        raise ValueError(f"no torch block format for {kind!r}")
    return (q * d).to(dtype).flatten(-2)


def block_bytes(kind: str, n_values: int) -> int:
    """Bytes that n_values (a multiple of 32) take in kind."""
    return n_values // GROUP * BLOCK_BYTES[kind]


# How llama.cpp's CPU matmuls round the activations that meet a weight of each
# GGML type (its "vec_dot_type"): 8-bit blocks of 32 (q8_0/q8_1, same values),
# 8-bit blocks of 256 with a float32 scale (q8_K), or a cast to f16/bf16.
ACTIVATION_ROUNDING = {
    "Q4_0": "q8_0", "Q5_0": "q8_0", "Q8_0": "q8_0", "Q4_1": "q8_1", "Q5_1": "q8_1",
    "Q2_K": "q8_K", "Q3_K": "q8_K", "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K",
    "F16": "f16", "BF16": "bf16",
}


def round_activations(x: torch.Tensor, kind: str | None) -> torch.Tensor:
    """x as llama.cpp's CPU kernels see it before a dot product with a weight whose
    activations are quantized to kind (see ACTIVATION_ROUNDING)."""
    return round_activations_q8_1(x)[0] if kind == "q8_1" else _round(x, kind)


def round_activations_q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q8_1 rounding: the values (as q8_0) and, per block of 32, how far the block's
    stored sum s = f16(d · Σq) is from d16 · Σq.  llama.cpp multiplies s by each
    weight block's min (q4_1/q5_1), so y = x'·Wᵀ + delta·minsᵀ reproduces it."""
    if x.shape[-1] % GROUP:
        return x, x.new_zeros(*x.shape[:-1], 0)
    q, d16, s = ggml_numerics.quantize_q8(x, with_sum=True)
    delta = s - d16 * q.sum(-1)
    return (q * d16.unsqueeze(-1)).reshape(x.shape).to(x.dtype), delta.to(x.dtype)


def _round(x: torch.Tensor, kind: str | None) -> torch.Tensor:
    if kind is None:
        return x
    if kind == "f16":
        return x.to(torch.float16).to(x.dtype)
    if kind == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    n = 256 if kind == "q8_K" else GROUP
    if x.shape[-1] % n:
        return x
    if kind == "q8_K":
        g = x.float().reshape(*x.shape[:-1], x.shape[-1] // n, n)
        idx = g.abs().argmax(dim=-1, keepdim=True)
        top = torch.gather(g, -1, idx)
        iscale = torch.where(top != 0, torch.full_like(top, -127.0) / top, torch.zeros_like(top))
        q = torch.round(g * iscale).clamp(max=127)
        d = torch.where(iscale != 0, torch.reciprocal(iscale), torch.zeros_like(iscale))
    else:
        q, d16, _ = ggml_numerics.quantize_q8(x, with_sum=False)
        d = d16.unsqueeze(-1)
    return (q * d).reshape(x.shape).to(x.dtype)
