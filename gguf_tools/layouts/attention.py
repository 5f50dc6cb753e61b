"""Llama-style decoders: attention + dense or MoE FFN in every layer.

Follows llama.cpp ``src/models/llama.cpp``, ``qwen2.cpp``, ``qwen3.cpp``, ``qwen3moe.cpp`` (load_arch_tensors:
``attn_q/k/v/output``, optional Q/K/V biases and per-head Q/K norms, ``ffn_gate/up/down`` or the 3-D expert
stacks ``ffn_{gate,up,down}_exps`` with the router ``ffn_gate_inp``).
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType as V

from . import Layout, Metadata, Tensors, register

U32, F32 = V.UINT32, V.FLOAT32


def normalize(s: dict[str, Any]) -> None:
    moe = s["arch"].endswith("moe")
    if moe and not (s["n_expert"] and s["expert_ff"] and 0 < s["n_expert_used"] <= s["n_expert"]):
        raise ValueError("an MoE spec needs n_expert, expert_ff and 0 < n_expert_used <= n_expert")
    if not moe and (s["n_expert"] or not s["n_ff"]):
        raise ValueError(f"arch {s['arch']!r} is dense: give n_ff and no n_expert (use qwen3moe for experts)")
    if s["qk_norm"] is None:
        s["qk_norm"] = s["arch"] in ("qwen3", "qwen3moe")
    if s["qkv_bias"] is None:
        s["qkv_bias"] = s["arch"] == "qwen2"


def base_metadata(s: dict[str, Any]) -> Metadata:
    """The keys every decoder writes: sizes, heads, RoPE, norm epsilon, experts."""
    out: Metadata = [(key, value, U32) for key, value in (
        ("block_count", s["n_layers"]), ("context_length", s["context_length"]), ("embedding_length", s["n_embd"]),
        ("feed_forward_length", s["n_ff"]), ("attention.head_count", s["n_head"]),
        ("attention.head_count_kv", s["n_head_kv"]), ("attention.key_length", s["head_dim"]),
        ("attention.value_length", s["head_dim"]), ("rope.dimension_count", s["head_dim"]),
        ("vocab_size", s["vocab_size"]))]
    out += [("rope.freq_base", float(s["rope_freq_base"]), F32),
            ("attention.layer_norm_rms_epsilon", float(s["norm_eps"]), F32)]
    if s["n_expert"]:
        out += [("expert_count", s["n_expert"], U32), ("expert_used_count", s["n_expert_used"], U32),
                ("expert_feed_forward_length", s["expert_ff"], U32)]
    return out


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


LAYOUT = register(Layout(("llama", "qwen2", "qwen3", "qwen3moe"), normalize, base_metadata, tensors,
                         source="src/models/llama.cpp, qwen2.cpp, qwen3.cpp, qwen3moe.cpp"))
