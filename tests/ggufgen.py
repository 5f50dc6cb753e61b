"""Tiny GGUF files for tests, written with the `gguf` package's GGUFWriter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize


def write_tiny_llama(
    path: str | Path,
    *,
    arch: str = "llama",
    n_layers: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 256,
    ctx: int = 512,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    seed: int = 0,
    extra_kv: dict | None = None,
    tokenizer: bool = True,
) -> Path:
    """A random-weight llama-style model (real shapes, real tensor names)."""
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layers)
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(n_vocab)])
        w.add_token_types([1] * n_vocab)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    for key, value in (extra_kv or {}).items():
        w.add_key_value(key, value[0], value[1]) if isinstance(value, tuple) else w.add_string(key, value)
    head_dim = n_embd // n_head

    def add(name: str, shape: tuple[int, ...], qt=qtype):
        data = (rng.standard_normal(shape[::-1]) * 0.05).astype(np.float32)
        if qt in (GGMLQuantizationType.F32,) or len(shape) == 1:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, quantize(data, qt), raw_dtype=qt)

    add("token_embd.weight", (n_embd, n_vocab))
    for il in range(n_layers):
        add(f"blk.{il}.attn_norm.weight", (n_embd,))
        add(f"blk.{il}.attn_q.weight", (n_embd, n_head * head_dim))
        add(f"blk.{il}.attn_k.weight", (n_embd, n_head_kv * head_dim))
        add(f"blk.{il}.attn_v.weight", (n_embd, n_head_kv * head_dim))
        add(f"blk.{il}.attn_output.weight", (n_head * head_dim, n_embd))
        add(f"blk.{il}.ffn_norm.weight", (n_embd,))
        add(f"blk.{il}.ffn_gate.weight", (n_embd, n_ff))
        add(f"blk.{il}.ffn_up.weight", (n_embd, n_ff))
        add(f"blk.{il}.ffn_down.weight", (n_ff, n_embd))
    add("output_norm.weight", (n_embd,))
    add("output.weight", (n_embd, n_vocab))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
