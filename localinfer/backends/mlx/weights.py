"""GGUF tensors as MLX arrays, named for mlx-lm's llama / qwen2 / qwen3 modules.

Q4_0, Q4_1 and Q8_0 keep their bits: each 32-value block is one MLX affine
group (``value = scale · q + bias``), so the weights stay quantized::

    Q4_0  | d f16 | 16 B nibbles: low = values 0-15, high = 16-31 |  v = d·(q - 8)  → scale d, bias -8d
    Q4_1  | d f16 | m f16 | 16 B nibbles (same order)            |  v = d·q + m    → scale d, bias m
    Q8_0  | d f16 | 32 × int8                                    |  v = d·q        → scale d, bias -128d (q + 128 as uint8)

MLX packs codes little-endian into uint32 words (value j of a word in bits
``bits·j``).  When every tensor has a type ``mx.load`` converts itself (F32,
F16, Q4_0, Q4_1, Q8_0) the whole file goes through ``mx.load``; otherwise each
tensor is read from a memory map: the three types above are repacked as above
(bit-identical to ``mx.load``), BF16 is read as bfloat16 (``mx.load`` would
narrow it to float16), and every other type is dequantized with the ``gguf``
package.  Float tensors end up in the compute dtype; what dequantizing costs
in memory is stated in ``LoadedWeights.notes``.

llama-architecture GGUFs store the rows of Q and K permuted for llama.cpp's
adjacent-pair RoPE (convert_hf_to_gguf's ``permute``: within each head, row
``2i + h`` holds Hugging Face row ``h·d/2 + i``).  mlx-lm's llama applies the
half-split RoPE to the Hugging Face layout, so those rows are put back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from gguf_tools import TensorInfo
from localinfer.errors import UnsupportedModelError
from localinfer.model.spec import ModelSpec
from localinfer.units import fmt_bytes

DTYPE_NAMES = {mx.float16: "f16", mx.bfloat16: "bf16", mx.float32: "f32"}   # as budget and the CLI name them

GROUP = 32  # values per GGUF block = values per MLX group
AFFINE_BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q8_0: 8}
MX_LOAD_TYPES = frozenset({T.F32, T.F16, *AFFINE_BITS})

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SKIPPED = frozenset({"rope_freqs.weight"})  # used by the RoPE, not a module parameter


@dataclass
class LoadedWeights:
    """mlx-lm parameter name -> array, plus the quantization of each quantized module."""

    arrays: dict[str, mx.array]
    quantized: dict[str, dict[str, int]]           # module path -> {"group_size", "bits"}
    extra: dict[str, mx.array] = field(default_factory=dict)  # e.g. rope_freqs.weight
    notes: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def mlx_name(gguf_name: str) -> tuple[str, str]:
    """(module path, parameter) in mlx-lm for a GGUF tensor name; raises KeyError if unknown."""
    stem, _, param = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, il, kind = stem.split(".", 2)
        return f"model.layers.{il}.{_LAYER_NAMES[kind]}", param
    return _TOP_NAMES[stem], param


def load_weights(spec: ModelSpec, dtype: mx.Dtype) -> LoadedWeights:
    """Read every tensor of spec's file; float data ends up in dtype."""
    names = [t.name for t in spec.tensors]
    unknown = [n for n in names if n not in SKIPPED and not _known(n)]
    if unknown:
        raise UnsupportedModelError(
            f"the mlx backend does not know tensor {unknown[0]!r} ({len(unknown)} unknown tensors)",
            hint="run this model with --backend llama.cpp", tensor=unknown[0])
    if all(t.type in MX_LOAD_TYPES for t in spec.tensors):
        raw = mx.load(spec.path)
    else:
        raw = _load_mapped(spec)
    out = LoadedWeights({}, {})
    dense_from = [t for t in spec.tensors if t.type not in MX_LOAD_TYPES | {T.BF16}]
    for t in spec.tensors:
        if t.name in SKIPPED:
            out.extra[t.name] = raw[t.name].astype(mx.float32)
            continue
        module, param = mlx_name(t.name)
        stem = t.name.rpartition(".")[0]
        arrays = {param: raw[t.name]}
        if t.type in AFFINE_BITS and len(t.shape) > 1:
            arrays["scales"] = raw[stem + ".scales"].astype(dtype)
            arrays["biases"] = raw[stem + ".biases"].astype(dtype)
            out.quantized[module] = {"group_size": GROUP, "bits": AFFINE_BITS[t.type]}
        else:
            arrays[param] = arrays[param].astype(dtype)
        if spec.arch == "llama" and stem.endswith((".attn_q", ".attn_k")):
            heads = spec.n_head[0] if stem.endswith("q") else spec.n_head_kv[0]
            arrays = {k: unpermute_rows(a, heads) for k, a in arrays.items()}
        for k, a in arrays.items():
            out.arrays[f"{module}.{k}"] = a
    if dense_from:
        out.notes.append(dequant_note(dense_from, dtype))
    return out


