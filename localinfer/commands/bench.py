"""`localinfer bench [MODEL]`: prefill/decode speed, TTFT/ITL, memory and bandwidth per KV type.

``--batch-sizes 1,2,4,8`` adds batch scaling through the serving engine (:mod:`localinfer.serve.bench`):
tok/s at each batch beside the bytes read per output token, d(b, L) = D_w/b + L·k (docs/speed.md).
Prints a table; ``--json FILE`` also writes versioned results (schema in
:mod:`localinfer.generation.bench`) that capacity reports calibrate their speed model with.
"""

from __future__ import annotations

import argparse
import json
import sys

from localinfer.commands import _common


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or any(v < 0 or v > 1 << 20 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers in 0..{1 << 20}, got {text!r}")
    return values


def _kv_list(text: str) -> tuple[str, ...]:
    from localinfer.backends.engine import KV_TYPES

    values = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [v for v in values if v not in KV_TYPES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"unknown KV type(s) {', '.join(bad) or text!r}; use {', '.join(KV_TYPES)}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from localinfer.generation.bench import BATCH_SIZES, DEPTHS, GEN_TOKENS, KV_TYPES, PROMPT_LENGTHS

    _common.add_model_args(parser, kv_choices=False)
    parser.add_argument("--kv", type=_kv_list, default=KV_TYPES, metavar="LIST",
                        help=f"KV cache types to compare (default: {','.join(KV_TYPES)})")
    parser.add_argument("--prompt-lengths", type=_ints, default=PROMPT_LENGTHS, metavar="LIST",
                        help=f"prefill lengths (default: {','.join(map(str, PROMPT_LENGTHS))})")
    parser.add_argument("--depths", type=_ints, default=DEPTHS, metavar="LIST",
                        help=f"context depths for decode (default: {','.join(map(str, DEPTHS))})")
    parser.add_argument("--gen", type=int, default=GEN_TOKENS, metavar="N", help="tokens generated per decode run")
    parser.add_argument("--repeats", type=int, default=1, metavar="N", help="runs per measurement; the best counts")
    parser.add_argument("--lookup", action="store_true", help="also measure prompt-lookup decoding")
    parser.add_argument("--batch-sizes", type=_ints, default=(), metavar="LIST",
                        help=f"also measure batch scaling through the serving engine: this many requests decoding "
                             f"together, at each --depths, first --kv type (e.g. {','.join(map(str, BATCH_SIZES))})")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE ('-': stdout)")


def run(args: argparse.Namespace) -> int:
    from localinfer.backends.registry import load_engine
    from localinfer.errors import UsageError
    from localinfer.generation.bench import BenchConfig, Progress, render_table, results, run_bench
    from localinfer.util.atomic import atomic_write, check_writable

    if not 1 <= args.gen <= 1 << 16:
        raise UsageError(f"--gen {args.gen} is out of range", flag="--gen", hint="use 1..65536")
    if not 1 <= args.repeats <= 100:
        raise UsageError(f"--repeats {args.repeats} is out of range", flag="--repeats", hint="use 1..100")
    if any(n < 1 for n in args.prompt_lengths):
        raise UsageError("prompt lengths must be at least 1", flag="--prompt-lengths")
    _check_batches(args)
    if args.json and args.json != "-":
        from localinfer.model.sources import resolve_model

        check_writable(args.json, inputs=[resolve_model(args.model)])  # before minutes of measuring
    config = BenchConfig(prompt_lengths=args.prompt_lengths, depths=args.depths, gen_tokens=args.gen,
                         kv_types=args.kv, repeats=args.repeats, lookup=args.lookup)
    path, spec = _common.read_spec(args)
    backend = _common.backend_name(args)
    n_ctx = args.ctx or config.n_ctx_needed
    if n_ctx < config.n_ctx_needed:
        raise UsageError(f"--ctx {n_ctx} is shorter than the {config.n_ctx_needed} tokens these lengths need",
                         flag="--ctx", hint="drop --ctx or use shorter --prompt-lengths/--depths")
    if spec.n_ctx_train and n_ctx > spec.n_ctx_train and not args.force:
        raise UsageError(f"these lengths need a {n_ctx}-token context; the model was trained on {spec.n_ctx_train}",
                         flag="--prompt-lengths", hint="use shorter --prompt-lengths/--depths (or --force)")
    device_name, peak = _local_device()
    args.ctx = n_ctx
    plans = {kv: _common.plan_from(args, path, spec, type_k=kv, type_v=kv) for kv in config.kv_types}
    for plan in plans.values():
        _common.check_fit(spec, plan, backend, args.force)
    batch_plan = None
    if args.batch_sizes:
        from localinfer.serve.bench import batch_plan as widen

        batch_plan = widen(plans[config.kv_types[0]], args.batch_sizes, config.depths, config.gen_tokens)
        _common.check_fit(spec, batch_plan, backend, args.force)

    def load(type_k: str, type_v: str, _n_ctx: int):
        return load_engine(plans[type_k], backend)

    steps = len(config.kv_types) * (len(config.prompt_lengths) + len(config.depths) + int(config.lookup))
    progress = Progress(steps + len(args.batch_sizes) * len(config.depths))
    runs = run_bench(str(path), load, config, progress=progress, peak_bandwidth=peak)
    batch_scaling = None
    if batch_plan is not None:
        from localinfer.model.cost import model_cost
        from localinfer.serve.bench import run_batch_scaling

        batch_scaling = run_batch_scaling(batch_plan, model_cost(spec), config.kv_types[0], args.batch_sizes,
                                          config.depths, config.gen_tokens, repeats=config.repeats,
                                          peak_bandwidth=peak, progress=progress)
    first = next(iter(plans.values()))
    settings = {"n_ctx": n_ctx, "threads": first.threads, "n_batch": first.n_batch, "n_ubatch": first.n_ubatch,
                "gen_tokens": config.gen_tokens, "repeats": config.repeats,
                "prompt_lengths": list(config.prompt_lengths), "depths": list(config.depths), "lookup": config.lookup,
                "batch_sizes": list(args.batch_sizes)}
    doc = results(str(path), spec, backend, _backend_version(backend), settings, runs, device_name, peak,
                  batch_scaling)
    text = json.dumps(doc, indent=1)
    if args.json == "-":
        print(text)
        return 0
    print(render_table(doc))
    if args.json:
        atomic_write(args.json, text + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def _check_batches(args: argparse.Namespace) -> None:
    """--batch-sizes: whole numbers 1..256, at least one decode step per request, on the llama.cpp engine."""
    from localinfer.errors import UsageError

    if not args.batch_sizes:
        return
    if any(not 1 <= b <= 256 for b in args.batch_sizes):
        raise UsageError("batch sizes must lie in 1..256", flag="--batch-sizes", hint="e.g. --batch-sizes 1,2,4,8")
    if args.gen < 2:
        raise UsageError("batch scaling needs --gen 2 or more (a decode step after the prefill)", flag="--gen")
    if _common.backend_name(args) != "llama.cpp":
        raise UsageError("--batch-sizes runs on the llama.cpp serving engine", flag="--backend",
                         hint="drop --backend, or drop --batch-sizes")


def _local_device() -> tuple[str, float | None]:
    """This machine's profile name and peak bandwidth (None when unknown)."""
    try:
        from localinfer.devices.profiles import local_device
    except ImportError:
        return "this machine", None
    dev = local_device()
    return dev.display_name, dev.bandwidth_bytes_per_s


BACKEND_PACKAGES = {"llama.cpp": ("llama-cpp-python",), "torch": ("torch",), "mlx": ("mlx", "mlx-lm")}


def _backend_version(backend: str) -> str:
    """The installed packages behind a backend, e.g. "mlx 0.32.4, mlx-lm 0.32.2" ("unknown" when none is found)."""
    from importlib import metadata

    found = []
    for name in BACKEND_PACKAGES.get(backend, ()):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found) or "unknown"
