"""`localinfer replay TRACE`: run a request trace through the scheduler on a simulated clock.

    localinfer replay trace.json --policy chunked --max-running 2 --chunk 2048 --token-budget 4096 \\
        --step-model 26.22,30.4,3 [--json] [--html timeline.html]

The trace is a JSON list (or JSON Lines) of {"id", "arrival_ms", "input", "output"} with optional
"prefix" + "prefix_len" and "deadline_ms".  Steps take fixed + per-token + per-causal-pair time
(--step-model), or what a device profile predicts for a model (--device NAME --model GGUF).
"""

from __future__ import annotations

import argparse
import json
from html import escape

from localinfer.errors import UsageError

DEFAULT_STEP_MODEL = "26.22,30.4,3"   # ms, µs/token, ns/pair: a Qwen3-8B BF16 fit on an RTX PRO 6000


def add_arguments(p: argparse.ArgumentParser) -> None:
    from localinfer.plan.paging import DEFAULT_BLOCK_TOKENS
    from localinfer.serve.scheduler import ADMISSIONS, POLICIES, SchedulerConfig

    d = SchedulerConfig()
    p.add_argument("trace", metavar="TRACE", help="JSON list or JSON Lines of requests")
    s = p.add_argument_group("scheduling")
    s.add_argument("--policy", choices=POLICIES, default=None, help=f"batching policy (default {d.policy})")
    s.add_argument("--max-running", type=int, default=None, metavar="N",
                   help=f"requests holding a slot at once (default {d.max_running})")
    s.add_argument("--chunk", type=int, default=None, metavar="C",
                   help=f"chunked: most prompt tokens per request per step (default {d.chunk_tokens})")
    s.add_argument("--token-budget", type=int, default=None, metavar="B", help="most new tokens per step (default: no limit)")
    s.add_argument("--itl-target", type=float, default=None, metavar="MS",
                   help="chunked: the largest chunk predicted to keep a step under MS milliseconds")
    s.add_argument("--max-gap", type=float, default=None, metavar="MS",
                   help="chunked: while requests decode, prompt chunks are cut so that each step, and so every "
                        "stream's gap between tokens, is predicted to take at most MS milliseconds")
    s.add_argument("--admission", choices=ADMISSIONS, default=None,
                   help=f"reserve input + max output blocks up front, or allocate on demand and preempt "
                        f"(default {d.admission})")
    s.add_argument("--deadline-aware", action="store_true", help="refuse requests predicted to miss their deadline")
    s.add_argument("--drop-late", action="store_true", help="stop a request once its deadline has passed")
    m = p.add_argument_group("step time and memory")
    m.add_argument("--step-model", default=None, metavar="FIXED_MS,PER_TOKEN_US,PER_PAIR_NS",
                   help=f"step = fixed + per new token + per causal pair (default {DEFAULT_STEP_MODEL})")
    m.add_argument("--device", default=None, metavar="NAME", help="predict steps with this device profile (needs --model)")
    m.add_argument("--model", default=None, metavar="GGUF", help="model for --device and for KV bytes (header only)")
    m.add_argument("--kv-budget", default=None, metavar="SIZE",
                   help="KV pool, e.g. 12GiB (needs --model; default: room for the --max-running largest requests)")
    m.add_argument("--block", type=int, default=None, metavar="P",
                   help=f"tokens per KV block (default {DEFAULT_BLOCK_TOKENS})")
    m.add_argument("--prefix-cached", action="store_true", help="named prefixes are in the prefix cache at the start")
    h = p.add_argument_group("hybrid models (a recurrent state: prefix hits only from a snapshot)")
    h.add_argument("--state-size", default=None, metavar="SIZE",
                   help="recurrent state per sequence (e.g. 75.4MiB; default with --model: the model's own), which "
                        "turns snapshot modelling on")
    h.add_argument("--snapshot-stride", type=int, default=None, metavar="N",
                   help="a prompt's state saved every N tokens, and at each prompt's and reply's last whole block "
                        "(default 1024; 0: at those ends only)")
    h.add_argument("--state-bandwidth", type=float, default=32.0, metavar="GB/S",
                   help="a snapshot's save and restore speed (default 32: PCIe Gen4 x16 one way)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the result as JSON")
    o.add_argument("--html", default=None, metavar="FILE", help="write the timeline as an HTML page")


def _config(args):
    from localinfer.serve.scheduler import SchedulerConfig

    for flag, value in (("--chunk", args.chunk), ("--itl-target", args.itl_target), ("--max-gap", args.max_gap)):
        if value is not None and args.policy != "chunked":
            raise UsageError(f"{flag} applies to chunked prefill only", flag=flag, hint="add --policy chunked")
    kw = {k: v for k, v in (("policy", args.policy), ("max_running", args.max_running), ("chunk_tokens", args.chunk),
                            ("token_budget", args.token_budget), ("admission", args.admission)) if v is not None}
    if args.itl_target is not None:
        kw["itl_target_s"] = args.itl_target / 1e3
    if args.max_gap is not None:
        kw["max_gap_s"] = args.max_gap / 1e3
    return SchedulerConfig(deadline_aware=args.deadline_aware, drop_late=args.drop_late, **kw)


