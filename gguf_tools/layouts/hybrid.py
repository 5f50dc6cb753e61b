"""Hybrid recurrent + attention decoders, and pure Mamba-2: some layers keep a recurrent state, not a KV cache.

Which layers are recurrent is the ``layer_pattern`` spec field, one character per layer (the characters of
Nemotron-H's ``hybrid_override_pattern``): ``M`` recurrent (Mamba-2, gated delta-net or short convolution),
``*`` attention, ``-`` FFN only (nemotron_h).  What llama.cpp reads to tell them apart differs per
architecture, and each layout writes what the converter writes:

- ``qwen35``, ``qwen35moe``, ``qwen3next`` (``src/models/qwen35.cpp``, ``qwen35moe.cpp``, ``qwen3next.cpp``):
  ``attention.recurrent_layers`` (a bool per layer) and ``full_attention_interval`` (the fallback: every
  Nth layer is attention); gated delta-net layers hold ``attn_qkv``/``attn_gate``/``ssm_*``; attention layers
  a gated ``attn_q`` of 2 × n_head × head_dim, per-head Q/K norms and partial RoPE with ``rope.dimension_sections``.
- ``granitehybrid``, ``nemotron_h``, ``lfm2`` (``granite-hybrid.cpp``, ``nemotron-h.cpp``, ``lfm2.cpp``): a
  per-layer ``attention.head_count_kv`` array, 0 on recurrent layers; nemotron_h adds a per-layer
  ``feed_forward_length`` array (both 0 on a Mamba layer, KV heads 0 on an FFN layer).
- ``mamba2`` (``mamba2.cpp``): every layer recurrent, ``head_count`` 0.

SSM sizes use llama.cpp's meaning of the ``ssm.*`` keys (``conversion/qwen.py``, ``mamba.py``, ``granite.py``):
for the delta-net, ``state_size`` is the key/value head dim, ``group_count`` the key heads, ``time_step_rank``
the value heads and ``inner_size`` value heads × head dim; for Mamba-2, ``inner_size`` is d_inner,
``time_step_rank`` the SSM heads and ``group_count`` n_groups.  Qwen3.5/Qwen3-Next MTP (``nextn``) blocks, which
the converter appends by default, are the ``nextn_layers`` field (0 by default: ``--no-mtp``, as most published GGUFs).
Not written: Granite's logit/residual/embedding scales, Nemotron-H's MTP head, nemotron_h_moe and lfm2moe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gguf import GGUFValueType as V

from . import Fields, Layout, Metadata, Tensors, register
from .attention import attention_tensors, base_metadata, embeddings, ffn_tensors, output

U32, F32, BOOL, ARR = V.UINT32, V.FLOAT32, V.BOOL, V.ARRAY

RECURRENT, ATTENTION, FFN_ONLY = "M", "*", "-"

FIELDS: Fields = {
    "layer_pattern": (str, "", ("hybrids: one character per layer, M recurrent, * attention, - FFN only (nemotron_h); "
                                "default: qwen35/qwen3next from full_attention_interval, mamba2 all M")),
    "full_attention_interval": (int, 0, "qwen35/qwen3next: every Nth layer is full attention (default 4)"),
    "ssm_conv_kernel": (int, 0, "SSM / short-conv kernel width (default 4; lfm2: shortconv.l_cache, default 3)"),
    "ssm_state": (int, 0, "SSM state size (delta-net: key/value head dim; Mamba-2: d_state, default 128)"),
    "ssm_groups": (int, 0, "SSM group count (delta-net: key heads; Mamba-2: n_groups, default 1)"),
    "ssm_dt_rank": (int, 0, "SSM time-step rank (delta-net: value heads; Mamba-2: SSM heads, default ssm_inner / 64)"),
    "ssm_inner": (int, 0, "SSM inner size (default: delta-net value heads x head dim; Mamba-2 2 x n_embd)"),
    "ssm_conv_bias": (bool, True, "Mamba-2 layers have ssm_conv1d.bias"),
    "shared_expert_ff": (int, 0, "shared expert FFN size (qwen35moe/qwen3next: default n_ff; granitehybrid: none)"),
    "rope_dim": (int, 0, "qwen35/qwen3next: rotated dims per head (default head_dim / 4)"),
    "rope_sections": (list, [], "qwen35/qwen35moe rope.dimension_sections (default [11, 11, 10, 0])"),
    "nextn_layers": (int, 0, ("qwen35/qwen3next: MTP (nextn) blocks after the n_layers trunk, as the converter writes "
                         "by default (0: converted with --no-mtp, as most published GGUFs are)")),
}

Changes = dict[str, "tuple[Any, V] | None"]      # metadata key -> (value, type), or None to drop the key


def _default(s: dict[str, Any], key: str, value: int) -> int:
    s[key] = s[key] or value
    return s[key]


def _pattern_every(s: dict[str, Any]) -> str:
    every = _default(s, "full_attention_interval", 4)
    return "".join(ATTENTION if (i + 1) % every == 0 else RECURRENT for i in range(s["n_layers"]))


# ---- per family: complete the spec (returning the default layer pattern) and the keys it adds -------------


def _complete_delta_net(s: dict[str, Any]) -> str:
    """qwen35.cpp / qwen3next.cpp: head_k_dim = head_v_dim = ssm_d_state, n_v_heads a multiple of n_k_heads."""
    if not (s["ssm_state"] and s["ssm_groups"] and s["ssm_dt_rank"]):
        raise ValueError(f"arch {s['arch']!r} needs ssm_state (linear head dim), ssm_groups (linear key heads) "
                         "and ssm_dt_rank (linear value heads)")
    if s["ssm_dt_rank"] % s["ssm_groups"]:
        raise ValueError("ssm_dt_rank (value heads) must be a multiple of ssm_groups (key heads)")
    _default(s, "ssm_conv_kernel", 4)
    _default(s, "ssm_inner", s["ssm_state"] * s["ssm_dt_rank"])
    _default(s, "rope_dim", s["head_dim"] // 4)                  # partial_rotary_factor 0.25
    if s["arch"] != "qwen3next":                                 # qwen35*.cpp require rope.dimension_sections
        s["rope_sections"] = list(s["rope_sections"] or [11, 11, 10, 0])
    if s["n_expert"]:
        _default(s, "shared_expert_ff", s["n_ff"])
    return _pattern_every(s)


def _complete_mamba2(s: dict[str, Any]) -> str:
    """Mamba-2 mixers (conversion/mamba.py defaults: d_conv 4, d_state 128, n_groups 1, expand 2, head dim 64)."""
    _default(s, "ssm_conv_kernel", 4)
    _default(s, "ssm_state", 128)
    _default(s, "ssm_groups", 1)
    _default(s, "ssm_inner", 2 * s["n_embd"])
    _default(s, "ssm_dt_rank", s["ssm_inner"] // 64)
    if s["ssm_inner"] % s["ssm_groups"] or s["ssm_inner"] % s["ssm_dt_rank"]:
        raise ValueError("ssm_inner must be a multiple of ssm_groups and of ssm_dt_rank")
    if s["arch"] == "granitehybrid" and s["ssm_inner"] != 2 * s["n_embd"]:
        raise ValueError("granitehybrid: llama.cpp supports only ssm_inner = 2 x n_embd (granite-hybrid.cpp)")
    return RECURRENT * s["n_layers"] if s["arch"] == "mamba2" else ""


def _complete_lfm2(s: dict[str, Any]) -> str:
    _default(s, "ssm_conv_kernel", 3)
    if s["n_head"] * s["head_dim"] != s["n_embd"]:
        raise ValueError("lfm2: n_head x head_dim must equal n_embd (attn_q is n_embd x n_embd)")
    return ""


def _ssm_keys(s: dict[str, Any]) -> Changes:
    return {"ssm.conv_kernel": (s["ssm_conv_kernel"], U32), "ssm.inner_size": (s["ssm_inner"], U32),
            "ssm.state_size": (s["ssm_state"], U32), "ssm.time_step_rank": (s["ssm_dt_rank"], U32),
            "ssm.group_count": (s["ssm_groups"], U32)}


def _kv_array(s: dict[str, Any]) -> Changes:
    return {"attention.head_count_kv": (head_kv_layers(s), ARR)}


def _keys_delta_net(s: dict[str, Any]) -> Changes:
    recurrent = [c == RECURRENT for c in s["layer_pattern"]] + [False] * s["nextn_layers"]   # MTP blocks: attention
    out: Changes = {"rope.dimension_count": (s["rope_dim"], U32),
                    "full_attention_interval": (s["full_attention_interval"], U32),
                    "attention.recurrent_layers": (recurrent, ARR), **_ssm_keys(s)}
    if s["nextn_layers"]:        # llama-model.cpp: block_count counts the MTP blocks, nextn_predict_layers says how many
        out.update({"block_count": (s["n_layers"] + s["nextn_layers"], U32), "nextn_predict_layers": (s["nextn_layers"], U32)})
    if s["rope_sections"]:
        out["rope.dimension_sections"] = (list(s["rope_sections"]), ARR)
    if s["shared_expert_ff"]:
        out["expert_shared_feed_forward_length"] = (s["shared_expert_ff"], U32)
    return out


def _keys_granite(s: dict[str, Any]) -> Changes:
    out: Changes = {**_kv_array(s), **_ssm_keys(s), "rope.scaling.finetuned": (False, BOOL)}  # 4.0-H: no RoPE
    if s["n_expert"]:       # granite-hybrid.cpp sizes the experts by feed_forward_length
        out.update({"feed_forward_length": (s["expert_ff"], U32), "expert_feed_forward_length": None})
    if s["shared_expert_ff"]:
        out["expert_shared_feed_forward_length"] = (s["shared_expert_ff"], U32)
    return out


def _keys_nemotron(s: dict[str, Any]) -> Changes:
    return {**_kv_array(s), **_ssm_keys(s),
            "feed_forward_length": ([s["n_ff"] if c == FFN_ONLY else 0 for c in s["layer_pattern"]], ARR),
            "attention.layer_norm_epsilon": (float(s["norm_eps"]), F32)}       # nemotron-h.cpp requires it


def _keys_lfm2(s: dict[str, Any]) -> Changes:
    return {**_kv_array(s), "shortconv.l_cache": (s["ssm_conv_kernel"], U32)}


def _keys_mamba2(s: dict[str, Any]) -> Changes:
    """conversion/mamba.py writes head_count 0 and feed_forward_length 0, no attention keys."""
    dropped = ("attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
               "rope.freq_base")
    return {**dict.fromkeys(dropped), "attention.head_count": (0, U32), "feed_forward_length": (0, U32),
            **_ssm_keys(s)}


@dataclass(frozen=True)
class _Family:
    complete: Callable[[dict[str, Any]], str]
    keys: Callable[[dict[str, Any]], Changes]
    block: Callable[[dict[str, Any], str, str], Tensors]
    kinds: str = RECURRENT + ATTENTION      # layer kinds the pattern may use
    experts: str = "optional"                # "required", "optional" or "none"
    qk_norm: bool = False


# upper bounds far above any real model (like skeleton.SPEC_LIMITS), so a typo cannot plan an exabyte file
_LIMITS = {"full_attention_interval": 10_000, "ssm_conv_kernel": 64, "ssm_state": 1 << 14, "ssm_groups": 1 << 12,
           "ssm_dt_rank": 1 << 14, "ssm_inner": 1 << 20, "shared_expert_ff": 1 << 22, "rope_dim": 1 << 14,
           "nextn_layers": 16}


def _check(s: dict[str, Any]) -> None:
    for key, limit in _LIMITS.items():
        if s[key] > limit:
            raise ValueError(f"spec field {key!r} is {s[key]}, more than any model has (limit {limit:,})")
    sections = s["rope_sections"]
    if sections and (len(sections) != 4 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                   for x in sections)):
        raise ValueError(f"rope_sections must be 4 non-negative integers (rope.dimension_sections), got {sections!r}")


def normalize(s: dict[str, Any]) -> None:
    """Complete the SSM sizes and the layer pattern; ValueError for a spec llama.cpp would refuse."""
    arch, fam = s["arch"], _FAMILIES[s["arch"]]
    _check(s)
    default = fam.complete(s)
    pattern = s["layer_pattern"] or default
    if len(pattern) != s["n_layers"] or set(pattern) - set(fam.kinds):
        raise ValueError(f"layer_pattern must have one of {fam.kinds!r} per layer ({s['n_layers']}), got {pattern!r}")
    s["layer_pattern"] = pattern
    if fam.experts == "required" or (fam.experts == "optional" and s["n_expert"]):
        if not (s["n_expert"] and s["expert_ff"] and 0 < s["n_expert_used"] <= s["n_expert"]):
            raise ValueError(f"arch {arch!r} with experts needs n_expert, expert_ff and 0 < n_expert_used <= n_expert")
    elif s["n_expert"]:
        raise ValueError(f"arch {arch!r} has no experts: give no n_expert")
    elif arch != "mamba2" and not s["n_ff"]:
        raise ValueError(f"arch {arch!r} needs n_ff")
    if s["nextn_layers"] and fam.complete is not _complete_delta_net:
        raise ValueError(f"arch {arch!r}: nextn_layers (MTP blocks) is written here only for qwen35/qwen35moe/qwen3next")
    s["qkv_bias"], s["qk_norm"] = False, fam.qk_norm


def head_kv_layers(s: dict[str, Any]) -> list[int]:
    """KV heads of each of llama.cpp's n_layer_all layers (MTP blocks included): the per-layer array where the arch
    writes one (0 off attention layers), qwen35/qwen3next's scalar on every layer, 0 everywhere for mamba2."""
    if _FAMILIES[s["arch"]].complete is _complete_delta_net:
        return [s["n_head_kv"]] * (s["n_layers"] + s["nextn_layers"])
    return [s["n_head_kv"] if c == ATTENTION else 0 for c in s["layer_pattern"]]


