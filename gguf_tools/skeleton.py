"""Skeleton GGUFs: the real header of a model you have not downloaded.

A skeleton is written with the ``gguf`` package's GGUFWriter (header, metadata,
tensor infos) and then extended to its true size, so the data section is a
sparse hole: ``ls -l`` shows the real size, ``du`` shows a few KiB.  Our reader,
``gguf.GGUFReader`` and llama.cpp all open it; llama.cpp loads it without a
vocabulary because ``tokenizer.ggml.model`` is ``"none"`` and
``{arch}.vocab_size`` gives the vocabulary size.

What is exact: tensor names, shapes, per-tensor types (llama-quantize's rules,
``gguf_tools.mix``) and so every tensor byte.  What is not: the header, which
in a real file also holds the tokenizer (≈6 MB for a 152K-token vocabulary);
a skeleton's header is a few KiB.

Float types (``bf16``, ``f16``, ``f32``) describe the checkpoint as published:
every tensor in that type, 1-D norms included (llama.cpp's converter would
store the norms as F32, a few hundred KiB more), except biases, attention sinks
and ``rope_freqs``, which are F32 in every file, and what a preset's overrides
say the checkpoint ships quantized (gpt-oss's MXFP4 experts).
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, GGUFWriter

from .layouts import all_fields, archs, layout_for
from .layouts.moe import block_count
from .mix import FTYPES, ModelShape, choose_types, parse_ftype
from .presets import get_preset
from .quants import tensor_bytes

ALIGNMENT = 32
ARCHS = archs()

# field -> (python type, default or None when required, meaning)
SPEC_FIELDS: dict[str, tuple[type | tuple, Any, str]] = {
    "arch": (str, None, f"llama.cpp architecture: {', '.join(ARCHS)}"),
    "name": (str, "", "general.name"),
    "n_layers": (int, None, "transformer blocks"),
    "n_embd": (int, None, "hidden size"),
    "n_head": (int, None, "query heads"),
    "n_head_kv": (int, 0, "KV heads (default: n_head)"),
    "head_dim": (int, 0, "per-head dimension (default: n_embd / n_head)"),
    "n_ff": (int, 0, "dense FFN size (required unless n_expert > 0)"),
    "vocab_size": (int, None, "vocabulary size"),
    "context_length": (int, 4096, "training context"),
    "rope_freq_base": ((int, float), 10000.0, "RoPE base"),
    "norm_eps": ((int, float), 1e-5, "RMSNorm epsilon"),
    "tied_embeddings": (bool, False, "output projection shares token_embd"),
    "qk_norm": (bool, None, "per-head Q/K RMSNorm (default: qwen3/qwen3moe)"),
    "qkv_bias": (bool, None, "Q/K/V biases (default: qwen2)"),
    "rope_freqs": (bool, False, "write a rope_freqs tensor (Llama 3.1 rope scaling)"),
    "n_expert": (int, 0, "routed experts (MoE)"),
    "n_expert_used": (int, 0, "experts per token"),
    "expert_ff": (int, 0, "per-expert FFN size"),
    "type": (str, "bf16", f"file type: {', '.join(FTYPES)}"),
    "types": (list, [], "types the preset is meant for (informational)"),
    "overrides": (list, [], "[[regex, type], ...] per-tensor type overrides (like llama-quantize --tensor-type)"),
    "source": (str, "", "where the numbers come from"),
    "preset": (str, "", "preset name"),
    **all_fields(),
}


MAX_SPEC_BYTES = 1 << 20


def load_spec_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a TOML or JSON file of SPEC_FIELDS; ValueError on a malformed file."""
    p = Path(path)
    try:
        if not p.is_file():  # a FIFO or a device (/dev/zero) would block or never end
            raise ValueError(f"spec file {p} is not a regular file")
        with open(p, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read spec file {p}: {exc.strerror or exc}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise ValueError(f"spec file {p} is over {MAX_SPEC_BYTES >> 10} KiB; a spec is a few fields")
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(raw)
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"spec file {p} is not valid {'JSON' if p.suffix.lower() == '.json' else 'TOML'}: "
                         f"{str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"spec file {p} must hold a table of fields")
    return data


# upper bounds far above any real model, so a typo cannot plan a billion tensors or an exabyte file
SPEC_LIMITS = {"n_layers": 10_000, "n_embd": 1 << 20, "n_head": 1 << 12, "n_head_kv": 1 << 12, "head_dim": 1 << 14,
               "n_ff": 1 << 22, "vocab_size": 1 << 24, "context_length": 1 << 30, "n_expert": 1 << 14,
               "n_expert_used": 1 << 14, "expert_ff": 1 << 22,
               # the family fields (gguf_tools.layouts: mla, moe, attention, interleaved)
               "q_lora_rank": 1 << 16, "kv_lora_rank": 1 << 16, "qk_nope_head_dim": 1 << 14,
               "qk_rope_head_dim": 1 << 14, "v_head_dim": 1 << 14, "rope_dim": 1 << 14, "n_dense_lead": 10_000,
               "n_expert_shared": 1 << 10, "n_expert_groups": 1 << 14, "n_group_used": 1 << 14, "nextn_layers": 16,
               "sliding_window": 1 << 30, "moe_every": 10_000, "rope_scaling_orig_ctx": 1 << 30}


def normalize_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Check a spec dict and fill defaults; ValueError naming the bad field."""
    unknown = sorted(set(spec) - set(SPEC_FIELDS))
    if unknown:
        raise ValueError(f"unknown spec field(s) {', '.join(unknown)}; known: {', '.join(SPEC_FIELDS)}")
    out: dict[str, Any] = {}
    for key, (kind, default, meaning) in SPEC_FIELDS.items():
        if key not in spec or spec[key] is None:
            if default is None and key not in ("qk_norm", "qkv_bias"):
                raise ValueError(f"spec field {key!r} is required ({meaning})")
            out[key] = list(default) if isinstance(default, list) else default
            continue
        v = spec[key]
        if (kind is int and (isinstance(v, bool) or not isinstance(v, int))) or not isinstance(v, kind):
            raise ValueError(f"spec field {key!r} must be {getattr(kind, '__name__', 'a number')}, got {v!r}")
        if kind is int and v < 0:
            raise ValueError(f"spec field {key!r} must not be negative, got {v}")
        if kind is int and v > SPEC_LIMITS.get(key, v):
            raise ValueError(f"spec field {key!r} is {v}, more than any model has (limit {SPEC_LIMITS[key]:,})")
        out[key] = v
    s = out
    layout_for(s["arch"])
    for key in ("n_layers", "n_embd", "n_head", "vocab_size", "context_length"):
        if s[key] <= 0:
            raise ValueError(f"spec field {key!r} must be positive, got {s[key]}")
    s["n_head_kv"] = s["n_head_kv"] or s["n_head"]
    if s["n_head"] % s["n_head_kv"]:
        raise ValueError(f"n_head {s['n_head']} is not divisible by n_head_kv {s['n_head_kv']}")
    if not s["head_dim"]:
        if s["n_embd"] % s["n_head"]:
            raise ValueError("head_dim is required when n_embd is not divisible by n_head")
        s["head_dim"] = s["n_embd"] // s["n_head"]
    layout_for(s["arch"]).normalize(s)
    s["type"] = parse_ftype(s["type"])
    for item in s["overrides"]:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            raise ValueError(f"each override must be [regex, type], got {item!r}")
    s["name"] = s["name"] or s["preset"] or s["arch"]
    return s


def tensor_shapes(spec: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor, GGUF order (row length first), in llama.cpp naming (the arch's layout)."""
    return layout_for(spec["arch"]).tensors(spec)


def plan_tensors(spec: dict[str, Any], type: str | None = None) -> list[tuple[str, tuple[int, ...], T, int]]:
    """(name, shape, GGML type, bytes) of every tensor of a normalized spec in file type ``type``."""
    ftype = parse_ftype(type or spec["type"])
    shapes = tensor_shapes(spec)
    layout = layout_for(spec["arch"])
    # llama-quantize counts n_layer_all layers (NextN/MTP blocks included) and reads layer 0's n_gqa()
    # (llama-hparams.cpp), 0 where layer 0 holds no KV
    kv = layout.head_kv_layers(spec) if layout.head_kv_layers else [spec["n_head_kv"]] * block_count(spec)
    shape = ModelShape(block_count(spec), spec["n_head"], kv[0], spec["n_expert"])
    types = choose_types(shapes, ftype, shape, overrides=[tuple(o) for o in spec["overrides"]])
    return [(n, sh, t, tensor_bytes(t, math.prod(sh))) for (n, sh), t in zip(shapes, types, strict=True)]


def resolve_spec(preset: str | dict[str, Any]) -> dict[str, Any]:
    """A preset name, or a spec dict, as a normalized spec."""
    return normalize_spec(get_preset(preset) if isinstance(preset, str) else dict(preset))


def _add_metadata(w: GGUFWriter, s: dict[str, Any], ftype: str) -> None:
    a = s["arch"] + "."
    file_type, default = FTYPES[ftype]
    w.add_string("general.type", "model")
    w.add_name(s["name"])
    w.add_uint32("general.file_type", int(file_type))
    if default not in (T.F32, T.F16, T.BF16):
        w.add_uint32("general.quantization_version", 2)
    for key, value, vtype in layout_for(s["arch"]).metadata(s):
        w.add_key_value(key if key.startswith("general.") else a + key, value, vtype)
    w.add_string("tokenizer.ggml.model", "none")
    w.add_key_value("localinfer.skeleton", s["preset"] or "spec", GGUFValueType.STRING)


def write_skeleton(
    preset: str | dict[str, Any],
    path: str | os.PathLike,
    *,
    type: str | None = None,
    extra_kv: dict[str, tuple[Any, GGUFValueType]] | None = None,
) -> Path:
    """Write a header-only GGUF of the real size (sparse data) for a preset name or spec dict.

    ``extra_kv`` adds metadata, ``{key: (value, GGUFValueType)}`` (e.g. a tokenizer,
    to give the header its real size).  The file appears atomically (temp file,
    fsync, rename).  Returns the path.  Raises ValueError for an unknown
    preset/type or an invalid spec.
    """
    s = resolve_spec(preset)
    ftype = parse_ftype(type or s["type"])
    plan = plan_tensors(s, ftype)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    w = GGUFWriter(None, s["arch"])
    _add_metadata(w, s, ftype)
    for key, (value, vtype) in (extra_kv or {}).items():
        w.add_key_value(key, value, vtype)
    data_size = 0
    for name, shape, qtype, nbytes in plan:
        w.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), nbytes, raw_dtype=qtype)
        data_size += -(-nbytes // ALIGNMENT) * ALIGNMENT
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fh = w.fout[0]
        header = fh.tell()
        data_offset = -(-header // ALIGNMENT) * ALIGNMENT
        fh.write(b"\0" * (data_offset - header))
        fh.truncate(data_offset + data_size)
        fh.flush()
        os.fsync(fh.fileno())
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path
