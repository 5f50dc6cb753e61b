"""`localinfer bench [MODEL]`: prefill/decode speed, TTFT/ITL, memory and bandwidth per KV type;
`localinfer bench serve --url URL | MODEL`: load-test an OpenAI-compatible HTTP server.

``--batch-sizes 1,2,4,8`` adds batch scaling through the serving engine (:mod:`localinfer.loadgen.batch_scaling`):
tok/s at each batch beside the bytes read per output token, d(b, L) = D_w/b + L·k (docs/speed.md).
Prints a table; ``--json FILE`` also writes versioned results (schema in
:mod:`localinfer.generation.bench`) that capacity reports calibrate their speed model with.

``bench serve`` runs :mod:`localinfer.loadgen.load` (closed-loop concurrency levels, Poisson arrivals,
TTFT/ITL/e2e percentiles, goodput) against ``--url``, or against a ``localinfer serve MODEL`` it starts and
stops itself; ``benchmarks/serve_load.py`` takes the same flags (:func:`add_load_arguments`).  ``serve``
must come right after ``bench``; a file named ``serve`` in the current folder is still benchmarked as a
model unless ``--url`` is given (``bench ./serve`` is always the file).
"""

from __future__ import annotations

import argparse
import json
import os
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

    parser.epilog = "localinfer bench serve --help: load-test an OpenAI-compatible server instead"
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
    if getattr(args, "bench_form", None) == SERVE:
        return run_serve(args)
    from localinfer.backends.registry import load_engine
    from localinfer.errors import UsageError
    from localinfer.generation.bench import BenchConfig, Progress, render_table, results, run_bench
    from localinfer.util.atomic import check_writable

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
        from localinfer.loadgen.batch_scaling import batch_plan as widen

        batch_plan = widen(plans[config.kv_types[0]], args.batch_sizes, config.depths, config.gen_tokens)
        _common.check_fit(spec, batch_plan, backend, args.force)

    def load(type_k: str, type_v: str, _n_ctx: int):
        return load_engine(plans[type_k], backend)

    steps = len(config.kv_types) * (len(config.prompt_lengths) + len(config.depths) + int(config.lookup))
    progress = Progress(steps + len(args.batch_sizes) * len(config.depths))
    runs = run_bench(str(path), load, config, progress=progress, peak_bandwidth=peak, spec=spec)
    batch_scaling = None
    if batch_plan is not None:
        from localinfer.model.cost import model_cost
        from localinfer.loadgen.batch_scaling import run_batch_scaling

        batch_scaling = run_batch_scaling(batch_plan, model_cost(spec), config.kv_types[0], args.batch_sizes,
                                          config.depths, config.gen_tokens, repeats=config.repeats,
                                          peak_bandwidth=peak, progress=progress)
    first = next(iter(plans.values()))
    settings = {"n_ctx": n_ctx, "threads": first.threads, "n_batch": first.n_batch, "n_ubatch": first.n_ubatch,
                "gen_tokens": config.gen_tokens, "repeats": config.repeats,
                "prompt_lengths": list(config.prompt_lengths), "depths": list(config.depths), "lookup": config.lookup,
                "batch_sizes": list(args.batch_sizes),
                **{k: list(v) for k, v in first.options.items() if k in ("rpc", "tensor_split")}}   # a split run
    doc = results(str(path), spec, backend, _backend_version(backend), settings, runs, device_name, peak,
                  batch_scaling)
    return _emit(doc, render_table, args.json)


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


# --- bench serve: the load generator -----------------------------------------------------------------------

SERVE = "serve"


def serve_requested(rest: list[str]) -> bool:
    """Whether ``bench REST...`` means ``bench serve``: ``serve`` right after ``bench``, and no file of that name
    here (a model file named ``serve`` stays a model) unless ``--url`` says a server is meant."""
    words = [a for a in rest if a != "--debug"]
    if not words or words[0] != SERVE:
        return False
    return any(a == "--url" or a.startswith("--url=") for a in words) or not os.path.isfile(SERVE)


