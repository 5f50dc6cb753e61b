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
``time_step_rank`` the SSM heads and ``group_count`` n_groups.  Not written: MTP (``nextn``) blocks, which the
converter appends to Qwen3.5/Qwen3-Next by default (``--no-mtp`` drops them; published GGUFs mostly lack them),
Granite's logit/residual/embedding scales, and nemotron_h_moe / lfm2moe.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType as V

from . import Fields, Layout, Metadata, Tensors, register
from .attention import attention_tensors, base_metadata, embeddings, ffn_tensors, output

U32, F32, BOOL, ARR = V.UINT32, V.FLOAT32, V.BOOL, V.ARRAY

RECURRENT, ATTENTION, FFN_ONLY = "M", "*", "-"

FIELDS: Fields = {
    "layer_pattern": (str, "", "hybrids: one character per layer, M recurrent, * attention, - FFN only (nemotron_h); "
                               "default: qwen35/qwen3next from full_attention_interval, mamba2 all M"),
    "full_attention_interval": (int, 0, "qwen35/qwen3next: every Nth layer is full attention (default 4)"),
    "ssm_conv_kernel": (int, 0, "SSM / short-conv kernel width (default 4; lfm2: shortconv.l_cache, default 3)"),
    "ssm_state": (int, 0, "SSM state size (delta-net: key/value head dim; Mamba-2: d_state, default 128)"),
    "ssm_groups": (int, 0, "SSM group count (delta-net: key heads; Mamba-2: n_groups, default 1)"),
    "ssm_dt_rank": (int, 0, "SSM time-step rank (delta-net: value heads; Mamba-2: SSM heads, default n_head)"),
    "ssm_inner": (int, 0, "SSM inner size (default: delta-net value heads x head dim; Mamba-2 2 x n_embd)"),
    "ssm_conv_bias": (bool, True, "Mamba-2 layers have ssm_conv1d.bias"),
    "shared_expert_ff": (int, 0, "shared expert FFN size (qwen35moe/qwen3next: default n_ff; granitehybrid: none)"),
    "rope_dim": (int, 0, "rotated dims per head (default head_dim; qwen35/qwen3next: head_dim / 4)"),
    "rope_sections": (list, [], "qwen35/qwen35moe rope.dimension_sections (default [11, 11, 10, 0])"),
}

_DELTA_NET = ("qwen35", "qwen35moe", "qwen3next")
_MAMBA2 = ("mamba2", "granitehybrid", "nemotron_h")
_MOE = ("qwen35moe", "qwen3next")                 # always MoE; granitehybrid is MoE when n_expert > 0
_PER_LAYER_KV = ("granitehybrid", "nemotron_h", "lfm2")


def _int(s: dict[str, Any], key: str, default: int) -> int:
    s[key] = s[key] or default
    return s[key]


