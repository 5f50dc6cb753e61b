"""Llama-style decoders: full attention + dense or MoE FFN in every layer.

Follows llama.cpp ``src/models/llama.cpp``, ``qwen2.cpp``, ``qwen3.cpp``, ``qwen3moe.cpp`` (load_arch_tensors:
``attn_q/k/v/output``, optional Q/K/V biases and per-head Q/K norms, ``ffn_gate/up/down`` or the 3-D expert
stacks ``ffn_{gate,up,down}_exps`` with the router ``ffn_gate_inp``), and ``glm4-moe.cpp`` (GLM-4.5: leading
dense blocks, shared expert, ``exp_probs_b``, partial RoPE, Q/K/V biases, ``post_attention_norm`` in place of
``ffn_norm``, and the NextN block the converter appends, ``conversion/glm.py`` Glm4MoeModel).
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType as V

from . import Fields, Layout, Metadata, Tensors, moe, register

U32, F32, STR = V.UINT32, V.FLOAT32, V.STRING

# rope.scaling.type values llama.cpp reads (src/llama-model.cpp load_hparams: llama_rope_scaling_type_from_string)
ROPE_SCALING = ("linear", "yarn")

FIELDS: Fields = {
    "rope_dim": (int, 0, "rotary dimensions per head (default head_dim; GLM-4.5: head_dim / 2)"),
    "rope_scaling": (str, "", f"rope.scaling.type as the converter writes it: {', '.join(ROPE_SCALING)}"),
    "rope_scaling_factor": ((int, float), 0.0, "rope.scaling.factor"),
    "rope_scaling_orig_ctx": (int, 0, "rope.scaling.original_context_length (YaRN)"),
    "rope_yarn_beta_fast": ((int, float), 0.0, "rope.scaling.yarn_beta_fast (YaRN beta_fast; 0: not written)"),
    "rope_yarn_beta_slow": ((int, float), 0.0, "rope.scaling.yarn_beta_slow (YaRN beta_slow; 0: not written)"),
}


def normalize(s: dict[str, Any]) -> None:
    experts = s["arch"].endswith("moe")
    if experts and not (s["n_expert"] and s["expert_ff"] and 0 < s["n_expert_used"] <= s["n_expert"]):
        raise ValueError("an MoE spec needs n_expert, expert_ff and 0 < n_expert_used <= n_expert")
    if not experts and (s["n_expert"] or not s["n_ff"]):
        raise ValueError(f"arch {s['arch']!r} is dense: give n_ff and no n_expert (use qwen3moe for experts)")
    if s["qk_norm"] is None:
        s["qk_norm"] = s["arch"] in ("qwen3", "qwen3moe")
    if s["qkv_bias"] is None:
        s["qkv_bias"] = s["arch"] == "qwen2"
    check_rope(s)


def check_rope(s: dict[str, Any]) -> None:
    """Check the RoPE fields and default rope_dim to head_dim (ValueError naming the field)."""
    if s["rope_scaling"] and s["rope_scaling"] not in ROPE_SCALING:
        raise ValueError(f"spec field 'rope_scaling' is {s['rope_scaling']!r}; choose one of {', '.join(ROPE_SCALING)}")
    if s["rope_scaling"] and not s["rope_scaling_factor"]:
        raise ValueError("rope_scaling needs rope_scaling_factor")
    s["rope_dim"] = s["rope_dim"] or s["head_dim"]


def core_metadata(s: dict[str, Any]) -> Metadata:
    """The keys every decoder writes: sizes, RoPE base and scaling, norm epsilon, experts.

    RoPE scaling as ``conversion/base.py`` TextModel.set_gguf_parameters writes it from ``rope_scaling``.
    """
    out: Metadata = [(key, value, U32) for key, value in (
        ("block_count", moe.block_count(s)), ("context_length", s["context_length"]),
        ("embedding_length", s["n_embd"]), ("feed_forward_length", s["n_ff"]),
        ("attention.head_count", s["n_head"]), ("vocab_size", s["vocab_size"]))]
    out += [("rope.freq_base", float(s["rope_freq_base"]), F32),
            ("attention.layer_norm_rms_epsilon", float(s["norm_eps"]), F32)]
    if s["rope_scaling"]:
        out += [("rope.scaling.type", s["rope_scaling"], STR),
                ("rope.scaling.factor", float(s["rope_scaling_factor"]), F32)]
        if s["rope_scaling_orig_ctx"]:
            out.append(("rope.scaling.original_context_length", s["rope_scaling_orig_ctx"], U32))
        out += [(f"rope.scaling.yarn_{key}", float(s[f"rope_yarn_{key}"]), F32)
                for key in ("beta_fast", "beta_slow") if s[f"rope_yarn_{key}"]]
    if s["n_expert"]:
        out += [("expert_count", s["n_expert"], U32), ("expert_used_count", s["n_expert_used"], U32),
                ("expert_feed_forward_length", s["expert_ff"], U32)]
    return out


def head_metadata(s: dict[str, Any]) -> Metadata:
    """KV heads, head sizes and rotary dimensions of plain (grouped-query) attention."""
    return [("attention.head_count_kv", s["n_head_kv"], U32), ("attention.key_length", s["head_dim"], U32),
            ("attention.value_length", s["head_dim"], U32), ("rope.dimension_count", s["rope_dim"] or s["head_dim"], U32)]


def base_metadata(s: dict[str, Any]) -> Metadata:
    """A llama-style decoder's keys."""
    return core_metadata(s) + head_metadata(s)


