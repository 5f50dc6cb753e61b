"""`localinfer report`: the cross-device capacity and speed matrix.

    localinfer report a.gguf b.gguf --devices rtx-pro-6000,m2-max-96gb --ctx 2048,8192,32768 \\
        --kv f16,q8_0,q4_0 --format html -o report.html
"""

from __future__ import annotations

import argparse
import sys

from localinfer.errors import UsageError

FORMATS = ("text", "md", "json", "html")
DEFAULT_CTX = "2048,8192,32768"
DEFAULT_KV = "f16,q8_0,q4_0"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="*", metavar="MODEL", help="GGUF files or skeletons (default: the embedded model)")
    p.add_argument("--devices", default=None, metavar="NAMES",
                   help="comma-separated profiles (default: this machine and every profile); 'local' is this machine")
    p.add_argument("--ctx", default=DEFAULT_CTX, metavar="N,N,...", help=f"contexts per request (default {DEFAULT_CTX})")
    p.add_argument("--kv", default=DEFAULT_KV, metavar="TYPES", help=f"KV types (default {DEFAULT_KV})")
    p.add_argument("--format", default="text", choices=FORMATS, help="output format (default text)")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="write here (atomically) instead of stdout")
    p.add_argument("--bench", action="append", default=[], metavar="[DEVICE=]FILE",
                   help="measurements for a device (default: this machine), from `localinfer bench --json` "
                        "or llama-bench; shown against the predictions (repeatable)")
    g = p.add_argument_group("across hosts (llama.cpp RPC): text, md and json")
    g.add_argument("--split", default=None, metavar="HOSTS",
                   help="also each model split over these hosts, this machine first (fit --devices' syntax)")
    g.add_argument("--link", default=None, metavar="NAME", help="network between them: loopback, 1gbe, 10gbe, "
                                                                "thunderbolt")
    g = p.add_argument_group("feasibility map (html): the middle --ctx as each request's input")
    g.add_argument("--requests", type=int, default=16, metavar="N", help="requests arriving together (default 16)")
    g.add_argument("--output-tokens", type=int, default=256, metavar="G", help="output tokens each (default 256)")
    g.add_argument("--deadline", type=float, default=7.0, metavar="S", help="deadline in seconds (default 7)")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated whole numbers, got {text!r}", flag=flag) from None
    if not vals or any(not 1 <= v <= 1 << 24 for v in vals):
        raise UsageError(f"{flag} values must be from 1 to {1 << 24}", flag=flag)
    return tuple(sorted(set(vals)))


def build(args: argparse.Namespace):
    """The Report for the parsed arguments."""
    from localinfer.devices.profiles import all_devices, get_device, load_profiles
    from localinfer.generation.load import open_model
    from localinfer.model.cost import kv_pair
    from localinfer.plan.bench_import import load_bench
    from localinfer.plan.speed import Workload
    from localinfer.report.capacity import build_report

    contexts = _ints(args.ctx, "--ctx")
    kv_types = tuple(dict.fromkeys(t.strip() for t in args.kv.split(",") if t.strip()))
    if not kv_types:
        raise UsageError("--kv needs at least one KV type", flag="--kv")
    for t in kv_types:
        kv_pair(t, "--kv")  # its message already names --kv
    specs = [open_model(m).spec for m in (args.models or [None])]
    if args.devices:
        profiles = load_profiles()
        names = [n.strip() for n in args.devices.split(",") if n.strip()]
        devices = [get_device(n, profiles) for n in names]
    else:
        devices = all_devices()
    calibrations = {}
    names = {d.name for d in devices}
    for item in args.bench:
        name, _, path = item.rpartition("=")
        name = name or "local"
        if name not in names:
            raise UsageError(f"--bench names device {name!r}, which is not in this report",
                             flag="--bench", hint="use DEVICE=FILE with a device from --devices")
        calibrations[name] = load_bench(path)
    middle = contexts[len(contexts) // 2]
    workload = Workload(args.requests, middle, args.output_tokens, deadline_s=args.deadline)
    return build_report(specs, devices, contexts, kv_types, calibrations=calibrations,
                        plots=args.format == "html", workload=workload)


def with_splits(args: argparse.Namespace, text: str) -> str:
    """The report plus one row per model × context × KV type split over ``--split``'s hosts: the request's verdict,
    the plan ``fit --devices`` recommends (:func:`localinfer.plan.split_fit.plan_split`) and its speed, and
    llama.cpp ``--fit``'s."""
    import json

    from localinfer.backends.memory import FitRequest
    from localinfer.devices.links import get_link
    from localinfer.generation.load import open_model
    from localinfer.plan import split_devices
    from localinfer.plan.split_fit import plan_split, split_env
    from localinfer.report.split import render_split_rows

    setup = split_devices.from_profiles(args.split)
    env, host_usable = split_env(setup, get_link(args.link) if args.link else None)
    rows = []
    for m in args.models or [None]:
        spec = open_model(m).spec
        for ctx in _ints(args.ctx, "--ctx"):
            for kv in (t.strip() for t in args.kv.split(",") if t.strip()):
                req = FitRequest(n_ctx=ctx, type_k=kv, type_v=kv, flash_attn=True if kv != "f16" else None)
                # the row's KV type stays (one row per --kv): fit --devices --kv-type KV's plan
                sf, plan, ref = plan_split(spec, env, req, host_usable, other_kv=False)
                rows.append({"model": spec.name, "ctx": ctx, "kv": kv, **sf.to_dict(),
                             "plan": None if plan is None else plan.to_dict(),
                             "llamacpp_fit": None if ref is None else ref.to_dict()})
    if args.format == "json":
        doc = json.loads(text)
        doc["splits"] = {"hosts": args.split, "link": args.link, "rows": rows}
        return json.dumps(doc, indent=1)
    return text.rstrip("\n") + "\n\n" + render_split_rows(args.split, args.link, rows, args.format == "md")


def render(report, fmt: str) -> str:
    """The report in one of FORMATS."""
    from localinfer.report.capacity import render_json, render_md, render_text

    if fmt == "html":
        from localinfer.report.html import render_html

        return render_html(report)
    return {"text": render_text, "md": render_md, "json": render_json}[fmt](report)


def run(args: argparse.Namespace) -> int:
    from localinfer.util.atomic import atomic_write, check_writable

    if args.output:
        from localinfer.model.sources import resolve_model

        check_writable(args.output, inputs=[resolve_model(m) for m in (args.models or [None])])
    if args.split and args.format == "html":
        raise UsageError("--split is rendered in text, md and json", flag="--split", hint="use --format md")
    if args.link and not args.split:
        raise UsageError("--link sets the network of a --split", flag="--link", hint="add --split HOSTS")
    text = render(build(args), args.format)
    if args.split:
        text = with_splits(args, text)
    if args.output:
        atomic_write(args.output, text if text.endswith("\n") else text + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text)
    return 0
