"""`localinfer fit [MODEL]`: will the model fit on each device, and how (header only).

For this machine and every device profile (or the ``--device`` ones): fits or
not, the memory breakdown, the largest context at this parallelism, the most
parallel requests at this context, the most faithful KV type that fits, the
layers to keep on the accelerator when the weights do not fit, a one-line
reason, and the llama.cpp command line that realises the plan.  ``--json``
carries every term and the formula behind it.  Never changes the request: a
smaller setting that would fit is only suggested.  For an architecture localinfer
has no rules for (or with ``--dry-run``) this machine's row is llama.cpp's own dry
run (:mod:`localinfer.commands._dry_run`, a subprocess; imported only then).
"""

from __future__ import annotations

import argparse
import json
import sys

from localinfer.generation.load import MAX_BATCH, MAX_CTX, MAX_GPU_LAYERS
from localinfer.model.kv import KV_TYPES, check_kv_type

DEFAULT_CTX = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("-c", "--ctx", type=int, default=None, metavar="N",
                        help=f"tokens per request (default: {DEFAULT_CTX}, or the model's trained context if smaller)")
    parser.add_argument("-np", "--parallel", type=int, default=1, metavar="N", help="parallel requests (default 1)")
    parser.add_argument("--kv-type", default=None, metavar="T", help="K and V cache type: " + ", ".join(KV_TYPES))
    parser.add_argument("-ctk", "--cache-type-k", dest="type_k", default=None, metavar="T", help="K cache type")
    parser.add_argument("-ctv", "--cache-type-v", dest="type_v", default=None, metavar="T", help="V cache type")
    parser.add_argument("-fa", "--flash-attn", default="auto", metavar="on|off|auto",
                        help="flash attention (default auto: on where llama.cpp supports it)")
    parser.add_argument("--device", action="extend", nargs="+", default=None, metavar="NAME",
                        help="device profile(s) to check (default: this machine and every profile)")
    parser.add_argument("--all", action="store_true", help="this machine and every profile (the default)")
    parser.add_argument("-ngl", "--gpu-layers", type=int, default=-1, metavar="N",
                        help="layers on the accelerator, the output layer counted as one and offloaded first, as llama.cpp "
                             "(-1: all, the default)")
    parser.add_argument("-ub", "--ubatch", type=int, default=512, metavar="N", help="llama.cpp -ub (default 512)")
    parser.add_argument("--swa-full", action="store_true",
                        help="full-size caches for sliding-window layers, as llama.cpp's --swa-full (llama-cpp-python's "
                             "Llama() defaults to it; llama-server does not)")
    from localinfer.backends.registry import DEFAULT_BACKEND, names

    parser.add_argument("--backend", default=DEFAULT_BACKEND, metavar="NAME",
                        help=f"allocation rules: {', '.join(names())} (default {DEFAULT_BACKEND})")
    parser.add_argument("--dtype", default=None, metavar="T",
                        help="torch/mlx weight dtype: f32, bf16, f16 (default: the engine's; torch bf16 on CUDA, "
                             "mlx f16 on Metal, f32 on the CPU)")
    g = parser.add_argument_group("llama.cpp load mode (memory the CPU shares: the resident figure changes)")
    g.add_argument("-lm", "--load-mode", default=None, choices=("mmap", "none", "mlock", "mmap+mlock"),
                   help="llama.cpp's -lm: mmap (default), none (read into memory), mlock, mmap+mlock")
    g.add_argument("--no-mmap", action="store_true", help="the same as --load-mode none")
    g.add_argument("--mlock", action="store_true", help="lock the weights in memory (with mmap: the whole mapping)")
    g.add_argument("--no-repack", action="store_true", help="llama.cpp's --no-repack: no CPU_REPACK copy")
    from localinfer.commands._overrides import add_override_args

    add_override_args(parser.add_argument_group("llama.cpp tensor placement (MoE experts in host memory)"))
    parser.add_argument("--host", default=None, metavar="NAME",
                        help="host RAM for the part of a split in system memory: a host profile (ddr5-5600-2ch, "
                             "ddr4-3200-2ch, threadripper-pro-8ch, epyc-9004-12ch, grace-lpddr5x) or local "
                             "(default: the device profile's host; this machine's for local)")
    parser.add_argument("--objective", default="decode", choices=("decode", "ttft"),
                        help="what the expert-placement search maximises (one device, or --devices/--rpc): "
                             "decode tok/s (default), or ttft: the time to the first token of a prompt filling --ctx "
                             "(it also tries larger -ub)")
    parser.add_argument("--json", action="store_true", help="every term and its formula, as JSON")
    parser.add_argument("--dry-run", action="store_true",
                        help="this machine's row from llama.cpp's own dry run (it plans every buffer without reading "
                             "the weights); automatic for architectures localinfer has no rules for")
    g = parser.add_argument_group("across devices and hosts (llama.cpp RPC, -sm layer)")
    g.add_argument("--rpc", default=None, metavar="HOST:PORT,...",
                   help="plan for these running workers (`localinfer worker`): asks them for devices and memory")
    g.add_argument("--devices", dest="split_devices", default=None, metavar="A,B,...",
                   help="plan offline from profiles: this machine first, then one per worker host "
                        "(m2-max-96gb,m2-max-96gb; '2x rtx-4090' for two GPUs in one host)")
    g.add_argument("--link", default=None, metavar="NAME",
                   help="network between the hosts, for the speed: loopback, 1gbe, 10gbe, thunderbolt")
    g.add_argument("-ts", "--tensor-split", default=None, metavar="A,B,...",
                   help="layer shares per device, RPC workers first (default: by free memory, as llama.cpp)")
    g.add_argument("-sm", "--split-mode", default="layer", choices=("layer",),
                   help="how to split: layer (the only mode planned)")


