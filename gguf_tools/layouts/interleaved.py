"""Attention with local layers interleaved: sliding-window or chunked attention, and MoE every few blocks.

* ``llama4`` (``src/models/llama4.cpp``; ``conversion/llama.py`` Llama4Model): chunked attention (8192 tokens,
  3 chunked : 1 full, built into the loader), no RoPE on every 4th block (``n_no_rope_layer_step``, not a key),
  MoE every ``moe_every`` blocks (``interleave_moe_layer_step``) with one shared expert of ``expert_ff``, dense
  ``n_ff`` blocks between; Llama-3 RoPE scaling as the ``rope_freqs`` tensor.
* ``gpt-oss`` (``src/models/openai-moe.cpp``; ``conversion/gpt_oss.py``): sliding window on every other block
  (``attention.sliding_window``, pattern 2), per-head attention sinks, biases on Q/K/V/output, the router and
  every expert stack; ``post_attention_norm`` before the FFN.  OpenAI ships the experts in MXFP4, which the
  converter copies as they are (the presets say so with an override).
* ``gemma3`` (``src/models/gemma3.cpp``; ``conversion/gemma.py`` Gemma3Model): sliding window on 5 of every
  6 blocks (pattern 6 in the loader), per-head Q/K norms, post-attention and post-FFN norms, tied embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gguf import GGUFValueType as V

from . import Fields, Layout, Metadata, Tensors, moe, register
from .attention import FIELDS as ATTENTION_FIELDS
from .attention import attention_tensors, base_metadata, check_rope, embeddings, output

U32, F32 = V.UINT32, V.FLOAT32

FIELDS: Fields = {
    "sliding_window": (int, 0, "local attention window in tokens (attention.sliding_window)"),
    "rope_freq_base_swa": ((int, float), 0.0, "RoPE base of the sliding-window blocks (rope.freq_base_swa)"),
    "moe_every": (int, 0, "llama4: MoE every this many blocks (interleave_moe_layer_step; default 1)"),
    **ATTENTION_FIELDS,
}


@dataclass(frozen=True)
class _Arch:
    """What each architecture's loader requires (its load_arch_hparams / load_arch_tensors)."""

    block: Callable[[dict[str, Any], int, str], Tensors]
    moe: bool            # routed experts in (some) blocks; else a dense FFN everywhere
    qk_norm: bool        # weighted per-head Q/K norms (llama4's are an unweighted L2 norm)
    bias: bool           # Q/K/V (and output) biases
    needs_window: bool   # attention.sliding_window is a required key


def normalize(s: dict[str, Any]) -> None:
    arch = s["arch"]
    a = _ARCHS[arch]
    if a.moe and not (s["n_expert"] and s["expert_ff"] and 0 < s["n_expert_used"] <= s["n_expert"]):
        raise ValueError(f"{arch} needs n_expert, expert_ff and 0 < n_expert_used <= n_expert")
    if not a.moe and (s["n_expert"] or not s["n_ff"]):
        raise ValueError(f"{arch} is dense: give n_ff and no n_expert")
    if a.needs_window and not s["sliding_window"]:
        raise ValueError(f"{arch} needs sliding_window (its loader reads attention.sliding_window)")
    if arch == "llama4":
        s["moe_every"] = s["moe_every"] or 1
        if s["moe_every"] > 1 and not s["n_ff"]:
            raise ValueError("llama4 with dense blocks between the MoE ones (moe_every > 1) needs n_ff")
    s["qk_norm"], s["qkv_bias"] = a.qk_norm, a.bias
    check_rope(s)


def metadata(s: dict[str, Any]) -> Metadata:
    out = base_metadata(s)
    if s["sliding_window"]:
        out.append(("attention.sliding_window", s["sliding_window"], U32))
    if s["rope_freq_base_swa"]:
        out.append(("rope.freq_base_swa", float(s["rope_freq_base_swa"]), F32))
    if s["arch"] == "llama4":
        out.append(("interleave_moe_layer_step", s["moe_every"], U32))
    return out


def _llama4_block(s: dict[str, Any], il: int, b: str) -> Tensors:
    out = attention_tensors(s, b) + [(b + "ffn_norm.weight", (s["n_embd"],))]
    if (il + 1) % s["moe_every"] == 0:                   # llama4.cpp: is_moe_layer
        return out + moe.expert_ffn(s, b, n_shared=1)
    return out + moe.dense_ffn(s["n_embd"], s["n_ff"], b)


def _gpt_oss_block(s: dict[str, Any], il: int, b: str) -> Tensors:
    e, ne, ff = s["n_embd"], s["n_expert"], s["expert_ff"]
    return attention_tensors(s, b) + [
        (b + "attn_output.bias", (e,)), (b + "attn_sinks.weight", (s["n_head"],)),
        (b + "post_attention_norm.weight", (e,)),
        (b + "ffn_gate_inp.weight", (e, ne)), (b + "ffn_gate_inp.bias", (ne,)),
        (b + "ffn_gate_exps.weight", (e, ff, ne)), (b + "ffn_gate_exps.bias", (ff, ne)),
        (b + "ffn_up_exps.weight", (e, ff, ne)), (b + "ffn_up_exps.bias", (ff, ne)),
        (b + "ffn_down_exps.weight", (ff, e, ne)), (b + "ffn_down_exps.bias", (e, ne))]


def _gemma3_block(s: dict[str, Any], il: int, b: str) -> Tensors:
    e = s["n_embd"]
    return attention_tensors(s, b) + [(b + "post_attention_norm.weight", (e,)), (b + "ffn_norm.weight", (e,))] \
        + moe.dense_ffn(e, s["n_ff"], b) + [(b + "post_ffw_norm.weight", (e,))]


_ARCHS = {
    "llama4": _Arch(_llama4_block, moe=True, qk_norm=False, bias=False, needs_window=False),
    "gpt-oss": _Arch(_gpt_oss_block, moe=True, qk_norm=False, bias=True, needs_window=True),
    "gemma3": _Arch(_gemma3_block, moe=False, qk_norm=True, bias=False, needs_window=False),
}


def tensors(s: dict[str, Any]) -> Tensors:
    block = _ARCHS[s["arch"]].block
    out = embeddings(s)
    for il in range(s["n_layers"]):
        out += block(s, il, f"blk.{il}.")
    return out + output(s)


LAYOUT = register(Layout(tuple(_ARCHS), normalize, metadata, tensors, FIELDS,
                         source="src/models/llama4.cpp, openai-moe.cpp, gemma3.cpp"))