def _known(name: str) -> bool:
    try:
        mlx_name(name)
    except (KeyError, ValueError):
        return False
    return True


def dequant_note(tensors: list[TensorInfo], dtype: mx.Dtype) -> str:
    """One line stating what dequantizing costs."""
    types = sorted({t.type.name for t in tensors})
    file_bytes = sum(t.n_bytes for t in tensors)
    mem = sum(t.n_elements for t in tensors) * dtype.size
    dt = DTYPE_NAMES.get(dtype, str(dtype))
    return (f"{len(tensors)} tensors of type {', '.join(types)} dequantized to {dt}: "
            f"{fmt_bytes(mem)} in memory for {fmt_bytes(file_bytes)} in the file "
            f"(MLX keeps only Q4_0, Q4_1 and Q8_0 quantized)")


def unpermute_rows(a: mx.array, n_heads: int) -> mx.array:
    """Undo convert_hf_to_gguf's per-head Q/K row interleave (rows are axis 0)."""
    rows = a.shape[0]
    hd = rows // n_heads
    within = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    order = (np.arange(n_heads)[:, None] * hd + within[None, :]).reshape(-1)
    return a[mx.array(order.astype(np.int32))]


# ---- per-tensor path (files mx.load cannot read whole) -------------------------

def _load_mapped(spec: ModelSpec) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    mm = np.memmap(spec.path, dtype=np.uint8, mode="r")
    try:
        for t in spec.tensors:
            blob = mm[t.file_offset: t.file_offset + t.n_bytes]
            rows = t.n_elements // t.shape[0]
            stem = t.name.rpartition(".")[0]
            if t.type in AFFINE_BITS and len(t.shape) > 1:
                w, s, b = affine_from_blocks(blob.reshape(rows, -1), t.type)
                out[t.name], out[stem + ".scales"], out[stem + ".biases"] = w, s, b
            else:
                out[t.name] = _dense(blob, t)
    finally:
        del mm
    return out


def _dense(blob: np.ndarray, t: TensorInfo) -> mx.array:
    shape = tuple(reversed(t.shape))
    if t.type == T.F32:
        return mx.array(blob.view(np.float32).reshape(shape))
    if t.type == T.F16:
        return mx.array(blob.view(np.float16).reshape(shape))
    if t.type == T.BF16:
        return mx.array(blob.view(np.uint16).reshape(shape)).view(mx.bfloat16)
    try:
        values = dequantize(blob.reshape(-1, blob.size // (t.n_elements // t.shape[0])), t.type)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"tensor {t.name} has type {t.type.name}, which the mlx backend cannot read",
            hint="run this model with --backend llama.cpp", tensor=t.name, type=t.type.name) from None
    return mx.array(values.reshape(shape))


def affine_from_blocks(blocks: np.ndarray, qtype: T) -> tuple[mx.array, mx.array, mx.array]:
    """GGUF blocks [rows, bytes] of Q4_0 / Q4_1 / Q8_0 -> MLX (packed uint32, scales, biases) in f16."""
    rows = blocks.shape[0]
    bpb = {T.Q4_0: 18, T.Q4_1: 20, T.Q8_0: 34}[qtype]
    b = blocks.reshape(rows, -1, bpb)
    d = b[..., :2].copy().view(np.float16)[..., 0]
    if qtype == T.Q8_0:
        codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias = d * np.float16(-128)
    else:
        qs = b[..., 4:] if qtype == T.Q4_1 else b[..., 2:]
        nib = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)     # values 0..31 of each block
        codes = nib[..., 0::2] | (nib[..., 1::2] << 4)         # two values per byte, low first
        bias = b[..., 2:4].copy().view(np.float16)[..., 0] if qtype == T.Q4_1 else d * np.float16(-8)
    packed = np.ascontiguousarray(codes.reshape(rows, -1)).view("<u4")
    return mx.array(packed), mx.array(d), mx.array(bias)
