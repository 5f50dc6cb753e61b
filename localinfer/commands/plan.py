"""`localinfer plan`: the configuration that returns the most correct answers on time.

    localinfer plan qwen3-8b.gguf --device rtx-pro-6000 --requests 16 --input 8192 --output 256 \\
        --shared-prefix 6144 --deadline 7 --kv-budget 12GiB --acceptance 0.5
"""

from __future__ import annotations

import argparse
import json
import math

from localinfer.errors import UsageError
from localinfer.plan.speed import Workload

KV_DEFAULT = "f16,q8_0,q4_0"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file or skeleton (default: the embedded model)")
    p.add_argument("--device", default="local", metavar="NAME", help="device profile (see `localinfer devices`)")
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=1, metavar="N", help="requests arriving together")
    w.add_argument("--input", type=int, default=2048, metavar="L", help="input tokens per request")
    w.add_argument("--output", type=int, default=256, metavar="G", help="output tokens per request")
    w.add_argument("--shared-prefix", type=int, default=0, metavar="P",
                   help="leading input tokens common to all requests (assumed cached)")
    w.add_argument("--deadline", type=float, default=None, metavar="S", help="seconds to finish every request")
    c = p.add_argument_group("configurations")
    c.add_argument("--kv-budget", default=None, metavar="SIZE",
                   help="memory for KV and auxiliary buffers, e.g. 12GiB "
                        "(default: what `localinfer fit` leaves after weights and buffers)")
    c.add_argument("--kv", default=KV_DEFAULT, metavar="TYPES", help=f"KV types to try (default {KV_DEFAULT})")
    c.add_argument("--acceptance", type=float, default=None, metavar="A",
                   help="per-position draft acceptance; adds prompt-lookup (and --draft) configurations")
    c.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help="draft tokens per round (default: the length the marginal rule picks, padded graph shapes)")
    c.add_argument("--draft", default=None, metavar="GGUF", help="a draft model to consider")
    c.add_argument("--no-offload", action="store_true", help="do not consider weight offload")
    p.add_argument("--bench", default=None, metavar="FILE",
                   help="measured speed on this device (`localinfer bench --json` or llama-bench JSON)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    s = p.add_argument_group("across hosts (llama.cpp RPC)")
    s.add_argument("--split", default=None, metavar="HOSTS",
                   help="plan for the model split over these hosts, this machine first (fit --devices' syntax); "
                        "no offload")
    s.add_argument("--link", default=None, metavar="NAME", help="network between them: loopback, 1gbe, 10gbe, "
                                                                "thunderbolt")


def _check(v, flag: str, lo: float, hi: float | None = None):
    if v is None:
        return v
    if isinstance(v, float) and not math.isfinite(v) or v < lo or (hi is not None and v > hi):
        raise UsageError(f"{flag} {v:g} is out of range", flag=flag,
                         hint=f"use a value from {lo:g}" + (f" to {hi:g}" if hi is not None else " up"))
    return v


def _check_context(spec, n_ctx: int) -> None:
    """Refuse a request longer than the model's trained context, as `fit` and `run` do."""
    train = spec.context_limit
    if train is not None and n_ctx > train:
        raise UsageError(f"--input + --output is {n_ctx} tokens, beyond the model's trained context {train} "
                         "and it declares no RoPE scaling", flag="--input",
                         hint=f"use --input + --output of {train} or less")


def _split_speed(args, spec, n_ctx: int):
    """(SplitSpeedModel, KV budget) for --split HOSTS [--link NAME]."""
    from localinfer.backends.memory import FitRequest
    from localinfer.devices.links import get_link
    from localinfer.plan import split_devices
    from localinfer.plan.split_plan import SplitSpeedModel, split_budget, split_placement

    if args.bench:
        raise UsageError("--bench calibrates one device; a --split is planned from the hosts' profiles",
                         flag="--bench")
    setup = split_devices.from_profiles(args.split)
    missing = [p.name for p in setup.profiles if not (p.bandwidth_bytes_per_s and p.bf16_flops)]
    if missing:
        raise UsageError(f"--split: profile {missing[0]} has no bandwidth or FLOP/s to plan speed with",
                         flag="--split", hint="use profiles with bandwidth and bf16_flops (localinfer devices)")
    link = get_link(args.link) if args.link else None
    placement = split_placement(spec, setup, n_ctx, link, args.requests)   # fit --devices' plan for the workload
    room, sb = split_budget(spec, setup, n_ctx, placement.shares, placement.request)
    req = placement.request or FitRequest(n_ctx=n_ctx)
    return SplitSpeedModel(spec, setup, sb, req, link, args.split, placement, placement.host), room


def _room_hint(speed) -> str:
    hint = "use a shorter --input/--output, a smaller quant, or a larger device"
    place = getattr(speed, "placement", None)
    if place is None or place.plan is None or place.used:
        return hint
    return (f"{hint}; fit --devices' plan puts weights in host RAM, and no host profile times them: "
            + place.describe(place.plan))


def build(args: argparse.Namespace):
    """(spec, SpeedModel, Plan) for the parsed arguments."""
    from localinfer.devices.profiles import get_device
    from localinfer.generation.load import open_model
    from localinfer.model.cost import kv_pair, model_cost
    from localinfer.plan.bench_import import load_bench
    from localinfer.plan.planner import candidate_configs, default_kv_budget, lookup_draft_length, plan
    from localinfer.plan.speculation import Drafting, model_drafting
    from localinfer.plan.speed import llamacpp_speed_model
    from localinfer.units import fmt_bytes, parse_size

    _check(args.acceptance, "--acceptance", 0.0, 1.0)
    _check(args.draft_tokens, "--draft-tokens", 1, 64)
    workload = Workload(args.requests, args.input, args.output, args.shared_prefix, deadline_s=args.deadline)
    spec = open_model(args.model).spec
    n_ctx = workload.input_tokens + workload.output_tokens
    _check_context(spec, n_ctx)
    if args.split:
        speed, room = _split_speed(args, spec, n_ctx)
        device = speed.device
    else:
        if args.link:
            raise UsageError("--link sets the network of a --split", flag="--link", hint="add --split HOSTS")
        device = get_device(args.device)
        calibration = load_bench(args.bench) if args.bench else None
        speed = llamacpp_speed_model(spec, device, calibration)
        room = default_kv_budget(spec, device, n_ctx)  # what the device leaves for KV after weights and buffers
    if room < 0:
        raise UsageError(f"{device.name} cannot hold this model with a {n_ctx}-token request: weights and buffers "
                         f"need {fmt_bytes(device.usable_bytes - room)} of {fmt_bytes(device.usable_bytes)}",
                         flag="--split" if args.split else "--device", hint=_room_hint(speed))
    if args.kv_budget is None:
        budget = room
    else:
        try:
            budget = parse_size(args.kv_budget)
        except ValueError as exc:
            raise UsageError(f"--kv-budget: {exc}", flag="--kv-budget") from None
        if budget > room:
            raise UsageError(f"--kv-budget {fmt_bytes(budget)} is more than {device.name} leaves for KV: "
                             f"{fmt_bytes(room)} after weights and buffers", flag="--kv-budget",
                             hint=f"use --kv-budget {fmt_bytes(room).replace(' ', '')} or less, or leave it out")
    kv_types = tuple(t.strip() for t in args.kv.split(",") if t.strip())
    if not kv_types:
        raise UsageError("--kv needs at least one KV type", flag="--kv", hint=f"e.g. --kv {KV_DEFAULT}")
    for t in kv_types:
        kv_pair(t, "--kv")  # its message already names --kv
    drafts = []
    if args.acceptance is not None:
        k = args.draft_tokens or lookup_draft_length(speed, workload, args.acceptance)
        drafts.append(Drafting.lookup(args.acceptance, k))
        if args.draft:
            draft = model_cost(open_model(args.draft).spec)
            drafts.append(model_drafting(draft, speed, workload, args.acceptance, k))
    elif args.draft:
        raise UsageError("--draft needs --acceptance (how often the target agrees with the draft)",
                         flag="--acceptance", hint="e.g. --acceptance 0.7")
    configs = candidate_configs(workload, kv_types=kv_types, drafts=tuple(drafts),
                                offload=not args.no_offload and not args.split)
    return spec, speed, plan(speed, workload, budget, configs, spec=spec)


def _memory(spec, device, workload) -> dict:
    """Weights and buffers as the KV budget counts them (resident) and as mapped, for one request."""
    from localinfer.backends.memory import FitRequest
    from localinfer.plan.fit import fit_device, mapped_note
    from localinfer.units import fmt_bytes

    n_ctx = workload.input_tokens + workload.output_tokens
    bd = fit_device(spec, device, FitRequest(n_ctx=n_ctx), search=False).breakdown
    note = mapped_note(bd)
    return {"resident_bytes": bd.resident_bytes, "mapped_bytes": bd.mapped_bytes,
            "note": None if note is None else f"the budget counts {fmt_bytes(bd.resident_bytes)} resident; {note}"}


def run(args: argparse.Namespace) -> int:
    from localinfer.plan.planner import UNKNOWN, plan_dict
    from localinfer.report.plan import prefix_note, render_text, split_speed_unknown, unknown_reasons

    spec, speed, p = build(args)
    memory = _memory(spec, speed.device, p.workload)
    if args.json:
        out = plan_dict(p)
        unknown = split_speed_unknown(speed) if p.best is None else None
        if unknown:       # the text's line, and the reasons pointing to it instead of a bench --json
            out["speed_unknown"] = unknown
            out["reasons"] = unknown_reasons(p, "fits, speed unknown: see speed_unknown")
        note = prefix_note(speed, p.workload)
        if note:
            out["shared_prefix_note"] = note
        out.update(model=spec.name, device=speed.device.name, memory=memory)
        if getattr(speed, "placement", None) is not None:
            out["split_placement"] = speed.placement.to_dict()
        print(json.dumps(out, indent=2))
    else:
        print(render_text(spec, speed, p))
        if getattr(speed, "placement", None) is not None:
            print("\n".join(speed.placement.lines()))
        if memory["note"]:
            print(f"memory: {memory['note']}")
    infeasible = p.best is None and not any(o.verdict == UNKNOWN for o in p.outcomes)
    return 1 if infeasible else 0