def _step_model_and_kv(args):
    """(step model, its one-line description, KV bytes per token or None, the --model's spec or None)."""
    from localinfer.serve.step_model import LinearStepModel, SpeedStepModel

    if args.step_model is not None and args.device is not None:
        raise UsageError("--step-model and --device are alternatives", flag="--step-model",
                         hint="give coefficients, or a device profile with --model")
    spec = None
    if args.model is not None or args.device is not None:
        from localinfer.generation.load import open_model

        if args.model is None:
            raise UsageError("--device needs --model GGUF to predict step times", flag="--device",
                             hint="add --model FILE (a skeleton from `localinfer skeleton` works)")
        spec = open_model(args.model).spec
    k = None
    if spec is not None:
        from localinfer.model.kv import kv_bytes_per_token

        k = kv_bytes_per_token(spec)
    if args.device is not None:
        from localinfer.devices.profiles import get_device
        from localinfer.model.cost import model_cost
        from localinfer.plan.speed import SpeedModel

        return SpeedStepModel(SpeedModel(model_cost(spec), get_device(args.device))), f"device {args.device}", k, spec
    text = args.step_model or DEFAULT_STEP_MODEL
    lin = LinearStepModel.parse(text)
    desc = f"{lin.fixed_s * 1e3:g} ms + {lin.per_token_s * 1e6:g} µs/token + {lin.per_pair_s * 1e9:g} ns/pair"
    return lin, desc, k, spec


def _kv_blocks(args, k, block):
    if args.kv_budget is None:
        return None
    if k is None:
        raise UsageError("--kv-budget needs --model GGUF for the KV bytes per token", flag="--kv-budget",
                         hint="add --model FILE, or drop --kv-budget for an unbounded pool")
    from localinfer.plan.paging import blocks_in_budget
    from localinfer.units import parse_size

    try:
        budget = parse_size(args.kv_budget)
    except ValueError as exc:
        raise UsageError(f"--kv-budget: {exc}", flag="--kv-budget") from None
    return blocks_in_budget(budget, k, block)


def _snapshots(args, spec):
    """(recurrent state bytes per sequence, snapshot policy): from --state-size, else the --model's (``spec``)
    recurrent state; (0, None) for an attention-only model."""
    from localinfer.plan.paging import DEFAULT_BLOCK_TOKENS
    from localinfer.serve.snapshots import DEFAULT_STRIDE, SnapshotPolicy

    if not args.state_bandwidth > 0:
        raise UsageError(f"--state-bandwidth must be positive, got {args.state_bandwidth}", flag="--state-bandwidth")
    state = 0
    if args.state_size is not None:
        from localinfer.units import parse_size

        try:
            state = parse_size(args.state_size)
        except ValueError as exc:
            raise UsageError(f"--state-size: {exc}", flag="--state-size") from None
    elif spec is not None:
        from localinfer.model.kv import recurrent_state_bytes

        state = recurrent_state_bytes(spec) if spec.has_recurrent else 0
    if args.snapshot_stride is not None and (args.snapshot_stride < 0 or not state):
        raise UsageError("--snapshot-stride needs a recurrent state: a hybrid --model or --state-size, and N >= 0",
                         flag="--snapshot-stride", hint="e.g. --state-size 75.4MiB --snapshot-stride 4096")
    stride = DEFAULT_STRIDE if args.snapshot_stride is None else args.snapshot_stride
    block = DEFAULT_BLOCK_TOKENS if args.block is None else args.block
    if stride % max(block, 1):
        raise UsageError(f"--snapshot-stride {stride} is not a whole number of {block}-token KV blocks: snapshots "
                         "are keyed by whole blocks", flag="--snapshot-stride",
                         hint=f"use a multiple of {block}, or a --block that divides {stride}")
    return state, SnapshotPolicy(stride=stride) if state else None


