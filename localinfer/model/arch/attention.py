"""Attention-only decoders: every trunk layer holds K and V of ``head_count_kv`` heads.

llama.cpp ``llama-kv-cache.cpp`` (the constructor: a K tensor of n_embd_k_gqa(il) × cells and a V tensor of
n_embd_v_gqa(il) × cells per layer, ``llama-hparams.cpp``: n_embd_k_gqa = n_embd_head_k × n_head_kv(il)),
``llama-kv-cache-iswa.cpp`` for sliding-window layers (``set_swa_pattern``: layer il slides unless
il % n < n − 1 fails), and ``src/models/llama4.cpp`` for Llama 4's chunked attention: three chunked layers in
four, a chunk of 8192 whatever the file says unless its ``attention.sliding_window`` is 0.  NextN/MTP layers
(GLM-4.5) are not trunk layers: llama.cpp skips their tensors (``TENSOR_SKIP`` without ``load_mtp``) and
filters them out of the cache (``create_memory``), and so does the spec.
"""

from __future__ import annotations

from gguf_tools import GGUFHeader

from . import ArchFacts, Base, Err, check_out

ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "gemma2", "gemma3", "mistral3", "phi3", "gpt-oss",
         "glm4moe", "llama4")
SOURCE = "src/llama-kv-cache.cpp, src/llama-kv-cache-iswa.cpp"
LLAMA4_CHUNK = 8192          # src/models/llama4.cpp: hparams.n_swa = 8192 for chunked attention
LLAMA4_PERIOD = 4            # load_swa_pattern(ml, 4): 3 chunked - 1 full


def check_heads(b: Base, err: Err, *, kv_free=lambda il: False) -> None:
    """Query and KV head counts agree per layer; ``kv_free(il)``: a layer whose KV heads may be 0."""
    key = b.key("attention.head_count_kv")
    for il in range(b.n_layers):
        hq, hkv = b.n_head[il], b.n_head_kv[il]
        if hq == 0 and hkv == 0 or (hkv == 0 and kv_free(il)):
            continue
        if hq == 0 or hkv == 0:
            raise err(key, f"layer {il} has {hq} query heads and {hkv} KV heads")
        if hq % hkv:
            raise err(key, f"layer {il}: head_count {hq} is not divisible by head_count_kv {hkv}")


def check_qkv(h: GGUFHeader, b: Base, err: Err, il: int, q_factor: int = 1) -> None:
    """attn_q/k/v outputs of layer il as llama.cpp's create_tensor_qkv asks (q_factor 2: a gated query)."""
    key = b.key("attention.head_count")
    hq, hkv = b.n_head[il], b.n_head_kv[il]
    check_out(h, f"blk.{il}.attn_q.weight", q_factor * hq * b.head_dim_k,
              f"{q_factor} × {hq} × {b.head_dim_k}" if q_factor > 1 else f"{hq} × {b.head_dim_k}", err, key)
    check_out(h, f"blk.{il}.attn_k.weight", hkv * b.head_dim_k, f"{hkv} × {b.head_dim_k}", err, key)
    check_out(h, f"blk.{il}.attn_v.weight", hkv * b.head_dim_v, f"{hkv} × {b.head_dim_v}", err, key)


def kv_dims(b: Base, holds=lambda il: True) -> tuple[tuple[int, int], ...]:
    return tuple((b.n_head_kv[il] * b.head_dim_k, b.n_head_kv[il] * b.head_dim_v) if holds(il) else (0, 0)
                 for il in range(b.n_layers))


def derive(h: GGUFHeader, b: Base, err: Err) -> ArchFacts:
    check_heads(b, err)
    for il in range(b.n_layers):
        check_qkv(h, b, err, il)
    window, layers, kind = b.sliding_window, None, "standard" if b.sliding_window else None
    if b.arch == "llama4" and h.kv.get(b.key("attention.sliding_window")) != 0:
        window, kind = LLAMA4_CHUNK, "chunked"
        pattern = h.kv.get(b.key("attention.sliding_window_pattern"))
        if isinstance(pattern, list):
            layers = tuple(bool(x) for x in pattern[:b.n_layers])
        else:
            n = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else LLAMA4_PERIOD
            layers = tuple(n == 0 or il % n < n - 1 for il in range(b.n_layers))
    return ArchFacts("attention", kv_dims(b), (False,) * b.n_layers, swa_kind=kind if window else None,
                     sliding_window=window, swa_layers=layers,
                     source=SOURCE + (", src/models/llama4.cpp" if kind == "chunked" else ""))
