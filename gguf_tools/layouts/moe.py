"""Mixture-of-experts pieces several families share: leading dense blocks, shared experts, routing keys, NextN.

Not a family of its own (it registers nothing): ``mla`` (deepseek2), ``attention`` (glm4moe) and ``interleaved``
(llama4) build their blocks from these.  Names and shapes follow llama.cpp ``src/models/deepseek2.cpp`` and
``glm4-moe.cpp`` (load_arch_tensors: ``ffn_{gate,up,down}_shexp`` of ``expert_ff × n_expert_shared``,
``exp_probs_b.bias``, the ``nextn.*`` tensors of the blocks after ``n_layers``); the keys are the ones the
converter writes (``conversion/base.py`` TextModel.set_gguf_parameters, ``deepseek.py``, ``glm.py``), read by
``src/llama-model.cpp`` load_hparams and the archs' load_arch_hparams.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType as V

from . import Fields, Metadata, Tensors

U32, F32, BOOL = V.UINT32, V.FLOAT32, V.BOOL

# expert_gating_func values (gguf-py constants.py ExpertGatingFuncType; llama-hparams.h LLAMA_EXPERT_GATING_FUNC_TYPE_*)
GATING = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}

FIELDS: Fields = {
    "n_dense_lead": (int, 0, "leading dense FFN blocks before the MoE ones (first_k_dense_replace)"),
    "n_expert_shared": (int, 0, "shared experts per MoE block (ffn_*_shexp of n_expert_shared × expert_ff)"),
    "expert_gating": (str, "", f"router scoring function written as expert_gating_func: {', '.join(GATING)}"),
    "expert_weights_scale": ((int, float), 0.0, "routed_scaling_factor (expert_weights_scale; 0: not written)"),
    "expert_weights_norm": (bool, False, "norm_topk_prob (expert_weights_norm)"),
    "expert_probs_bias": (bool, False, "per-expert routing bias exp_probs_b (e_score_correction_bias)"),
    "n_expert_groups": (int, 0, "expert groups for group-limited routing (n_group)"),
    "n_group_used": (int, 0, "groups each token may route to (topk_group)"),
    "nextn_layers": (int, 0, "NextN/MTP blocks appended after n_layers (nextn_predict_layers; block_count grows)"),
}

# the NextN block's own tensors beside a full decoder block: name -> shape from (n_embd, vocab) (deepseek2.cpp,
# glm4-moe.cpp); GLM-4.5's checkpoint carries all six, embed_tokens and shared_head_head included
NEXTN = {"nextn.eh_proj.weight": lambda e, v: (2 * e, e), "nextn.embed_tokens.weight": lambda e, v: (e, v),
         "nextn.enorm.weight": lambda e, v: (e,), "nextn.hnorm.weight": lambda e, v: (e,),
         "nextn.shared_head_head.weight": lambda e, v: (e, v), "nextn.shared_head_norm.weight": lambda e, v: (e,)}


def normalize(s: dict[str, Any]) -> None:
    """Check the shared MoE fields (ValueError naming the field)."""
    if s["expert_gating"] and s["expert_gating"] not in GATING:
        raise ValueError(f"spec field 'expert_gating' is {s['expert_gating']!r}; choose one of {', '.join(GATING)}")
    if s["n_dense_lead"] > s["n_layers"]:
        raise ValueError(f"n_dense_lead {s['n_dense_lead']} is more than n_layers {s['n_layers']}")
    if s["n_dense_lead"] and not s["n_ff"]:
        raise ValueError("leading dense blocks need n_ff")
    if s["n_expert_groups"] and (s["n_expert"] % s["n_expert_groups"] or not 0 < s["n_group_used"] <= s["n_expert_groups"]):
        raise ValueError("n_expert_groups must divide n_expert, with 0 < n_group_used <= n_expert_groups")


def block_count(s: dict[str, Any]) -> int:
    """GGUF block_count: the trunk plus the NextN blocks (llama-model.cpp load_hparams: n_layer_all)."""
    return s["n_layers"] + s.get("nextn_layers", 0)


def metadata(s: dict[str, Any]) -> Metadata:
    """The routing keys, each only when the spec sets it (as the converter writes them)."""
    out: Metadata = []
    if s["n_dense_lead"]:
        out.append(("leading_dense_block_count", s["n_dense_lead"], U32))
    if s["n_expert_shared"]:
        out.append(("expert_shared_count", s["n_expert_shared"], U32))
    if s["expert_weights_scale"]:
        out.append(("expert_weights_scale", float(s["expert_weights_scale"]), F32))
    if s["expert_weights_norm"]:
        out.append(("expert_weights_norm", True, BOOL))
    if s["expert_gating"]:
        out.append(("expert_gating_func", GATING[s["expert_gating"]], U32))
    if s["n_expert_groups"]:
        out += [("expert_group_count", s["n_expert_groups"], U32), ("expert_group_used_count", s["n_group_used"], U32)]
    if s["nextn_layers"]:
        out.append(("nextn_predict_layers", s["nextn_layers"], U32))
    return out


def dense_ffn(e: int, ff: int, b: str) -> Tensors:
    return [(b + "ffn_gate.weight", (e, ff)), (b + "ffn_up.weight", (e, ff)), (b + "ffn_down.weight", (ff, e))]


def expert_ffn(s: dict[str, Any], b: str, n_shared: int | None = None) -> Tensors:
    """Router, optional routing bias, the 3-D expert stacks and the shared expert (``n_shared`` × expert_ff)."""
    e, ne, ff = s["n_embd"], s["n_expert"], s["expert_ff"]
    out: Tensors = [(b + "ffn_gate_inp.weight", (e, ne))]
    if s["expert_probs_bias"]:
        out.append((b + "exp_probs_b.bias", (ne,)))
    out += [(b + "ffn_gate_exps.weight", (e, ff, ne)), (b + "ffn_up_exps.weight", (e, ff, ne)),
            (b + "ffn_down_exps.weight", (ff, e, ne))]
    sh = ff * (s["n_expert_shared"] if n_shared is None else n_shared)
    if sh:
        out += [(b + "ffn_gate_shexp.weight", (e, sh)), (b + "ffn_up_shexp.weight", (e, sh)),
                (b + "ffn_down_shexp.weight", (sh, e))]
    return out


def nextn_tensors(s: dict[str, Any], b: str) -> Tensors:
    return [(b + name, shape(s["n_embd"], s["vocab_size"])) for name, shape in NEXTN.items()]