def _replace(meta: Metadata, changes: Changes) -> Metadata:
    """``meta`` with keys replaced (in place) or dropped (None); new keys appended."""
    out: Metadata = [(k, *changes[k]) if k in changes else (k, v, t) for k, v, t in meta
                     if k not in changes or changes[k] is not None]
    seen = {k for k, _, _ in meta}
    return out + [(k, *v) for k, v in changes.items() if v is not None and k not in seen]


def metadata(s: dict[str, Any]) -> Metadata:
    """attention.base_metadata with the family's keys (and no feed_forward_length where there is no n_ff)."""
    changes: Changes = {} if s["n_ff"] else {"feed_forward_length": None}
    return _replace(base_metadata(s), {**changes, **_FAMILIES[s["arch"]].keys(s)})


# ---- tensors ----------------------------------------------------------------------------------------------


def _delta_net(s: dict[str, Any], b: str) -> Tensors:
    """A gated delta-net layer (qwen35.cpp / qwen3next.cpp load_arch_tensors, the converter's split of in_proj)."""
    e, hk, nk, nv = s["n_embd"], s["ssm_state"], s["ssm_groups"], s["ssm_dt_rank"]
    key_dim, value_dim = hk * nk, hk * nv
    out: Tensors = [(b + "attn_qkv.weight", (e, 2 * key_dim + value_dim)), (b + "attn_gate.weight", (e, value_dim)),
                    (b + "ssm_conv1d.weight", (s["ssm_conv_kernel"], 2 * key_dim + value_dim)),
                    (b + "ssm_dt.bias", (nv,)), (b + "ssm_a", (nv,))]
    if s["arch"] == "qwen3next":
        out.append((b + "ssm_ba.weight", (e, 2 * nv)))
    else:
        out += [(b + "ssm_beta.weight", (e, nv)), (b + "ssm_alpha.weight", (e, nv))]
    return out + [(b + "ssm_norm.weight", (hk,)), (b + "ssm_out.weight", (value_dim, e))]


