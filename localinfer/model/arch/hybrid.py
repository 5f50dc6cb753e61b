"""Recurrent and hybrid recurrent + attention models.

llama.cpp ``src/llama-model.cpp`` ``create_memory`` (a ``llama_memory_hybrid``: an attention cache on the
layers ``filter_attn`` keeps and a ``llama_memory_recurrent`` on the layers ``filter_recr`` keeps; a pure
recurrent arch gets the recurrent memory alone on every layer), ``src/llama-memory-recurrent.cpp`` (per
recurrent layer an r tensor of n_embd_r × rows and an s tensor of n_embd_s × rows, F32, rows =
max(1, n_seq_max) × (1 + n_rs_seq)), ``src/llama-hparams.cpp`` (``n_embd_r``, ``n_embd_s``) and each
architecture's ``load_arch_hparams`` for which layers are recurrent:

* qwen35, qwen35moe, qwen3next: ``attention.recurrent_layers`` when written, else every layer but each
  ``full_attention_interval``-th (default 4); the attention layers' query is gated: attn_q is 2 × heads × head;
* granitehybrid, lfm2, lfm2moe: a layer is recurrent when its ``head_count_kv`` is 0;
* nemotron_h, nemotron_h_moe: recurrent when both ``head_count_kv`` and ``feed_forward_length`` are 0; attention
  when it has KV heads and no FFN; the rest are FFN-only layers holding neither;
* mamba, mamba2, rwkv6, rwkv7: every layer recurrent, no attention.
"""

from __future__ import annotations

from gguf_tools import GGUFHeader

from . import ArchFacts, Base, Err, get_int, per_layer_flags
from .attention import check_heads, check_qkv, kv_dims

GATED_Q = ("qwen35", "qwen35moe", "qwen3next")
BY_KV_HEADS = ("granitehybrid", "lfm2", "lfm2moe")
NEMOTRON = ("nemotron_h", "nemotron_h_moe")
PURE = ("mamba", "mamba2", "rwkv6", "rwkv7")
ARCHS = GATED_Q + BY_KV_HEADS + NEMOTRON + PURE
SOURCE = "src/llama-model.cpp create_memory, src/llama-memory-recurrent.cpp, src/llama-hparams.cpp n_embd_r/n_embd_s"
DEFAULT_FULL_ATTENTION_INTERVAL = 4     # src/models/qwen35.cpp, qwen3next.cpp
DEFAULT_TOKEN_SHIFT = 2                 # llama-hparams.h token_shift_count


def state_dims(h: GGUFHeader, b: Base, err: Err) -> tuple[int, int]:
    """(n_embd_r, n_embd_s): llama-hparams.cpp's conv/shift row and state row of one sequence in one layer."""
    g = lambda name, default=0: get_int(h, b.key(name), err, default)  # noqa: E731
    wkv = g("wkv.head_size")
    if wkv:
        return g("token_shift_count", DEFAULT_TOKEN_SHIFT) * b.n_embd, b.n_embd * wkv
    d_state, d_inner, d_conv, n_group = g("ssm.state_size"), g("ssm.inner_size"), g("ssm.conv_kernel"), \
        g("ssm.group_count")
    l_cache = g("shortconv.l_cache")
    if l_cache:
        r = b.n_embd * (l_cache - 1)
    else:
        r = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    return r, d_state * d_inner


def layer_kinds(h: GGUFHeader, b: Base, err: Err) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """(recurrent, attention) per trunk layer."""
    n = b.n_layers
    if b.arch in PURE:
        return (True,) * n, (False,) * n
    if b.arch in GATED_Q:
        n_all = n + (h.kv.get(b.key("nextn_predict_layers")) or 0)
        recr = per_layer_flags(h, b.key("attention.recurrent_layers"), n_all, n, err)
        if recr is None:
            every = get_int(h, b.key("full_attention_interval"), err, DEFAULT_FULL_ATTENTION_INTERVAL) or 1
            recr = tuple((il + 1) % every != 0 for il in range(n))
        return recr, tuple(not r for r in recr)
    if b.arch in NEMOTRON:
        recr = tuple(b.n_head_kv[il] == 0 and b.n_ff[il] == 0 for il in range(n))
        return recr, tuple(not recr[il] and b.n_ff[il] == 0 for il in range(n))
    recr = tuple(b.n_head_kv[il] == 0 for il in range(n))
    return recr, tuple(not r for r in recr)


def derive(h: GGUFHeader, b: Base, err: Err) -> ArchFacts:
    recr, attn = layer_kinds(h, b, err)
    check_heads(b, err, kv_free=lambda il: not attn[il])
    for il in range(b.n_layers):
        if attn[il]:
            check_qkv(h, b, err, il, q_factor=2 if b.arch in GATED_Q else 1)
    window = b.sliding_window if b.arch in BY_KV_HEADS else None     # lfm2: the attention layers slide
    return ArchFacts("hybrid" if any(attn) else "recurrent", kv_dims(b, lambda il: attn[il]), recr,
                     rs_dims=state_dims(h, b, err), swa_kind="standard" if window else None, sliding_window=window,
                     swa_layers=attn if window else (False,) * b.n_layers, source=SOURCE)