def attention_tensors(s: dict[str, Any], b: str, n_head_kv: int | None = None) -> Tensors:
    """One layer's attention block (names prefixed by ``b``)."""
    e, hd = s["n_embd"], s["head_dim"]
    q, kv = s["n_head"] * hd, (s["n_head_kv"] if n_head_kv is None else n_head_kv) * hd
    out: Tensors = [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (e, q)), (b + "attn_k.weight", (e, kv)),
                    (b + "attn_v.weight", (e, kv)), (b + "attn_output.weight", (q, e))]
    if s["qkv_bias"]:
        out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
    if s["qk_norm"]:
        out += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
    return out


def ffn_tensors(s: dict[str, Any], b: str) -> Tensors:
    """One layer's FFN: dense, or the routed experts."""
    e = s["n_embd"]
    out: Tensors = [(b + "ffn_norm.weight", (e,))]
    if s["n_expert"]:
        ne, ff = s["n_expert"], s["expert_ff"]
        out += [(b + "ffn_gate_inp.weight", (e, ne)), (b + "ffn_gate_exps.weight", (e, ff, ne)),
                (b + "ffn_up_exps.weight", (e, ff, ne)), (b + "ffn_down_exps.weight", (ff, e, ne))]
    else:
        ff = s["n_ff"]
        out += [(b + "ffn_gate.weight", (e, ff)), (b + "ffn_up.weight", (e, ff)), (b + "ffn_down.weight", (ff, e))]
    return out


def embeddings(s: dict[str, Any]) -> Tensors:
    out: Tensors = [("token_embd.weight", (s["n_embd"], s["vocab_size"]))]
    if s["rope_freqs"]:
        out.append(("rope_freqs.weight", (s["head_dim"] // 2,)))
    return out


def output(s: dict[str, Any]) -> Tensors:
    out: Tensors = [("output_norm.weight", (s["n_embd"],))]
    if not s["tied_embeddings"]:
        out.append(("output.weight", (s["n_embd"], s["vocab_size"])))
    return out


def tensors(s: dict[str, Any]) -> Tensors:
    """(name, shape) of every tensor, GGUF order (row length first), in llama.cpp naming."""
    out = embeddings(s)
    for il in range(s["n_layers"]):
        b = f"blk.{il}."
        out += attention_tensors(s, b) + ffn_tensors(s, b)
    return out + output(s)


def glm4moe_normalize(s: dict[str, Any]) -> None:
    if not (s["n_expert"] and s["expert_ff"] and 0 < s["n_expert_used"] <= s["n_expert"] and s["n_ff"]):
        raise ValueError("glm4moe needs n_expert, expert_ff, 0 < n_expert_used <= n_expert and n_ff (dense blocks)")
    s["qk_norm"] = bool(s["qk_norm"])                       # GLM-4.5 (355B) has them, GLM-4.5-Air not
    s["qkv_bias"] = True if s["qkv_bias"] is None else s["qkv_bias"]
    s["expert_probs_bias"] = True                           # glm4-moe.cpp: exp_probs_b is required
    s["rope_dim"] = s["rope_dim"] or s["head_dim"] // 2     # glm.py: partial_rotary_factor, default 0.5
    check_rope(s)
    moe.normalize(s)


def glm4moe_metadata(s: dict[str, Any]) -> Metadata:
    return base_metadata(s) + moe.metadata(s)


def glm4moe_tensors(s: dict[str, Any]) -> Tensors:
    """GLM-4.5: blocks 0..n_dense_lead-1 dense, the rest MoE; the NextN blocks (full MoE blocks + nextn.*) last."""
    e = s["n_embd"]
    out = embeddings(s)
    for il in range(moe.block_count(s)):
        b = f"blk.{il}."
        out += attention_tensors(s, b) + [(b + "post_attention_norm.weight", (e,))]
        out += moe.dense_ffn(e, s["n_ff"], b) if il < s["n_dense_lead"] else moe.expert_ffn(s, b)
        if il >= s["n_layers"]:
            out += moe.nextn_tensors(s, b)
    return out + output(s)


LAYOUT = register(Layout(("llama", "qwen2", "qwen3", "qwen3moe"), normalize, base_metadata, tensors, FIELDS,
                         source="src/models/llama.cpp, qwen2.cpp, qwen3.cpp, qwen3moe.cpp"))
GLM4MOE = register(Layout(("glm4moe",), glm4moe_normalize, glm4moe_metadata, glm4moe_tensors, moe.FIELDS,
                          source="src/models/glm4-moe.cpp; conversion/glm.py Glm4MoeModel"))