def _request(args, spec):
    from localinfer.backends.memory import FitRequest
    from localinfer.commands._overrides import override_fields
    from localinfer.errors import UsageError

    if args.kv_type and (args.type_k or args.type_v):
        raise UsageError("give either --kv-type or -ctk/-ctv, not both", flag="--kv-type",
                         hint="--kv-type q8_0 sets both K and V")
    kv = {flag: check_kv_type(value, flag) for flag, value in
          (("--kv-type", args.kv_type), ("-ctk", args.type_k), ("-ctv", args.type_v)) if value is not None}
    type_k = kv.get("--kv-type") or kv.get("-ctk") or "f16"
    type_v = kv.get("--kv-type") or kv.get("-ctv") or "f16"
    fa = {"on": True, "off": False, "auto": None}.get(str(args.flash_attn).lower(), "bad")
    if fa == "bad":
        raise UsageError(f"--flash-attn takes on, off or auto, not {args.flash_attn!r}", flag="--flash-attn")
    if args.ctx is None:
        ctx = min(DEFAULT_CTX, spec.n_ctx_train) if spec.n_ctx_train else DEFAULT_CTX
    else:
        ctx = args.ctx
        if not 0 < ctx <= MAX_CTX:
            raise UsageError(f"--ctx must be from 1 to {MAX_CTX} tokens, got {ctx}", flag="--ctx",
                             hint=f"e.g. --ctx {DEFAULT_CTX}; the model was trained for {spec.n_ctx_train}")
        limit = spec.context_limit
        if limit is not None and ctx > limit:
            raise UsageError(f"--ctx {ctx} is beyond the model's trained context {limit} "
                             "and it declares no RoPE scaling", flag="--ctx", hint=f"use --ctx {limit} or less")
    if args.parallel <= 0:
        raise UsageError(f"--parallel must be at least 1, got {args.parallel}", flag="--parallel")
    if not 0 < args.ubatch <= MAX_BATCH:
        raise UsageError(f"--ubatch must be from 1 to {MAX_BATCH}, got {args.ubatch}", flag="--ubatch",
                         hint="llama.cpp's default is 512")
    if args.gpu_layers is not None and args.gpu_layers > MAX_GPU_LAYERS:
        raise UsageError(f"--gpu-layers {args.gpu_layers} is out of range", flag="--gpu-layers",
                         hint="use -1 for every layer, or a count up to the model's layers")
    if args.dtype is not None and args.backend == "llama.cpp":
        raise UsageError("--dtype sets the torch and mlx weight dtype; llama.cpp keeps the GGUF's types",
                         flag="--dtype", hint="add --backend torch or --backend mlx, or drop --dtype")
    return FitRequest(n_ctx=ctx, n_seq=args.parallel, type_k=type_k, type_v=type_v, flash_attn=fa,
                      n_gpu_layers=args.gpu_layers, n_ubatch=args.ubatch, backend=args.backend, dtype=args.dtype,
                      swa_full=args.swa_full, **load_mode(args), **override_fields(args))