def arguments_for(rest: list[str]):
    """The flags of the form ``rest`` (the arguments after ``bench``) asks for; the CLI calls this."""
    return add_serve_arguments if serve_requested(rest) else add_arguments


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("load-test an OpenAI-compatible server: closed-loop concurrency levels and Poisson "
                          "arrivals; TTFT, ITL, end-to-end p50/p95/p99, tok/s, req/s and goodput")
    parser.add_argument("bench_form", choices=[SERVE], metavar="serve", help="measure an HTTP server")
    add_load_arguments(parser)
    parser.add_argument("--json", "--out", dest="json", metavar="FILE", help="write the results as JSON to FILE "
                        "('-': stdout instead of the table)")


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The load generator's flags (``bench serve`` and benchmarks/serve_load.py), defaults from LoadConfig."""
    from localinfer.loadgen.load import LoadConfig

    d = LoadConfig()
    join = lambda xs: ",".join(f"{x:g}" for x in xs)
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="start `localinfer serve MODEL` and measure it (default: the embedded model)")
    g = parser.add_argument_group("server")
    g.add_argument("--url", help="base URL of a running OpenAI-compatible server, e.g. http://127.0.0.1:8080/v1")
    g.add_argument("--label", default=None, help="name of the server in the JSON (default: the URL)")
    g.add_argument("--model-name", default=None, help="model field to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None, metavar="KEY", help="bearer token (default: $LOCALINFER_API_KEY)")
    g.add_argument("--timeout", type=float, default=d.timeout, metavar="S", help="per-request timeout (default %(default)gs)")
    g = parser.add_argument_group("load")
    g.add_argument("--concurrency", default=join(d.concurrency), metavar="LIST",
                   help=f"closed-loop levels (comma list; '' for none; default {join(d.concurrency)})")
    g.add_argument("--rate", default=join(d.rate), metavar="LIST",
                   help="open-loop Poisson arrival rates in requests/s (comma list)")
    g.add_argument("--requests", type=int, default=d.requests, metavar="N", help="requests per level (default %(default)s)")
    g.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, metavar="N", help="words per prompt (default %(default)s)")
    g.add_argument("--output-tokens", type=int, default=d.output_tokens, metavar="N", help="tokens per reply, EOS ignored (default %(default)s)")
    g.add_argument("--shared-prefix", type=int, default=d.shared_prefix, metavar="N",
                   help="words shared by every prompt")
    g.add_argument("--slo-ttft", type=float, default=d.slo_ttft, metavar="S", help="goodput's TTFT limit (default %(default)g)")
    g.add_argument("--slo-e2e", type=float, default=d.slo_e2e, metavar="S", help="goodput's end-to-end limit (default %(default)g)")
    g.add_argument("--deadline-ms", type=float, default=None, metavar="MS",
                   help="send this deadline (localinfer's deadline_ms field and x-localinfer-deadline-ms header)")
    g.add_argument("--extra-body", default=None, metavar="JSON", help="a JSON object merged into every request")
    g.add_argument("--seed", type=int, default=d.seed, help="prompt and arrival seed (default %(default)s)")
    g = parser.add_argument_group("with MODEL (the server started)")
    g.add_argument("--threads", type=int, default=2, metavar="N", help="serve -t (default 2)")
    g.add_argument("--ctx", type=int, default=4096, metavar="N", help="total KV context (default 4096)")
    g.add_argument("--parallel", type=int, default=8, metavar="N", help="serve --parallel (default 8)")
    g.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                   help="extra flag for serve, e.g. --serve-arg=--prefix-cache=off (repeatable)")


def _list(text: str, flag: str, kind) -> tuple:
    from localinfer.errors import UsageError

    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a comma list of {'whole ' if kind is int else ''}numbers",
                         flag=flag, hint=f"e.g. {flag} {'1,4,8' if kind is int else '0.5,1'}") from None


def load_config(args: argparse.Namespace):
    """A checked LoadConfig from the load flags (UsageError naming the flag)."""
    from localinfer.commands.serve import API_KEY_ENV
    from localinfer.errors import UsageError
    from localinfer.loadgen.load import LoadConfig

    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except ValueError:
            extra = None
        if not isinstance(extra, dict):
            raise UsageError("--extra-body is not a JSON object", flag="--extra-body", hint='e.g. {"min_tokens": 128}')
    return LoadConfig(concurrency=_list(args.concurrency, "--concurrency", int), rate=_list(args.rate, "--rate", float),
                      requests=args.requests, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                      shared_prefix=args.shared_prefix, slo_ttft=args.slo_ttft, slo_e2e=args.slo_e2e,
                      deadline_ms=args.deadline_ms, timeout=args.timeout, seed=args.seed, model_name=args.model_name,
                      extra_body=extra, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)


def serve_document(args: argparse.Namespace, progress=None) -> dict:
    """Check the flags (and that ``args.json`` can be written), start ``localinfer serve MODEL`` unless ``--url``
    is given, run every level and return the JSON document (see :mod:`localinfer.loadgen.load`)."""
    from localinfer.errors import UsageError
    from localinfer.loadgen import load as loadgen
    from localinfer.util.atomic import check_writable

    config = load_config(args)
    if args.url is not None and args.model is not None:
        raise UsageError(f"give --url URL or MODEL, not both (got {args.model})", flag="--url",
                         hint="drop MODEL to measure the running server, or --url to start localinfer serve MODEL")
    url = loadgen.check_url(args.url) if args.url is not None else None
    if args.model is not None:
        from localinfer.model.sources import resolve_model

        resolve_model(args.model)                     # a missing file is refused before a server starts
    if args.json and args.json != "-":
        check_writable(args.json)                     # before minutes of measuring
    load_before = loadgen.loadavg()
    if url is None:
        from localinfer.loadgen.local_serve import LocalServe

        with LocalServe(args.model, threads=args.threads, ctx=args.ctx, parallel=args.parallel,
                        extra=args.serve_arg) as started:
            measured = loadgen.run_load(started, config, progress)
        url = started
    else:
        measured = loadgen.run_load(url, config, progress)
    settings = {"model": args.model, "url": args.url, "label": args.label, **config.settings(),
                "threads": args.threads, "ctx": args.ctx, "parallel": args.parallel, "serve_arg": args.serve_arg,
                "out": args.json, "metrics_url": loadgen.server_root(url) + "/metrics"}
    return loadgen.document(args.label or url, measured, settings, load_before)


def run_serve(args: argparse.Namespace) -> int:
    from localinfer.loadgen.load import ProgressBar, render_table

    doc = serve_document(args, progress=ProgressBar())
    return _emit(doc, render_table, args.json)


def _emit(doc: dict, render, json_path: str | None) -> int:
    """The table on stdout, and the JSON to ``json_path`` (written atomically; '-': stdout instead of the table)."""
    from localinfer.util.atomic import atomic_write

    text = json.dumps(doc, indent=1)
    if json_path == "-":
        print(text)
        return 0
    print(render(doc))
    if json_path:
        atomic_write(json_path, text + "\n")
        print(f"results written to {json_path}", file=sys.stderr)
    return 0