def run(args: argparse.Namespace) -> int:
    from localinfer.plan.paging import DEFAULT_BLOCK_TOKENS
    from localinfer.serve.replay import load_trace, replay

    if args.html:
        from localinfer.util.atomic import check_writable

        check_writable(args.html)
    trace = load_trace(args.trace)
    config = _config(args)
    model, desc, k, spec = _step_model_and_kv(args)
    block = DEFAULT_BLOCK_TOKENS if args.block is None else args.block
    if block < 1:
        raise UsageError(f"--block must be ≥ 1, got {block}", flag="--block")
    state, policy = _snapshots(args, spec)
    result = replay(trace, config, model, block_tokens=block, kv_blocks=_kv_blocks(args, k, block),
                    kv_bytes_per_token=k, prefix_cached=args.prefix_cached, state_bytes=state,
                    snapshot_policy=policy, state_bandwidth=args.state_bandwidth * 1e9)
    if args.html:
        from localinfer.util.atomic import atomic_write

        atomic_write(args.html, render_html(result, config, desc))
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
    else:
        print(render_text(result, config, desc))
    return 0


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def render_text(result, config, desc: str) -> str:
    from gguf_tools.text import safe_text

    head = ("id", "arrival", "queue", "ttft", "finish", "max gap", "out", "preempt", "reason")
    rows = [(safe_text(r.id)[:24], _ms(r.arrival_s), _ms(r.queue_s), _ms(r.ttft_s), _ms(r.finished_s),
             _ms(r.max_gap_s if len(r.output) > 1 else None), str(len(r.output)), str(r.preemptions),
             r.finish_reason.value + ("" if r.on_time or r.deadline_s is None else " (late)"))
            for r in result.requests]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    s = result.summary()
    f = (lambda v, d=1: "-" if v is None else f"{v:.{d}f}")
    lines = [f"policy {config.policy}, max running {config.max_running}, step {desc} (times in ms)", fmt(head)]
    lines += [fmt(r) for r in rows]
    lines += [f"{safe_text(r.id)[:24]}: {safe_text(r.error)}" for r in result.requests if r.error]
    kv = "" if result.peak_kv_bytes is None else f" = {result.peak_kv_bytes / 2**20:.1f} MiB"
    pre, redo = sum(r.preemptions for r in result.requests), sum(r.recomputed for r in result.requests)
    lines += [
        (f"makespan {f(s['makespan_ms'])} ms; throughput {f(s['throughput_tok_s'])} output tok/s; "
         f"goodput {s['good_requests']}/{len(result.requests)} on time = {f(s['goodput_req_s'], 2)} req/s"),
        (f"TTFT p50 {f(s['ttft_p50_ms'])} ms, p95 {f(s['ttft_p95_ms'])} ms; "
         f"ITL p50 {f(s['itl_p50_ms'])} ms, p95 {f(s['itl_p95_ms'])} ms"),
        (f"peak running {result.peak_running}; peak KV {result.blocks.peak_used} blocks of "
         f"{result.blocks.block_tokens} tokens{kv}; {len(result.steps)} steps; {pre} preemptions, "
         f"{redo} tokens recomputed"),
    ]
    snaps = result.snapshot_summary()
    if snaps is not None:
        lines.append(f"snapshots: {snaps['taken']} saved, {snaps['restored']} restored, "
                     f"{snaps['recomputed_tokens']} matched tokens past the deepest one recomputed, "
                     f"{snaps['state_ms']:.1f} ms moving states")
    gaps = result.largest_gaps(3)
    if gaps:
        lines.append("largest gaps, and the steps in them:")
        lines += ["  " + safe_text(g.describe()) for g in gaps]
    return "\n".join(lines)


def render_html(result, config, desc: str) -> str:
    """A timeline: one row per request, a band per step it took part in (prefill or decode)."""
    width, row_h, left = 960, 22, 90
    total = max(result.total_s, 1e-9)
    x = (lambda t: left + t / total * (width - left - 10))
    rows = {r.id: i for i, r in enumerate(result.requests)}
    height = 40 + row_h * len(rows)
    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="11" '
              'font-family="sans-serif">')]
    for r in result.requests:
        y = 20 + rows[r.id] * row_h
        parts.append(f'<text x="4" y="{y + 14}">{escape(r.id[:12])}</text>')
        parts.append(f'<line x1="{x(r.arrival_s):.1f}" y1="{y}" x2="{x(r.arrival_s):.1f}" y2="{y + row_h - 4}" '
                     'stroke="#999"/>')
    for st in result.steps:
        for rid, start, n in st.chunks:
            y = 20 + rows[rid] * row_h
            color = "#1f77b4" if n > 1 else "#2ca02c"
            parts.append(f'<rect x="{x(st.start_s):.1f}" y="{y + 2}" width="{max(x(st.end_s) - x(st.start_s) - 0.5, 0.5):.1f}" '
                         f'height="{row_h - 8}" fill="{color}"><title>{escape(rid)}: {n} tokens from {start}, '
                         f'{(st.end_s - st.start_s) * 1e3:.1f} ms</title></rect>')
    parts.append(f'<text x="{left}" y="{height - 4}">0 ms</text><text x="{width - 60}" y="{height - 4}">'
                 f'{total * 1e3:.0f} ms</text></svg>')
    title = escape(f"replay: {config.policy}, max running {config.max_running}, {desc}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
            f"<h1>{title}</h1><p>blue: prompt (prefill) chunks; green: decode steps; grey: arrival</p>"
            f"{''.join(parts)}<pre>{escape(render_text(result, config, desc))}</pre></body></html>")
