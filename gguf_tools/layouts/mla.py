"""Multi-head latent attention (MLA): ``deepseek2``, the arch of DeepSeek-V2/V2-Lite/V3/R1 and Kimi-K2.

Follows llama.cpp ``src/models/deepseek2.cpp`` (load_arch_hparams, load_arch_tensors) and the converter,
``conversion/deepseek.py`` DeepseekV2Model.  K and V are rebuilt per head from a shared latent of
``kv_lora_rank`` values plus ``qk_rope_head_dim`` rotary values (``attn_kv_a_mqa``), so the KV cache holds one
"head" per token.  Two on-disk forms:

* current (MLA, the converter since 2025): ``kv_b_proj`` is split into ``attn_k_b`` {qk_nope, kv_lora, n_head}
  and ``attn_v_b`` {kv_lora, v_head, n_head}; ``head_count_kv`` = 1, ``key_length`` = kv_lora + rope dims,
  ``value_length`` = kv_lora and ``key_length_mla`` / ``value_length_mla`` the real head sizes;
* legacy (``mla_legacy``): the unsplit ``attn_kv_b`` {kv_lora, n_head × (qk_nope + v_head)};
  ``head_count_kv`` = n_head, ``key_length`` = qk_nope + rope dims, ``value_length`` = v_head, no ``*_mla`` keys.

Queries come through a low-rank ``attn_q_a`` → ``attn_q_a_norm`` → ``attn_q_b`` when ``q_lora_rank`` > 0 (V2, V3,
Kimi-K2), else a plain ``attn_q`` (V2-Lite).  Blocks below ``n_dense_lead`` have a dense FFN, the rest routed
experts with a shared expert (``gguf_tools.layouts.moe``); NextN/MTP blocks, when present, come last.
``head_dim`` (qk_nope + qk_rope) and ``n_head_kv`` (1, or n_head in the legacy layout) are derived; values a
spec gives for them are replaced.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType as V

from . import Fields, Layout, Metadata, Tensors, moe, register
from .attention import FIELDS as ATTENTION_FIELDS
from .attention import check_rope, core_metadata, embeddings, output

U32, F32 = V.UINT32, V.FLOAT32

FIELDS: Fields = {
    "q_lora_rank": (int, 0, "query low-rank size (0: a plain attn_q, as DeepSeek-V2-Lite)"),
    "kv_lora_rank": (int, 512, "KV latent size (MLA)"),
    "qk_nope_head_dim": (int, 128, "per-head Q/K dimensions without RoPE (MLA)"),
    "qk_rope_head_dim": (int, 64, "per-head Q/K dimensions with RoPE, shared by all heads in K (MLA)"),
    "v_head_dim": (int, 128, "per-head V dimensions (MLA)"),
    "mla_legacy": (bool, False, "the legacy MLA layout: unsplit attn_kv_b, head_count_kv = n_head"),
    "rope_yarn_log_mul": ((int, float), 0.0, "YaRN mscale_all_dim; written × 0.1 (deepseek.py) when set"),
    **moe.FIELDS,
    **ATTENTION_FIELDS,
}

# deepseek2.cpp load_arch_hparams reads q_lora_rank unless it takes the model for a "lite" one by its block count
_LITE_BLOCKS = (26, 27)


def normalize(s: dict[str, Any]) -> None:
    if not (s["n_expert"] and s["expert_ff"] and 0 < s["n_expert_used"] <= s["n_expert"]):
        raise ValueError("deepseek2 needs n_expert, expert_ff and 0 < n_expert_used <= n_expert")
    if not s["n_expert_shared"]:
        raise ValueError("deepseek2 needs n_expert_shared > 0 (deepseek2.cpp creates ffn_*_shexp in every MoE block)")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if s[key] <= 0:
            raise ValueError(f"spec field {key!r} must be positive for deepseek2")
    s["head_dim"] = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]      # the real Q/K head size
    s["n_head_kv"] = s["n_head"] if s["mla_legacy"] else 1              # what llama.cpp reads, and n_gqa for mix
    s["rope_dim"] = s["qk_rope_head_dim"]
    s["qk_norm"] = s["qkv_bias"] = False
    check_rope(s)
    moe.normalize(s)


def metadata(s: dict[str, Any]) -> Metadata:
    """The keys deepseek.py writes: MLA ranks and head sizes, routing, YaRN's log multiplier."""
    kv, rope = s["kv_lora_rank"], s["qk_rope_head_dim"]
    k_mla, v_mla = s["head_dim"], s["v_head_dim"]
    out = core_metadata(s)
    if s["mla_legacy"]:
        out += [("attention.head_count_kv", s["n_head"], U32), ("attention.key_length", k_mla, U32),
                ("attention.value_length", v_mla, U32)]
    else:
        out += [("attention.head_count_kv", 1, U32), ("attention.key_length", kv + rope, U32),
                ("attention.value_length", kv, U32), ("attention.key_length_mla", k_mla, U32),
                ("attention.value_length_mla", v_mla, U32)]
    out.append(("rope.dimension_count", rope, U32))
    if s["q_lora_rank"] or s["n_layers"] not in _LITE_BLOCKS:     # 0 where the loader would not infer "lite"
        out.append(("attention.q_lora_rank", s["q_lora_rank"], U32))
    out.append(("attention.kv_lora_rank", kv, U32))
    if s["rope_yarn_log_mul"]:
        out.append(("rope.scaling.yarn_log_multiplier", 0.1 * float(s["rope_yarn_log_mul"]), F32))
    return out + moe.metadata(s)


def attention_tensors(s: dict[str, Any], b: str) -> Tensors:
    """One block's MLA attention, names and shapes as deepseek2.cpp creates them."""
    e, nh, kv = s["n_embd"], s["n_head"], s["kv_lora_rank"]
    nope, rope, v = s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["v_head_dim"]
    q_lora = s["q_lora_rank"]
    out: Tensors = [(b + "attn_norm.weight", (e,))]
    if q_lora:
        out += [(b + "attn_q_a_norm.weight", (q_lora,)), (b + "attn_q_a.weight", (e, q_lora)),
                (b + "attn_q_b.weight", (q_lora, nh * (nope + rope)))]
    else:
        out.append((b + "attn_q.weight", (e, nh * (nope + rope))))
    out += [(b + "attn_kv_a_norm.weight", (kv,)), (b + "attn_kv_a_mqa.weight", (e, kv + rope))]
    if s["mla_legacy"]:
        out.append((b + "attn_kv_b.weight", (kv, nh * (nope + v))))
    else:
        out += [(b + "attn_k_b.weight", (nope, kv, nh)), (b + "attn_v_b.weight", (kv, v, nh))]
    return out + [(b + "attn_output.weight", (nh * v, e))]


def tensors(s: dict[str, Any]) -> Tensors:
    e = s["n_embd"]
    out = embeddings(s)
    for il in range(moe.block_count(s)):
        b = f"blk.{il}."
        out += attention_tensors(s, b) + [(b + "ffn_norm.weight", (e,))]
        out += moe.dense_ffn(e, s["n_ff"], b) if il < s["n_dense_lead"] else moe.expert_ffn(s, b)
        if il >= s["n_layers"]:
            out += moe.nextn_tensors(s, b)
    return out + output(s)


LAYOUT = register(Layout(("deepseek2",), normalize, metadata, tensors, FIELDS,
                         source="src/models/deepseek2.cpp; conversion/deepseek.py DeepseekV2Model"))
