"""Which GGML type each tensor gets in a file of a given llama.cpp "ftype".

A file called "Q2_K" or "Q4_K_M" is a *mix*: llama-quantize picks a type per
tensor from the tensor's role (attention V, FFN down, output...), its layer,
the model's GQA ratio and expert count, and falls back to a 32-value block type
when a row length is not a multiple of 256.  This module states those rules
(as of llama.cpp's ``src/llama-quant.cpp``, 2025-2026) for the non-imatrix
ftypes, so that a skeleton's tensor table matches what llama-quantize writes.
MLA's ``attn_q_a``/``attn_q_b``/``attn_kv_a_mqa``/``attn_k_b``/``attn_v_b`` and NextN's ``nextn.*`` fall in
no category (the default type); ``attn_kv_b`` counts as attention V; shared experts (``ffn_*_shexp``) follow
the FFN rules of their role; ``mxfp4_moe`` puts every 3-D tensor in MXFP4 and the rest in Q8_0.

Source types (before quantizing) follow llama.cpp's converter: 1-D tensors,
norms and the MoE router (``ffn_gate_inp``) stay F32, and llama-quantize never
quantizes those.  Not modelled: importance-matrix-dependent choices, the IQ
ftypes, Falcon's special cases and the attn_v bump llama.cpp gives 70B Llamas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._constants import GGML_QUANT_SIZES, LlamaFileType
from ._constants import GGMLQuantizationType as T

# ftype name -> (general.file_type, the default tensor type)
FTYPES: dict[str, tuple[LlamaFileType, T]] = {
    "f32": (LlamaFileType.ALL_F32, T.F32),
    "f16": (LlamaFileType.MOSTLY_F16, T.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, T.BF16),
    "q4_0": (LlamaFileType.MOSTLY_Q4_0, T.Q4_0),
    "q4_1": (LlamaFileType.MOSTLY_Q4_1, T.Q4_1),
    "q5_0": (LlamaFileType.MOSTLY_Q5_0, T.Q5_0),
    "q5_1": (LlamaFileType.MOSTLY_Q5_1, T.Q5_1),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, T.Q8_0),
    "q2_k": (LlamaFileType.MOSTLY_Q2_K, T.Q2_K),
    "q3_k_s": (LlamaFileType.MOSTLY_Q3_K_S, T.Q3_K),
    "q3_k_m": (LlamaFileType.MOSTLY_Q3_K_M, T.Q3_K),
    "q3_k_l": (LlamaFileType.MOSTLY_Q3_K_L, T.Q3_K),
    "q4_k_s": (LlamaFileType.MOSTLY_Q4_K_S, T.Q4_K),
    "q4_k_m": (LlamaFileType.MOSTLY_Q4_K_M, T.Q4_K),
    "q5_k_s": (LlamaFileType.MOSTLY_Q5_K_S, T.Q5_K),
    "q5_k_m": (LlamaFileType.MOSTLY_Q5_K_M, T.Q5_K),
    "q6_k": (LlamaFileType.MOSTLY_Q6_K, T.Q6_K),
    "mxfp4_moe": (LlamaFileType.MOSTLY_MXFP4_MOE, T.MXFP4),
}
_FLOAT_FTYPES = {"f32", "f16", "bf16"}

# When a row length is not a multiple of the target's block size.
_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}

_ATTN_V = ("attn_v", "attn_qkv", "attn_kv_b")   # llama-quant.cpp category_is_attn_v
# llama-quant.cpp tensor_allows_quantization: besides these, only 2-D+ tensors whose name ends in "weight" are
# quantized, so ssm_a, ssm_d and ssm_dt.bias (no .weight suffix) stay F32 as well
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "pos_embd", "token_types", "ssm_conv1d", "rope_freqs",
                  "shortconv.conv.weight")
_F32_ALWAYS = ("rope_freqs.weight", "attn_sinks.weight")
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelShape:
    """The hyper-parameters the rules look at."""

    n_layers: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0


def parse_ftype(name: str) -> str:
    """Normalise an ftype name (``"Q4_K_M"`` -> ``"q4_k_m"``); ValueError naming the choices."""
    key = str(name).strip().lower().replace("-", "_")
    if key not in FTYPES:
        raise ValueError(f"unknown type {name!r}; choose one of: {', '.join(FTYPES)}")
    return key


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for cat in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight", "attn_q.weight",
                "attn_output.weight", "ffn_up", "ffn_gate", "ffn_down"):
        if cat in name:
            return cat.removesuffix(".weight")
    return "other"


def _always_f32(name: str) -> bool:
    """F32 in every file: rope_freqs, attention sinks (ggml_soft_max_ext asserts it) and biases, which the
    converter never stores in another type (conversion/base.py: names not ending in .weight -> F32)."""
    return name.endswith(_F32_ALWAYS) or not name.endswith(".weight")


def _quantizable(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2 and name.endswith("weight") and not any(s in name for s in _NOT_QUANTIZED)


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _block(t: T) -> int:
    return GGML_QUANT_SIZES[t][0]


def _layer(name: str) -> int:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else -1


def _positions(tensors: list[tuple[str, tuple[int, ...]]], m: ModelShape) -> dict[str, tuple[int, int]]:
    """(i, n) that llama-quantize's counters give the attn_v-like tensors and, without experts, ffn_down.

    llama-quant.cpp counts attn_v/attn_qkv/attn_kv_b tensors (i_attention_wv of n_attention_wv) and, unless
    the model has experts, ffn_down tensors (i_ffn_down of n_layer) in the loader's order, sorted by layer
    then name (llama-model-loader.h weight_name_comparer).  In a hybrid only some layers hold them, and NextN
    blocks add some, so the counter is not the layer index.
    """
    ordered = sorted((n for n, _ in tensors), key=lambda n: (_layer(n), n))
    attn_v = [n for n in ordered if _category(n) in _ATTN_V]
    out = {n: (i, len(attn_v)) for i, n in enumerate(attn_v)}
    if m.n_expert <= 1:
        down = [n for n in ordered if _category(n) == "ffn_down"]
        out.update({n: (i, m.n_layers) for i, n in enumerate(down)})
    return out


def _rule(name: str, shape: tuple[int, ...], ft: str, default: T, m: ModelShape, tied: bool,
          at: tuple[int, int] | None = None) -> T:
    """The type llama-quantize's standard mixture picks before shape fallbacks (``at``: see _positions)."""
    cat = _category(name)
    il, n = at or (max(_layer(name), 0), m.n_layers)
    if cat == "output" or (tied and cat == "token_embd"):
        if ft == "mxfp4_moe" or shape[0] % _block(default):
            return T.Q8_0
        return default if default == T.Q8_0 else T.Q6_K
    if ft == "mxfp4_moe":                               # MoE tensors (3-D) -> MXFP4, the rest -> Q8_0
        return T.MXFP4 if len(shape) > 2 and shape[2] > 1 else T.Q8_0
    if cat == "token_embd":
        return default
    if cat in _ATTN_V:
        i_wv, n_wv = il, n
        t = default
        if ft == "q2_k":
            t = T.Q4_K if m.n_gqa >= 4 else T.Q3_K
        elif ft == "q3_k_m":
            t = T.Q5_K if i_wv < 2 else T.Q4_K
        elif ft == "q3_k_l":
            t = T.Q5_K
        elif ft in ("q4_k_m", "q5_k_m") and _more_bits(i_wv, n_wv):
            t = T.Q6_K
        elif ft == "q4_k_s" and i_wv < 4:
            t = T.Q5_K
        return T.Q8_0 if m.n_expert == 8 else t
    if cat == "attn_k":
        return T.Q8_0 if m.n_expert == 8 else default
    if cat == "ffn_down":
        if ft == "q2_k":
            return T.Q3_K
        if ft == "q3_k_m":
            return T.Q5_K if il < n // 16 else T.Q4_K
        if ft == "q3_k_l":
            return T.Q5_K
        if ft in ("q4_k_m", "q5_k_m") and _more_bits(il, n):
            return T.Q6_K
        if ft == "q4_k_s" and il < n // 8:
            return T.Q5_K
        return default
    if cat == "attn_output":
        if m.n_expert == 8:
            return T.Q5_K if ft in ("q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m") else default
        return {"q2_k": T.Q3_K, "q3_k_m": T.Q4_K, "q3_k_l": T.Q5_K}.get(ft, default)
    return default


