"""Multi-head latent attention: ``deepseek2`` (DeepSeek-V2/V2-Lite/V3/R1, Kimi-K2 and the GLM/GigaChat files that
reuse the architecture).

llama.cpp ``src/models/deepseek2.cpp`` (load_arch_hparams, load_arch_tensors) and ``llama-kv-cache.cpp``:

* the MLA layout (``attention.key_length_mla`` and ``value_length_mla`` set, ``attn_k_b``/``attn_v_b`` split):
  ``head_count_kv`` is 1 and ``key_length`` is kv_lora_rank + rope dims, so a cell holds one latent of
  (kv_lora_rank + n_rot) values in the K tensor and the cache has no V tensor at all (``has_v = !is_mla``);
* the legacy layout (an unsplit ``attn_kv_b``): plain multi-head K and V of ``key_length`` / ``value_length``
  per head, like any attention layer;
* queries: ``attn_q`` (V2-Lite, no q_lora_rank) or ``attn_q_a`` → ``attn_q_b``, both of n_head × the real K head
  (nope + rope); ``attn_kv_a_mqa`` outputs kv_lora_rank + n_rot.
"""

from __future__ import annotations

from gguf_tools import GGUFHeader

from . import MLA, ArchFacts, Base, Err, check_out, get_int
from .attention import check_heads, kv_dims

ARCHS = ("deepseek2",)
SOURCE = "src/models/deepseek2.cpp, src/llama-kv-cache.cpp (has_v = !is_mla)"


def derive(h: GGUFHeader, b: Base, err: Err) -> ArchFacts:
    check_heads(b, err)
    k_mla = get_int(h, b.key("attention.key_length_mla"), err, 0)
    v_mla = get_int(h, b.key("attention.value_length_mla"), err, 0)
    kv_rank = get_int(h, b.key("attention.kv_lora_rank"), err, 0)
    q_rank = get_int(h, b.key("attention.q_lora_rank"), err, 0)
    n_rot = get_int(h, b.key("rope.dimension_count"), err, b.head_dim_k)
    is_mla = bool(k_mla and v_mla)
    temperature = bool(h.kv.get(b.key("attention.temperature_scale")))   # deepseek2.cpp build_inp_attn_scale
    head_k = k_mla if is_mla else b.head_dim_k
    head_v = v_mla if is_mla else b.head_dim_v
    key = b.key("attention.key_length_mla" if is_mla else "attention.key_length")
    for il in range(b.n_layers):
        hq = b.n_head[il]
        for name in ("attn_q", "attn_q_b"):
            check_out(h, f"blk.{il}.{name}.weight", hq * head_k, f"{hq} × {head_k}", err, key)
        if kv_rank:
            check_out(h, f"blk.{il}.attn_kv_a_mqa.weight", kv_rank + n_rot, f"{kv_rank} + {n_rot}", err,
                      b.key("attention.kv_lora_rank"))
    if is_mla:
        if b.head_dim_k != kv_rank + n_rot:
            raise err(b.key("attention.key_length"),
                      f"{b.key('attention.key_length')} is {b.head_dim_k}; an MLA file caches kv_lora_rank "
                      f"{kv_rank} + rope {n_rot}")
        dims = tuple((b.n_head_kv[il] * b.head_dim_k, 0) for il in range(b.n_layers))
    else:
        dims = kv_dims(b)
    return ArchFacts("mla" if is_mla else "mla (legacy kv_b layout)", dims, (False,) * b.n_layers,
                     swa_kind="standard" if b.sliding_window else None, sliding_window=b.sliding_window,
                     mla=MLA(kv_rank, q_rank, head_k, head_v, n_rot, temperature), source=SOURCE)
