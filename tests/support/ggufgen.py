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


# ---- llama / qwen2 / qwen3 models that llama.cpp loads and tokenizes -------------------

# Fields holding a block's f16 scale(s), by type: random codes + these scales = a valid block.
_SCALE_OFFSETS = {
    GGMLQuantizationType.Q2_K: (80, 82), GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,), GGMLQuantizationType.IQ4_NL: (0,),
}


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """A GPT-2 style vocabulary: the 256 byte symbols, one merge ("Ġ t"), BOS and EOS."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    tokens = [table[b] for b in range(256)] + ["Ġt", "<|bos|>", "<|eos|>"]
    types = [1] * 257 + [3, 3]
    return tokens, types, ["Ġ t"]


def add_byte_level_vocab(w: GGUFWriter, *, add_bos: bool | None = False) -> int:
    """Write byte_level_vocab() (BPE "gpt2" tokenizer, BOS and EOS its last two tokens) into ``w``; ``add_bos``
    None leaves the key out.  Returns the vocabulary size."""
    tokens, types, merges = byte_level_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    return len(tokens)


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], qtype: GGMLQuantizationType,
                  std: float = 0.05) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """Data for GGUFWriter.add_tensor (GGUF shape, ne0 first) in qtype, values of about std.

    Types the gguf package can quantize are quantized from normal values; K-quants
    and IQ4_NL get random codes with their f16 scales set so values have about std.
    """
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    values = (rng.standard_normal(shape[::-1]) * std).astype(np.float32)
    if qtype == GGMLQuantizationType.F32 or len(shape) == 1:
        return values, None
    if qtype not in _SCALE_OFFSETS:
        return quantize(values, qtype), qtype
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    rows = values.reshape(-1, shape[0]).shape[0]
    raw = rng.integers(0, 256, size=(rows, shape[0] // block_values, block_bytes), dtype=np.uint8)
    one = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype]:
        raw[..., off:off + 2] = one
    got = float(dequantize(raw.reshape(rows, -1), qtype).std()) or 1.0
    scale = np.frombuffer(np.float16(std / got).tobytes(), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype]:
        raw[..., off:off + 2] = scale
    return raw.reshape(*shape[::-1][:-1], -1), qtype


def write_tiny_model(
    path: str | Path,
    *,
    arch: str = "llama",
    n_layers: int = 2,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 512,
    ctx: int = 512,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    output_qtype: GGMLQuantizationType | None = None,
    tied: bool = False,
    rope_base: float = 10000.0,
    rope_freqs: bool = False,
    overrides: dict[str, GGMLQuantizationType] | None = None,
    extra_kv: dict | None = None,
    seed: int = 0,
    n_extra_tokens: int = 0,
    added_tokens: tuple[tuple[str, int], ...] = (),
) -> Path:
    """A random-weight llama / qwen2 / qwen3 model that llama.cpp loads and tokenizes.

    Byte-level BPE vocabulary (259 tokens, see byte_level_vocab), so any text
    tokenizes.  qwen2 gets Q/K/V biases, qwen3 per-head Q/K norms; ``rope_freqs``
    adds Llama 3's per-frequency factors.  Matrices use qtype (row length n_embd
    or n_ff: keep them multiples of 256 for K-quants), the output matrix
    output_qtype (default qtype) unless tied; ``overrides`` maps a name fragment
    (``"ffn_down"``, ``"token_embd"``) to the type of the matrices whose names contain it.
    ``n_extra_tokens`` appends that many control tokens (to choose the vocabulary size); ``added_tokens``
    appends (text, token type) pairs after them (3: control, 4: user-defined, as in ``<tool_call>``).
    """
    rng = np.random.default_rng(seed)
    path = Path(path)
    head_dim = n_embd // n_head
    tokens, types, merges = byte_level_vocab()
    n_base = len(tokens)
    tokens += [f"<|extra_{i}|>" for i in range(n_extra_tokens)]
    types += [3] * n_extra_tokens
    tokens += [t for t, _ in added_tokens]
    types += [k for _, k in added_tokens]
    n_vocab = len(tokens)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layers)
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6 if arch.startswith("qwen") else 1e-5)
    w.add_rope_freq_base(rope_base)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(n_base - 2)
    w.add_eos_token_id(n_base - 1)
    w.add_add_bos_token(False)
    for key, value in (extra_kv or {}).items():
        w.add_key_value(key, value[0], value[1]) if isinstance(value, tuple) else w.add_string(key, value)

    def add(name: str, shape: tuple[int, ...], qt=qtype, std: float = 0.05) -> None:
        qt = next((t for frag, t in (overrides or {}).items() if frag in name), qt)
        data, raw = random_tensor(rng, shape, qt, std)
        w.add_tensor(name, data, raw_dtype=raw) if raw is not None else w.add_tensor(name, data)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    add("token_embd.weight", (n_embd, n_vocab), std=1.0)
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, head_dim // 2).astype(np.float32))
    for il in range(n_layers):
        p = f"blk.{il}."
        norm(p + "attn_norm.weight", n_embd)
        add(p + "attn_q.weight", (n_embd, n_head * head_dim))
        add(p + "attn_k.weight", (n_embd, n_head_kv * head_dim))
        add(p + "attn_v.weight", (n_embd, n_head_kv * head_dim))
        if arch == "qwen2":
            for x, n in (("q", n_head), ("k", n_head_kv), ("v", n_head_kv)):
                w.add_tensor(p + f"attn_{x}.bias", (0.1 * rng.standard_normal(n * head_dim)).astype(np.float32))
        if arch == "qwen3":
            norm(p + "attn_q_norm.weight", head_dim)
            norm(p + "attn_k_norm.weight", head_dim)
        add(p + "attn_output.weight", (n_head * head_dim, n_embd))
        norm(p + "ffn_norm.weight", n_embd)
        add(p + "ffn_gate.weight", (n_embd, n_ff))
        add(p + "ffn_up.weight", (n_embd, n_ff))
        add(p + "ffn_down.weight", (n_ff, n_embd))
    norm("output_norm.weight", n_embd)
    if not tied:
        add("output.weight", (n_embd, n_vocab), output_qtype or qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


NOT_A_MODEL_KINDS = ("vocab", "vocab-untyped", "adapter", "mmproj", "partial", "no-tensors")


def write_not_a_model(path: str | Path, kind: str) -> Path:
    """A valid GGUF that is not a complete model: ``kind`` from NOT_A_MODEL_KINDS."""
    path = Path(path)
    arch = "clip" if kind == "mmproj" else "llama"
    w = GGUFWriter(str(path), arch)
    if kind in ("vocab", "adapter", "mmproj"):
        w.add_type(kind)
    w.add_block_count(2)
    if kind in ("vocab", "vocab-untyped", "no-tensors"):       # the whole model's metadata, no tensors
        w.add_context_length(512)
        w.add_embedding_length(64)
        w.add_feed_forward_length(128)
        w.add_head_count(4)
        w.add_head_count_kv(2)
    if kind in ("vocab", "vocab-untyped"):
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(256)])
        w.add_token_types([1] * 256)
    tensors = {"adapter": [("blk.0.attn_q.weight.lora_a", (64, 8)), ("blk.0.attn_q.weight.lora_b", (8, 64))],
               "mmproj": [("v.patch_embd.weight", (16, 16))],
               "partial": [("blk.0.attn_q.weight", (64, 64)), ("blk.1.attn_q.weight", (64, 64))]}.get(kind, [])
    for name, shape in tensors:
        w.add_tensor(name, np.zeros(shape[::-1], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# SSM parameters whose sign or scale matters for a stable recurrence (the converter stores A = -exp(A_log))
_SSM_INIT = {
    "ssm_a": lambda noise: -(0.5 + np.abs(noise)),   # negative decay
    "ssm_d": lambda noise: 1.0 + noise,               # skip connection near 1
}
_KEPT_F32 = ("ssm_conv1d", "shortconv.conv")          # llama-quantize never quantizes the small conv kernels


def write_tiny_arch(path: str | Path, spec: dict, *, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                    seed: int = 0, extra_kv: dict | None = None) -> Path:
    """A random-weight model of any architecture ``gguf_tools.layouts`` knows, that llama.cpp loads and decodes.

    ``spec`` is a skeleton spec dict (``gguf_tools.skeleton.SPEC_FIELDS``) with tiny sizes; ``vocab_size`` is
    replaced by the byte-level vocabulary's (259 tokens), so any text tokenizes.  Metadata and tensor names and
    shapes are the layout's (what llama.cpp's converter writes); 1-D tensors and norms are F32 near 1 (norms) or
    small (biases, which stay F32 whatever their rank, as the converter writes them), SSM A negative and D near 1,
    conv kernels F32, the other matrices random in ``qtype`` (F32 where the type's blocks do not divide a row).
    """
    from gguf import GGML_QUANT_SIZES

    from gguf_tools.layouts import layout_for
    from gguf_tools.skeleton import normalize_spec

    tokens, types, merges = byte_level_vocab()
    s = normalize_spec({**spec, "vocab_size": len(tokens)})
    layout = layout_for(s["arch"])
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = GGUFWriter(str(path), s["arch"])
    w.add_name(s["name"] or f"tiny-{s['arch']}")
    a = s["arch"] + "."
    for key, value, vtype in layout.metadata(s):
        w.add_key_value(key if key.startswith("general.") else a + key, value, vtype)
    add_byte_level_vocab(w)
    for key, value in (extra_kv or {}).items():
        w.add_key_value(key, value[0], value[1]) if isinstance(value, tuple) else w.add_string(key, value)
    for name, shape in layout.tensors(s):
        n = int(np.prod(shape))
        init = next((f for suffix, f in _SSM_INIT.items() if name.endswith(suffix)), None)
        if init is not None or len(shape) == 1 or "norm" in name or not name.endswith(".weight"):   # biases: F32
            noise = 0.1 * rng.standard_normal(n)
            data = init(noise) if init is not None else (1.0 if "norm" in name else 0.0) + noise
            w.add_tensor(name, data.astype(np.float32).reshape(shape[::-1]))
            continue
        small = shape[0] % GGML_QUANT_SIZES[qtype][0] or any(k in name for k in _KEPT_F32)
        qt = GGMLQuantizationType.F32 if small else qtype
        std = 1.0 if name.startswith("token_embd") else 0.05
        data, raw = random_tensor(rng, shape, qt, std)
        w.add_tensor(name, data, raw_dtype=raw) if raw is not None else w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