def _gated_attention(s: dict[str, Any], b: str) -> Tensors:
    """Qwen3.5 / Qwen3-Next attention: attn_q holds the query and its output gate (2 x n_head x head_dim)."""
    e, hd = s["n_embd"], s["head_dim"]
    q, kv = s["n_head"] * hd, s["n_head_kv"] * hd
    return [(b + "attn_q.weight", (e, 2 * q)), (b + "attn_k.weight", (e, kv)), (b + "attn_v.weight", (e, kv)),
            (b + "attn_output.weight", (q, e)), (b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]


def _mamba2(s: dict[str, Any], b: str) -> Tensors:
    """A Mamba-2 mixer (mamba2.cpp, granite-hybrid.cpp, nemotron-h.cpp); ssm_a/ssm_d have no .weight suffix."""
    e, d_inner, ds, ng, nh = s["n_embd"], s["ssm_inner"], s["ssm_state"], s["ssm_groups"], s["ssm_dt_rank"]
    conv = d_inner + 2 * ng * ds
    out: Tensors = [(b + "ssm_in.weight", (e, d_inner + conv + nh)),
                    (b + "ssm_conv1d.weight", (s["ssm_conv_kernel"], conv))]
    if s["ssm_conv_bias"]:
        out.append((b + "ssm_conv1d.bias", (conv,)))
    return out + [(b + "ssm_dt.bias", (nh,)), (b + "ssm_a", (1, nh)), (b + "ssm_d", (1, nh)),
                  (b + "ssm_norm.weight", (d_inner // ng, ng)), (b + "ssm_out.weight", (d_inner, e))]


def _shortconv(s: dict[str, Any], b: str) -> Tensors:
    """An LFM2 short-convolution layer (lfm2.cpp)."""
    e = s["n_embd"]
    return [(b + "shortconv.conv.weight", (s["ssm_conv_kernel"], e)), (b + "shortconv.in_proj.weight", (e, 3 * e)),
            (b + "shortconv.out_proj.weight", (e, e))]


def _shared_expert(s: dict[str, Any], b: str, gate_inp: bool) -> Tensors:
    e, sh = s["n_embd"], s["shared_expert_ff"]
    out: Tensors = [(b + "ffn_gate_inp_shexp.weight", (e,))] if gate_inp else []
    return out + [(b + "ffn_gate_shexp.weight", (e, sh)), (b + "ffn_up_shexp.weight", (e, sh)),
                  (b + "ffn_down_shexp.weight", (sh, e))]


def _qwen_block(s: dict[str, Any], b: str, kind: str) -> Tensors:
    e = s["n_embd"]
    out: Tensors = [(b + "attn_norm.weight", (e,)), (b + "post_attention_norm.weight", (e,))]
    out += _delta_net(s, b) if kind == RECURRENT else _gated_attention(s, b)
    ffn = ffn_tensors(s, b)[1:]                    # post_attention_norm stands where ffn_norm would
    return out + ffn + (_shared_expert(s, b, gate_inp=True) if s["n_expert"] else [])


def _nextn(s: dict[str, Any], b: str) -> Tensors:
    """An MTP block's own tensors (qwen35.cpp load_block_mtp: mtp.fc, pre_fc_norm_embedding/hidden, mtp.norm)."""
    e = s["n_embd"]
    return [(b + "nextn.eh_proj.weight", (2 * e, e)), (b + "nextn.enorm.weight", (e,)),
            (b + "nextn.hnorm.weight", (e,)), (b + "nextn.shared_head_norm.weight", (e,))]


def _granite_block(s: dict[str, Any], b: str, kind: str) -> Tensors:
    out: Tensors = [(b + "attn_norm.weight", (s["n_embd"],))]
    out += _mamba2(s, b) if kind == RECURRENT else attention_tensors(s, b)[1:]
    out += ffn_tensors(s, b)
    return out + (_shared_expert(s, b, gate_inp=False) if s["n_expert"] and s["shared_expert_ff"] else [])


def _nemotron_block(s: dict[str, Any], b: str, kind: str) -> Tensors:
    e, ff = s["n_embd"], s["n_ff"]
    out: Tensors = [(b + "attn_norm.weight", (e,))]
    if kind == RECURRENT:
        return out + _mamba2(s, b)
    if kind == ATTENTION:
        return out + attention_tensors(s, b)[1:]
    return out + [(b + "ffn_up.weight", (e, ff)), (b + "ffn_down.weight", (ff, e))]   # squared-ReLU MLP, no gate


def _lfm2_block(s: dict[str, Any], b: str, kind: str) -> Tensors:
    e, hd = s["n_embd"], s["head_dim"]
    out = ffn_tensors(s, b) + [(b + "attn_norm.weight", (e,))]
    if kind == RECURRENT:
        return out + _shortconv(s, b)
    return out + [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))] + attention_tensors(s, b)[1:5]


def _mamba2_block(s: dict[str, Any], b: str, kind: str) -> Tensors:
    return [(b + "attn_norm.weight", (s["n_embd"],))] + _mamba2(s, b)


_FAMILIES: dict[str, _Family] = {
    "qwen35": _Family(_complete_delta_net, _keys_delta_net, _qwen_block, experts="none", qk_norm=True),
    "qwen35moe": _Family(_complete_delta_net, _keys_delta_net, _qwen_block, experts="required", qk_norm=True),
    "qwen3next": _Family(_complete_delta_net, _keys_delta_net, _qwen_block, experts="required", qk_norm=True),
    "granitehybrid": _Family(_complete_mamba2, _keys_granite, _granite_block),
    "nemotron_h": _Family(_complete_mamba2, _keys_nemotron, _nemotron_block, kinds=RECURRENT + ATTENTION + FFN_ONLY,
                          experts="none"),
    "lfm2": _Family(_complete_lfm2, _keys_lfm2, _lfm2_block, experts="none", qk_norm=True),
    "mamba2": _Family(_complete_mamba2, _keys_mamba2, _mamba2_block, kinds=RECURRENT, experts="none"),
}


def tensors(s: dict[str, Any]) -> Tensors:
    """(name, shape) of every tensor, GGUF order (row length first), in llama.cpp naming."""
    block = _FAMILIES[s["arch"]].block
    out = embeddings(s)
    for il, kind in enumerate(s["layer_pattern"]):
        out += block(s, f"blk.{il}.", kind)
    for il in range(s["n_layers"], s["n_layers"] + s["nextn_layers"]):
        out += _qwen_block(s, f"blk.{il}.", ATTENTION) + _nextn(s, f"blk.{il}.")
    tail = output(s)
    if s["arch"] == "lfm2":                        # lfm2.cpp reads the final norm as "token_embd_norm"
        tail[0] = ("token_embd_norm.weight", tail[0][1])
    return out + tail


LAYOUT = register(Layout(
    tuple(_FAMILIES),
    normalize, metadata, tensors, FIELDS, head_kv_layers=head_kv_layers,
    source="src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp, granite-hybrid.cpp, nemotron-h.cpp, lfm2.cpp, "
           "mamba2.cpp; conversion/qwen.py, granite.py, nemotron.py, lfm2.py, mamba.py"))