def normalize(s: dict[str, Any]) -> None:
    """Complete the SSM sizes and the layer pattern; ValueError for a spec llama.cpp would refuse."""
    arch, n = s["arch"], s["n_layers"]
    if arch in _DELTA_NET:
        every = _int(s, "full_attention_interval", 4)
        default = "".join(ATTENTION if (i + 1) % every == 0 else RECURRENT for i in range(n))
        if not (s["ssm_state"] and s["ssm_groups"] and s["ssm_dt_rank"]):
            raise ValueError(f"arch {arch!r} needs ssm_state (linear head dim), ssm_groups (linear key heads) "
                             "and ssm_dt_rank (linear value heads)")
        _int(s, "ssm_conv_kernel", 4)
        _int(s, "ssm_inner", s["ssm_state"] * s["ssm_dt_rank"])
        if s["ssm_dt_rank"] % s["ssm_groups"]:
            raise ValueError("ssm_dt_rank (value heads) must be a multiple of ssm_groups (key heads)")
        _int(s, "rope_dim", s["head_dim"] // 4)
        if arch != "qwen3next":
            s["rope_sections"] = list(s["rope_sections"] or [11, 11, 10, 0])
    elif arch == "mamba2":
        default = RECURRENT * n
    else:
        default = ""
    if arch in _MAMBA2:
        _int(s, "ssm_conv_kernel", 4)
        _int(s, "ssm_state", 128)
        _int(s, "ssm_groups", 1)
        _int(s, "ssm_inner", 2 * s["n_embd"])
        _int(s, "ssm_dt_rank", s["ssm_inner"] // 64)   # the converter's default SSM head dim is 64
        if s["ssm_inner"] % s["ssm_groups"] or s["ssm_inner"] % s["ssm_dt_rank"]:
            raise ValueError("ssm_inner must be a multiple of ssm_groups and of ssm_dt_rank")
        if arch == "granitehybrid" and s["ssm_inner"] != 2 * s["n_embd"]:
            raise ValueError("granitehybrid: llama.cpp supports only ssm_inner = 2 x n_embd (granite-hybrid.cpp)")
    if arch == "lfm2":
        _int(s, "ssm_conv_kernel", 3)
        if s["n_head"] * s["head_dim"] != s["n_embd"]:
            raise ValueError("lfm2: n_head x head_dim must equal n_embd (attn_q is n_embd x n_embd)")
    pattern = s["layer_pattern"] or default
    allowed = RECURRENT + ATTENTION + (FFN_ONLY if arch == "nemotron_h" else "")
    if len(pattern) != n or set(pattern) - set(allowed):
        raise ValueError(f"layer_pattern must have one of {allowed!r} per layer ({n}), got {pattern!r}")
    s["layer_pattern"] = pattern
    if arch in _MOE or (arch == "granitehybrid" and s["n_expert"]):
        if not (s["n_expert"] and s["expert_ff"] and 0 < s["n_expert_used"] <= s["n_expert"]):
            raise ValueError(f"arch {arch!r} with experts needs n_expert, expert_ff and 0 < n_expert_used <= n_expert")
        if arch in _MOE:
            _int(s, "shared_expert_ff", s["n_ff"])
    elif s["n_expert"]:
        raise ValueError(f"arch {arch!r} is dense here: give no n_expert")
    elif arch != "mamba2" and not s["n_ff"]:
        raise ValueError(f"arch {arch!r} needs n_ff")
    s["qkv_bias"] = False
    s["qk_norm"] = arch in _DELTA_NET or arch == "lfm2"


def head_kv_layers(s: dict[str, Any]) -> list[int]:
    """KV heads of each layer as llama.cpp's hparams hold them: the per-layer array where the arch writes one
    (0 off attention layers), qwen35/qwen3next's scalar on every layer, 0 everywhere for mamba2."""
    if s["arch"] in _DELTA_NET:
        return [s["n_head_kv"]] * s["n_layers"]
    return [s["n_head_kv"] if c == ATTENTION else 0 for c in s["layer_pattern"]]


# ---- metadata ---------------------------------------------------------------------------------------------


def _ssm_keys(s: dict[str, Any]) -> Metadata:
    return [("ssm.conv_kernel", s["ssm_conv_kernel"], U32), ("ssm.inner_size", s["ssm_inner"], U32),
            ("ssm.state_size", s["ssm_state"], U32), ("ssm.time_step_rank", s["ssm_dt_rank"], U32),
            ("ssm.group_count", s["ssm_groups"], U32)]


def _replace(meta: Metadata, changes: dict[str, tuple[Any, V] | None]) -> Metadata:
    """``meta`` with keys replaced (in place) or dropped (None); new keys appended."""
    out: Metadata = []
    for key, value, vtype in meta:
        if key in changes:
            if changes[key] is not None:
                out.append((key, *changes[key]))
        else:
            out.append((key, value, vtype))
    seen = {k for k, _, _ in meta}
    out += [(k, *v) for k, v in changes.items() if v is not None and k not in seen]
    return out


def metadata(s: dict[str, Any]) -> Metadata:
    arch = s["arch"]
    meta = base_metadata(s)
    changes: dict[str, tuple[Any, V] | None] = {}
    if not s["n_ff"]:
        changes["feed_forward_length"] = None
    if arch in _DELTA_NET:
        changes["rope.dimension_count"] = (s["rope_dim"], U32)
        changes["full_attention_interval"] = (s["full_attention_interval"], U32)
        changes["attention.recurrent_layers"] = ([c == RECURRENT for c in s["layer_pattern"]], ARR)
        if s["rope_sections"]:
            changes["rope.dimension_sections"] = (list(s["rope_sections"]), ARR)
        if s["shared_expert_ff"]:
            changes["expert_shared_feed_forward_length"] = (s["shared_expert_ff"], U32)
    if arch in _PER_LAYER_KV:
        changes["attention.head_count_kv"] = (head_kv_layers(s), ARR)
    if arch == "granitehybrid":
        changes["rope.scaling.finetuned"] = (False, BOOL)          # Granite 4.0-H attention has no RoPE
        if s["n_expert"]:
            changes["feed_forward_length"] = (s["expert_ff"], U32)  # granite-hybrid.cpp: experts are n_ff wide
            changes["expert_feed_forward_length"] = None
        if s["shared_expert_ff"]:
            changes["expert_shared_feed_forward_length"] = (s["shared_expert_ff"], U32)
    if arch == "nemotron_h":
        changes["feed_forward_length"] = ([s["n_ff"] if c == FFN_ONLY else 0 for c in s["layer_pattern"]], ARR)
        changes["attention.layer_norm_epsilon"] = (float(s["norm_eps"]), F32)
    if arch == "lfm2":
        changes["shortconv.l_cache"] = (s["ssm_conv_kernel"], U32)
    if arch == "mamba2":
        for key in ("attention.head_count_kv", "attention.key_length", "attention.value_length",
                    "rope.dimension_count", "rope.freq_base"):
            changes[key] = None
        changes["attention.head_count"] = (0, U32)
        changes["feed_forward_length"] = (0, U32)
    if arch in _DELTA_NET or arch in _MAMBA2:
        changes.update({k: (v, t) for k, v, t in _ssm_keys(s)})
    return _replace(meta, changes)


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


_BLOCKS = {"qwen35": _qwen_block, "qwen35moe": _qwen_block, "qwen3next": _qwen_block,
           "granitehybrid": _granite_block, "nemotron_h": _nemotron_block, "lfm2": _lfm2_block,
           "mamba2": lambda s, b, kind: [(b + "attn_norm.weight", (s["n_embd"],))] + _mamba2(s, b)}


def tensors(s: dict[str, Any]) -> Tensors:
    """(name, shape) of every tensor, GGUF order (row length first), in llama.cpp naming."""
    block = _BLOCKS[s["arch"]]
    out = embeddings(s)
    for il, kind in enumerate(s["layer_pattern"]):
        out += block(s, f"blk.{il}.", kind)
    tail = output(s)
    if s["arch"] == "lfm2":                        # lfm2.cpp reads the final norm as "token_embd_norm"
        tail[0] = ("token_embd_norm.weight", tail[0][1])
    return out + tail


LAYOUT = register(Layout(
    ("qwen35", "qwen35moe", "qwen3next", "granitehybrid", "nemotron_h", "lfm2", "mamba2"),
    normalize, metadata, tensors, FIELDS, head_kv_layers=head_kv_layers,
    source="src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp, granite-hybrid.cpp, nemotron-h.cpp, lfm2.cpp, "
           "mamba2.cpp; conversion/qwen.py, granite.py, nemotron.py, lfm2.py, mamba.py"))