def load_mode(args) -> dict:
    """FitRequest's mmap / mlock / repack from -lm, --no-mmap, --mlock and --no-repack."""
    from localinfer.errors import UsageError

    mode = args.load_mode
    if mode is not None and (args.no_mmap or args.mlock):
        raise UsageError("give either --load-mode or --no-mmap/--mlock, not both", flag="--load-mode",
                         hint="--load-mode none is --no-mmap; --load-mode mmap+mlock is --mlock")
    if mode is None:
        mode = ("none" if args.no_mmap else "mmap") if not args.mlock else ("mlock" if args.no_mmap else "mmap+mlock")
    return {"mmap": mode in ("mmap", "mmap+mlock"), "mlock": "mlock" in mode, "repack": not args.no_repack}


def _devices(args):
    from localinfer.devices.profiles import all_devices

    names = []
    for item in args.device or ():
        names += [n for n in item.split(",") if n.strip()]
    if args.all or not names:
        return all_devices()
    return all_devices(names)


def run_split(args, spec, req) -> int:
    """``--rpc`` / ``--devices``: one verdict for the model split across the devices, then llama.cpp ``--fit``'s
    choice for them beside localinfer's plan (:mod:`localinfer.plan.split_fit`)."""
    from localinfer.devices.links import get_link
    from localinfer.errors import UsageError
    from localinfer.plan import split_devices
    from localinfer.plan.split import parse_shares
    from localinfer.plan.split_fit import gives_up, llamacpp_split_fit, plan_split, split_env
    from localinfer.report.split import render_fit_compare, render_split_text

    if args.rpc and args.split_devices:
        raise UsageError("give --rpc (running workers) or --devices (profiles), not both", flag="--devices")
    if args.rpc:
        from localinfer.backends.llamacpp.rpc_probe import is_loopback, parse_endpoints, probe

        eps = parse_endpoints(args.rpc)
        setup = split_devices.from_workers([probe(ep) for ep in eps])
        link = args.link or ("loopback" if all(is_loopback(ep.rpartition(":")[0]) for ep in eps) else None)
    else:
        setup = split_devices.from_profiles(args.split_devices)
        link = args.link
    shares = parse_shares(args.tensor_split)
    env, host_usable = split_env(setup, get_link(link) if link else None, args.host, rpc=bool(args.rpc))
    sf, plan, ref = plan_split(spec, env, req, host_usable, shares=shares, objective=args.objective)
    auto = None if args.ctx is not None else llamacpp_split_fit(spec, env, req, shares=shares, ctx_auto=True)
    if args.json:
        doc = sf.to_dict()
        doc.update(plan=None if plan is None else plan.to_dict(), llamacpp_fit=None if ref is None else ref.to_dict(),
                   llamacpp_fit_ctx_auto=None if auto is None else auto.to_dict(), ctx_given=args.ctx is not None)
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(render_split_text(spec, sf))
        print(render_fit_compare(plan, ref, auto, ctx_given=args.ctx is not None,
                                 no_ref=gives_up(req, shares)))
    return 0


