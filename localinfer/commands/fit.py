"""`localinfer fit [MODEL]`: will the model fit on each device, and how (header only).

For this machine and every device profile (or the ``--device`` ones): fits or
not, the memory breakdown, the largest context at this parallelism, the most
parallel requests at this context, the most faithful KV type that fits, the
layers to keep on the accelerator when the weights do not fit, a one-line
reason, and the llama.cpp command line that realises the plan.  ``--json``
carries every term and the formula behind it.  Never changes the request: a
smaller setting that would fit is only suggested.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from gguf_tools.text import safe_text

KV_FLAG_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
DEFAULT_CTX = 4096
WIDTH = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("-c", "--ctx", type=int, default=None, metavar="N",
                        help=f"tokens per request (default: {DEFAULT_CTX}, or the model's trained context if smaller)")
    parser.add_argument("-np", "--parallel", type=int, default=1, metavar="N", help="parallel requests (default 1)")
    parser.add_argument("--kv-type", default=None, metavar="T", help="K and V cache type: " + ", ".join(KV_FLAG_TYPES))
    parser.add_argument("-ctk", "--cache-type-k", dest="type_k", default=None, metavar="T", help="K cache type")
    parser.add_argument("-ctv", "--cache-type-v", dest="type_v", default=None, metavar="T", help="V cache type")
    parser.add_argument("-fa", "--flash-attn", default="auto", metavar="on|off|auto",
                        help="flash attention (default auto: on where llama.cpp supports it)")
    parser.add_argument("--device", action="extend", nargs="+", default=None, metavar="NAME",
                        help="device profile(s) to check (default: this machine and every profile)")
    parser.add_argument("--all", action="store_true", help="this machine and every profile (the default)")
    parser.add_argument("-ngl", "--gpu-layers", type=int, default=-1, metavar="N",
                        help="repeating layers on the accelerator (-1: all, the default)")
    parser.add_argument("-ub", "--ubatch", type=int, default=512, metavar="N", help="llama.cpp -ub (default 512)")
    from localinfer.backends.registry import DEFAULT_BACKEND, names

    parser.add_argument("--backend", default=DEFAULT_BACKEND, metavar="NAME",
                        help=f"allocation rules: {', '.join(names())} (default {DEFAULT_BACKEND})")
    parser.add_argument("--dtype", default=None, metavar="T",
                        help="torch/mlx weight dtype: f32, bf16, f16 (default: the engine's; torch bf16 on CUDA, "
                             "mlx f16 on Metal, f32 on the CPU)")
    parser.add_argument("--json", action="store_true", help="every term and its formula, as JSON")


def _request(args, spec):
    from localinfer.backends.memory import FitRequest
    from localinfer.errors import UsageError

    if args.kv_type and (args.type_k or args.type_v):
        raise UsageError("give either --kv-type or -ctk/-ctv, not both", flag="--kv-type",
                         hint="--kv-type q8_0 sets both K and V")
    for flag, value in (("--kv-type", args.kv_type), ("-ctk", args.type_k), ("-ctv", args.type_v)):
        if value is not None and value.lower() not in KV_FLAG_TYPES:
            raise UsageError(f"{flag}: unknown KV type {value!r}", flag=flag, hint="use one of " + ", ".join(KV_FLAG_TYPES))
    type_k = (args.kv_type or args.type_k or "f16").lower()
    type_v = (args.kv_type or args.type_v or "f16").lower()
    fa = {"on": True, "off": False, "auto": None}.get(str(args.flash_attn).lower(), "bad")
    if fa == "bad":
        raise UsageError(f"--flash-attn takes on, off or auto, not {args.flash_attn!r}", flag="--flash-attn")
    if args.ctx is None:
        ctx = min(DEFAULT_CTX, spec.n_ctx_train) if spec.n_ctx_train else DEFAULT_CTX
    else:
        ctx = args.ctx
        if ctx <= 0:
            raise UsageError(f"--ctx must be a positive number of tokens, got {ctx}", flag="--ctx",
                             hint=f"e.g. --ctx {DEFAULT_CTX}; the model was trained for {spec.n_ctx_train}")
        if spec.n_ctx_train and ctx > spec.n_ctx_train and not (spec.rope_scaling or spec.rope_freq_scale != 1.0):
            raise UsageError(f"--ctx {ctx} is beyond the model's trained context {spec.n_ctx_train} "
                             "and it declares no RoPE scaling", flag="--ctx",
                             hint=f"use --ctx {spec.n_ctx_train} or less")
    if args.parallel <= 0:
        raise UsageError(f"--parallel must be at least 1, got {args.parallel}", flag="--parallel")
    if args.ubatch <= 0:
        raise UsageError(f"--ubatch must be positive, got {args.ubatch}", flag="--ubatch")
    if args.dtype is not None and args.backend == "llama.cpp":
        raise UsageError("--dtype sets the torch and mlx weight dtype; llama.cpp keeps the GGUF's types",
                         flag="--dtype", hint="add --backend torch or --backend mlx, or drop --dtype")
    return FitRequest(n_ctx=ctx, n_seq=args.parallel, type_k=type_k, type_v=type_v, flash_attn=fa,
                      n_gpu_layers=args.gpu_layers, n_ubatch=args.ubatch, backend=args.backend, dtype=args.dtype)


def _devices(args):
    from localinfer.devices.profiles import all_devices

    names = []
    for item in args.device or ():
        names += [n for n in item.split(",") if n.strip()]
    if args.all or not names:
        return all_devices()
    return all_devices(names)


def run(args: argparse.Namespace) -> int:
    from localinfer.model.sources import resolve_model
    from localinfer.model.spec import ModelSpec
    from localinfer.plan.fit import fit_device

    spec = ModelSpec.from_gguf(resolve_model(args.model))
    req = _request(args, spec)
    results = [fit_device(spec, dev, req) for dev in _devices(args)]
    speeds = {r.device.name: predict_speed(spec, r.device, req) for r in results}
    if args.json:
        doc = _as_json(spec, req, results)
        for d, r in zip(doc["devices"], results):
            d["speed"] = speeds[r.device.name]
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(render_text(spec, req, results, speeds))
    return 0


def predict_speed(spec, device, req) -> dict | None:
    """Batch-1 prefill and decode tok/s at the requested context, from the device profile.

    ``None`` where the profile lacks the bandwidth or peak FLOP/s the speed model needs
    (e.g. this machine's CPU: measure it with ``localinfer bench``).
    """
    if req.backend != "llama.cpp" or not device.bandwidth_bytes_per_s or not device.bf16_flops:
        return None
    from localinfer.model.cost import model_cost
    from localinfer.plan.speed import SpeedModel

    model = SpeedModel(model_cost(spec), device, ubatch=req.n_ubatch)
    kv = req.type_k if req.type_k == req.type_v else "f16"
    prefill = model.prefill(1, req.n_ctx)
    step = model.decode_step(1, req.n_ctx, kv)
    if not prefill.seconds or not step.seconds or math.isnan(prefill.seconds) or math.isnan(step.seconds):
        return None
    return {"context": req.n_ctx, "prefill_tok_s": req.n_ctx / prefill.seconds, "ttft_s": prefill.seconds,
            "decode_tok_s": 1.0 / step.seconds, "decode_step_s": step.seconds,
            "decode_bound": "compute" if step.compute_s > step.memory_s else "memory",
            "formula": "decode step = max(F/(P·MFU), (D_w + L·k)/(β·MBU)); prefill = FLOPs (incl. attention "
                       "pairs c(c+1)/2) / (P·MFU); batch 1, profile efficiencies"}


def _as_json(spec, req, results) -> dict:
    from localinfer.model.kv import kv_bytes_per_token

    return {
        "model": {"path": spec.path, "name": spec.name, "arch": spec.arch, "n_layers": spec.n_layers,
                  "weight_bytes": spec.weight_bytes, "file_size": spec.file_size, "n_ctx_train": spec.n_ctx_train,
                  "kv_bytes_per_token": kv_bytes_per_token(spec, req.type_k, req.type_v),
                  "kv_bytes_per_token_formula": "Σ layers row_bytes(type_k, n_head_kv·head_dim_k) + "
                                                "row_bytes(type_v, n_head_kv·head_dim_v)",
                  "missing": list(spec.missing)},
        "request": dict(req.__dict__),
        "devices": [r.to_dict() for r in results],
    }


def _g(n: int | None) -> str:
    if n is None:
        return "—"
    from localinfer.units import GiB, MiB

    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


def _ctx(n: int | None) -> str:
    if not n:
        return "—"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def render_text(spec, req, results, speeds: dict | None = None) -> str:
    """The fit report as text that reads at 100 columns."""
    from localinfer.units import GiB

    fa = {True: "on", False: "off", None: "auto"}[req.flash_attn]
    head = (f"{safe_text(spec.name, None)}  ({spec.arch}, {spec.n_layers} layers, {spec.weight_bytes / GiB:.2f} GiB of weights)\n"
            f"request: {req.n_ctx} tokens × {req.n_seq} sequence(s), KV {req.type_k}/{req.type_v}, "
            f"flash attention {fa}, backend {req.backend}")
    cols = f"{'device':<22}{'usable':>10}{'weights':>11}{'KV':>10}{'compute':>10}{'left':>11}  {'fits':<5}{'max ctx':>8}{'max par':>8}"
    lines = [head, "", cols, "-" * len(cols)]
    for r in results:
        bd = r.breakdown
        pool = None if bd.unified else "device"
        name = safe_text(r.device.name, None)[:21]
        w, kv, cb, left = (bd.sum("weights", pool), bd.sum("kv", pool), bd.sum("compute", pool) + bd.sum("output", pool),
                           r.free_bytes) if r.supported else (None,) * 4
        lines.append(f"{name:<22}{_g(r.usable_bytes):>10}{_g(w):>11}{_g(kv):>10}{_g(cb):>10}{_g(left):>11}  "
                     f"{'yes' if r.fits else 'NO':<5}{_ctx(r.max_ctx):>8}{(str(r.max_parallel) if r.max_parallel else '—'):>8}")
    lines.append("")
    for r in results:
        lines.append(f"{safe_text(r.device.name, None)}: {safe_text(r.device.display_name, None)}")
        lines.extend(_wrap(r.reason, "  "))
        if not r.fits:
            if r.suggestions:
                lines.extend(_wrap("would fit with: " + "; ".join(r.suggestions), "  "))
            elif r.offload is None and r.supported:
                lines.append("  nothing fits: not even the weights")
        if r.offload is not None:
            lines.extend(_wrap(f"keep {r.offload.gpu_layers} of {spec.n_layers} layers on the accelerator "
                               f"(-ngl {r.offload.gpu_layers}); the host holds {_g(r.offload.host_bytes)} "
                               "(layers left behind, embeddings, output buffer)", "  "))
        if r.kv_type and r.kv_type != req.type_k:
            lines.append(f"  KV type that fits at this context: {r.kv_type}")
        sp = (speeds or {}).get(r.device.name)
        if sp and (r.fits or r.offload is not None):
            from localinfer.units import fmt_duration

            lines.extend(_wrap(f"speed (predicted, 1 request, {_ctx(req.n_ctx)} context): prefill "
                               f"{sp['prefill_tok_s']:,.0f} tok/s (TTFT {fmt_duration(sp['ttft_s'])}), decode "
                               f"{sp['decode_tok_s']:,.0f} tok/s ({sp['decode_bound']}-bound; roofline × the "
                               "profile's efficiencies, no per-kernel overheads, so small models run slower)"
                               + ("; if all weights were on the accelerator" if r.offload is not None else ""),
                               "  "))
        for note in r.breakdown.notes + r.warnings:
            lines.extend(_wrap("note: " + note, "  "))
        if r.command and (r.fits or r.offload is not None):
            lines.extend(_wrap(r.command, "  $ ", "      "))
        lines.append("")
    return "\n".join(lines).rstrip()


def _wrap(text: str, first: str, rest: str | None = None) -> list[str]:
    import textwrap

    return textwrap.wrap(safe_text(text, None), WIDTH, initial_indent=first, subsequent_indent=rest or first,
                         break_on_hyphens=False, break_long_words=True)
