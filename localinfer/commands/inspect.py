"""`localinfer inspect [MODEL] [--tensors] [--json]`: a GGUF file's header and byte accounting.

Reads the header only (bounded reads; never the tensor data), so it takes the
same fraction of a second on a 100 GB file as on a 100 MB one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--tensors", action="store_true", help="list every tensor")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from gguf_tools.inspect import account, active_parameters
    from gguf_tools.split import merge, read_shards
    from localinfer.model.sources import resolve_model
    from localinfer.model.spec import ModelSpec

    path = resolve_model(args.model)
    shards = read_shards(path)
    header = merge(shards)
    spec, not_a_model = _spec(header)
    acc = account(shards)
    active = active_parameters(header) if spec is not None else None
    if args.json:
        out = _as_json(header, spec, acc, active, args.tensors)
        out["not_a_model"] = not_a_model
        out["shards"] = [s.path for s in shards]
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        print(_as_text(header, spec, acc, active, args.tensors, len(shards), not_a_model))
    return 0


def _spec(header):
    """(ModelSpec or None, why the file is not a complete model or None): any valid GGUF is shown."""
    from gguf_tools import GGUFFormatError
    from localinfer.errors import UnsupportedModelError
    from localinfer.model.spec import ModelSpec

    try:
        spec = ModelSpec.from_gguf(header)
    except GGUFFormatError as exc:
        if not exc.facts.get("missing"):
            raise  # metadata that contradicts itself or the tensors is refused, as fit and run refuse it
        # the container parsed; it is another kind of GGUF, or its metadata stops short of a whole model
        return None, exc.message if exc.field == "general.type" else f"not a complete model: {exc.message}"
    try:
        spec.require_weights()
    except UnsupportedModelError as exc:
        return spec, exc.message.removeprefix(f"{spec.path}: ")
    return spec, None


def _model_json(spec) -> dict:
    keys = ("arch", "name", "n_layers", "n_embd", "head_dim_k", "head_dim_v", "vocab_size", "n_ctx_train",
            "rope_freq_base", "sliding_window", "n_expert", "n_expert_used", "expert_ff", "tied_embeddings",
            "qk_norm", "file_type", "tokenizer_model")
    d = {k: getattr(spec, k) for k in keys}
    for k in ("n_head", "n_head_kv", "n_ff"):
        v = getattr(spec, k)
        d[k] = v[0] if len(set(v)) == 1 else list(v)
    from localinfer.model.kv import attention_layers, kv_bytes_per_token, recurrent_state_bytes

    d["rules"] = spec.rules
    d["kv_layers"] = attention_layers(spec)
    d["kv_bytes_per_token_f16"] = kv_bytes_per_token(spec)
    d["recurrent_layers"] = list(spec.recurrent_layers)
    d["recurrent_state_bytes_per_sequence"] = recurrent_state_bytes(spec, 1)
    d["mla"] = None if spec.mla is None else dict(spec.mla.__dict__)
    d["swa_kind"] = spec.swa_kind
    d["swa_layers"] = [il for il in range(spec.n_layers) if spec.swa_layers[il]] if spec.has_swa else []
    d["nextn_layers"] = spec.n_layer_nextn
    d["missing"] = list(spec.missing)
    return d


def _as_json(header, spec, acc, active, tensors: bool) -> dict:
    from gguf_tools.inspect import json_value

    out = {
        "path": header.path, "file_size": header.file_size, "version": header.version,
        "alignment": header.alignment, "header_size": header.header_size, "data_offset": header.data_offset,
        "n_tensors": len(header.tensors), "n_kv": len(header.kv), "bytes_read": header.bytes_read,
        "model": _model_json(spec) if spec is not None else None, "n_params": acc.n_params, "n_params_active": active,
        "accounting": acc.as_dict(),
        "metadata": {k: json_value(v) for k, v in header.kv.items()},
    }
    if tensors:
        out["tensors"] = [{"name": t.name, "type": t.type.name, "shape": list(t.shape), "n_bytes": t.n_bytes,
                           "offset": t.file_offset} for t in header.tensors]
    return out


def cache_text(spec) -> str:
    """What one token and one sequence cost in llama.cpp's caches, by the family's rule (f16 KV)."""
    from localinfer.model.kv import attention_layers, kv_bytes_per_token, recurrent_state_bytes
    from localinfer.units import fmt_bytes

    attn = attention_layers(spec)
    parts = [f"{spec.rules} rules ({spec.rules_source or 'generic'})",
             f"KV in {len(attn)} of {spec.n_layers} layers, {kv_bytes_per_token(spec):,} B per token (f16)"]
    if spec.mla is not None and spec.rules == "mla":
        parts.append(f"MLA latent {spec.mla.kv_lora_rank} + rope {spec.mla.n_rot} per token, no V; "
                     f"q_lora_rank {spec.mla.q_lora_rank or 'none'}")
    if spec.has_recurrent:
        r, s = spec.rs_dims
        parts.append(f"recurrent state in {len(spec.recurrent_layers)} layers: r {r:,} + s {s:,} values (F32), "
                     f"{fmt_bytes(recurrent_state_bytes(spec, 1))} per sequence")
    if spec.sliding_window and spec.has_swa:
        n = sum(1 for il in attn if spec.swa_layers[il])
        parts.append(f"{spec.swa_kind or 'sliding'} window {spec.sliding_window} in {n} layers, "
                     f"full attention in {len(attn) - n}")
    if spec.n_layer_nextn:
        parts.append(f"{spec.n_layer_nextn} NextN/MTP layer(s) skipped ({fmt_bytes(spec.skipped_bytes)}, not loaded)")
    return "; ".join(parts)


def _heads(v: tuple[int, ...]) -> str:
    return str(v[0]) if len(set(v)) == 1 else f"{min(v)}..{max(v)} per layer"


def _as_text(header, spec, acc, active, tensors: bool, n_shards: int = 1, not_a_model: str | None = None) -> str:
    from gguf_tools.inspect import describe_value, safe_text
    from localinfer.units import fmt_bytes

    lines = []
    add = lines.append
    ftype = header.get("general.file_type")
    add(f"file        {safe_text(header.path, 200)}")
    add(f"size        {header.file_size:,} bytes ({fmt_bytes(header.file_size)})"
        + (f" in {n_shards} shards" if n_shards > 1 else ""))
    add(f"format      GGUF v{header.version}, alignment {header.alignment}, {len(header.tensors):,} tensors, "
        f"{len(header.kv)} metadata keys, data at byte {header.data_offset:,}")
    if not_a_model:
        add(f"note        {safe_text(not_a_model, 160)} (fit and run need a full model)")
    if spec is None:
        arch_name, name = header.get("general.architecture"), header.get("general.name")
        add(f"model       {safe_text(name or os.path.basename(header.path), 80)}  (arch {safe_text(arch_name or '?', 40)}"
            + (f", file type {_ftype_name(ftype)}" if isinstance(ftype, int) else "") + ")")
        add(f"parameters  {acc.n_params:,} ({acc.n_params / 1e9:.2f} B)")
    else:
        _model_lines(add, spec, ftype, acc, active, header)
    _accounting_lines(add, header, acc, tensors)
    return "\n".join(lines)


def _model_lines(add, spec, ftype, acc, active, header) -> None:
    from gguf_tools.inspect import safe_text

    add(f"model       {safe_text(spec.name, 80)}  (arch {safe_text(spec.arch, 40)}"
        + (f", file type {_ftype_name(ftype)}" if isinstance(ftype, int) else "") + ")")
    if spec.mla is not None and spec.rules == "mla":
        heads = (f"heads {_heads(spec.n_head)} (q/k head {spec.mla.head_dim_k}, v head {spec.mla.head_dim_v}; "
                 f"MLA: one latent KV head)")
    else:
        heads = (f"heads {_heads(spec.n_head)}/{_heads(spec.n_head_kv)} (head dim {spec.head_dim_k}"
                 + (f", v {spec.head_dim_v}" if spec.head_dim_v != spec.head_dim_k else "") + ")")
    arch = f"layers {spec.n_layers}, embd {spec.n_embd}, {heads}, ffn {_heads(spec.n_ff)}"
    if spec.n_expert:
        arch += f", experts {spec.n_expert} ({spec.n_expert_used} used, ffn {spec.expert_ff})"
    add(f"shape       {arch}")
    add(f"context     {spec.n_ctx_train:,} (training), vocab {spec.vocab_size:,}")
    add(f"cache       {cache_text(spec)}")
    params = f"{acc.n_params:,} ({acc.n_params / 1e9:.2f} B)"
    if active is not None:
        params += f"; {active / 1e9:.2f} B active per token"
    add(f"parameters  {params}")
    if header.get("localinfer.skeleton") is not None:
        add("note        skeleton file: header only, the data section holds no weights")
    for m in spec.missing:
        add(f"note        {safe_text(m, 160)}")


def _accounting_lines(add, header, acc, tensors: bool) -> None:
    from gguf_tools.inspect import describe_value, safe_text
    from localinfer.units import fmt_bytes

    add("")
    add(f"  {'type':<8}{'tensors':>8}{'parameters':>18}{'bytes':>18}{'codes':>18}{'metadata':>16}{'bits/w':>8}")
    for t in acc.by_type:
        add(f"  {t.type:<8}{t.n_tensors:>8,}{t.n_elements:>18,}{t.n_bytes:>18,}{t.code_bytes:>18,}"
            f"{t.meta_bytes:>16,}{t.bits_per_weight:>8.3f}")

    add("")
    add("byte accounting")
    rows = (
        ("codes + unquantized floats", acc.codes_and_floats,
         f"codes {acc.codes:,} + floats {acc.floats:,}"),
        ("quantization metadata", acc.meta, f"{acc.meta_fraction:.1%} of quantized bytes"),
        ("header + padding", acc.header_and_padding,
         f"header {acc.header:,} + padding {acc.padding:,}"
         + (f" + trailing {acc.trailing:,}" if acc.trailing else "")),
        ("file", acc.file_size, f"{acc.bits_per_weight():.3f} bits/weight"
         f" ({acc.bits_per_weight(acc.tensor_bytes):.3f} without header)"),
    )
    for label, n, note in rows:
        add(f"  {label:<28}{n:>18,}  {fmt_bytes(n):>11}  {note}")

    add("")
    add("metadata")
    width = min(44, max((len(safe_text(k, 44)) for k in header.kv), default=0))
    for key, value in header.kv.items():
        add(f"  {safe_text(key, 44):<{width}} = {describe_value(value, 100)}")

    if tensors:
        add("")
        add(f"  {'tensor':<36}{'type':<8}{'shape':<26}{'bytes':>16}{'offset':>18}")
        for t in header.tensors:
            shape = "×".join(str(d) for d in t.shape)
            add(f"  {safe_text(t.name, 36):<36}{t.type.name:<8}{shape:<26}{t.n_bytes:>16,}{t.file_offset:>18,}")


def _ftype_name(v: int) -> str:
    from gguf_tools import LlamaFileType

    try:
        return LlamaFileType(v).name
    except ValueError:
        return str(v)