def _fallback(name: str, row: int, t: T) -> T:
    if row % _block(t) == 0:
        return t
    if t not in _FALLBACK:
        raise ValueError(f"{name}: row length {row} is not a multiple of {t.name}'s block size {_block(t)}")
    t = _FALLBACK[t]
    return t if row % _block(t) == 0 else T.F16


def choose_types(
    tensors: list[tuple[str, tuple[int, ...]]],
    ftype: str,
    model: ModelShape,
    *,
    overrides: list[tuple[str, str]] | tuple = (),
) -> list[T]:
    """The GGML type of each (name, shape) tensor (shape in GGUF order, row length first).

    ``overrides`` are (regex, type) pairs applied like llama-quantize's
    ``--tensor-type``: the first pattern found in a quantizable tensor's name
    replaces the standard rule; shape fallbacks still apply.  In a float ftype
    they say which tensors the checkpoint ships quantized (gpt-oss's MXFP4 experts,
    which the converter copies as they are).
    """
    ft = parse_ftype(ftype)
    default = FTYPES[ft][1]
    tied = not any(name == "output.weight" for name, _ in tensors)
    compiled = [(re.compile(p), _override_type(p, t)) for p, t in overrides]
    at = _positions(tensors, model)
    out = []
    for name, shape in tensors:
        if _always_f32(name):
            out.append(T.F32)
            continue
        forced = next((t for rx, t in compiled if rx.search(name)), None) if _quantizable(name, shape) else None
        if ft in _FLOAT_FTYPES:
            # the checkpoint as published: every tensor in one float type, but what it ships quantized
            out.append(default if forced is None else _fallback(name, shape[0], forced))
            continue
        if not _quantizable(name, shape):
            out.append(T.F32)
            continue
        t = forced if forced is not None else _rule(name, shape, ft, default, model, tied, at.get(name))
        out.append(_fallback(name, shape[0], t))
    return out


def _override_type(pattern: str, tname: str) -> T:
    try:
        return T[str(tname).upper()]
    except KeyError:
        raise ValueError(f"override {pattern!r}: unknown tensor type {tname!r}") from None