def run(args: argparse.Namespace) -> int:
    from localinfer.generation.load import open_model
    from localinfer.plan.fit import fit_device
    from localinfer.plan.speed import predict_speed
    from localinfer.report.fit import fit_json, render_text

    spec = open_model(args.model).spec
    req = _request(args, spec)
    if args.dry_run and (args.rpc or args.split_devices):
        from localinfer.errors import UsageError

        raise UsageError("--dry-run plans this machine alone, not a split", flag="--dry-run",
                         hint="drop --rpc/--devices, or drop --dry-run")
    if args.rpc or args.split_devices:
        return run_split(args, spec, req)
    from localinfer.errors import UsageError

    if args.tensor_split or args.link:
        raise UsageError("--tensor-split and --link plan a split: add --rpc or --devices", flag="--tensor-split")
    from localinfer.devices.hosts import host_for, with_host

    devices = _devices(args)
    hosts = {d.name: host_for(d, args.host) for d in devices}
    # the verdict and its searches judge the host part against the host's RAM when the host is named or the
    # request puts weights on it; otherwise the host is shown (and the MoE search judges it) but the -ngl
    # suggestion stays the one fit made before hosts existed (its --json may not change)
    judged = bool(args.host) or req.overridden or req.n_gpu_layers >= 0
    results = [fit_device(spec, with_host(dev, hosts[dev.name]) if judged else dev, req) for dev in devices]
    if args.dry_run or (spec.rules_generic and req.backend == "llama.cpp"):
        from localinfer.commands._dry_run import local_dry_run

        results = local_dry_run(spec, req, results, forced=args.dry_run)
    speeds = {r.device.name: predict_speed(spec, r.device, req) for r in results}
    # the expert-placement search replays a split graph per candidate: for the devices asked for by name, not for
    # the whole table of profiles (fit answers that in well under a second)
    search = bool(args.device) or bool(args.host)
    plans = {r.device.name: recommended(spec, r, hosts.get(r.device.name), req, search=search,
                                        objective=args.objective) for r in results}
    if args.json:
        doc = fit_json(spec, req, results)
        for d, r in zip(doc["devices"], results):
            d["speed"] = speeds[r.device.name]
            d.update(plans[r.device.name].to_dict())
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(render_text(spec, req, results, speeds, {n: p for n, p in plans.items()}))
        if not search and spec.is_moe and any(not r.fits and r.supported for r in results):
            print("\nnote: for a plan with experts in host memory (--n-cpu-moe) on a device it does not fit, "
                  "name it: localinfer fit MODEL --device NAME")
    return 0


def recommended(spec, result, host, req, *, search: bool = True, objective: str = "decode"):
    """The plan ``fit`` recommends on one device (the request, a MoE placement when ``search``, or a lower -ngl),
    its speed and the host part judged against the host's RAM."""
    from dataclasses import replace

    from localinfer.plan.host_speed import plan_speed
    from localinfer.plan.moe_fit import moe_plan
    from localinfer.report.fit import Recommended

    moe = None
    plan_req = req
    if search and not result.fits and result.supported and result.source == "estimate":
        moe = moe_plan(spec, result.device, host, req, objective)
        if moe is not None:
            plan_req = moe.request
        elif result.offload is not None:
            plan_req = replace(req, n_gpu_layers=result.offload.gpu_layers)
    speed = moe.speed if moe is not None else (plan_speed(spec, result.device, host, plan_req)
                                               if result.fits or result.offload is not None else None)
    return Recommended(host, result.breakdown.host_bytes, moe, speed, plan_req is not req,
                       judged=result.device.host_memory_bytes is not None)
