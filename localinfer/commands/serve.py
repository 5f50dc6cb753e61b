"""`localinfer serve [MODEL]`: an OpenAI-compatible HTTP server on the serving engine.

    localinfer serve [MODEL] [--host 127.0.0.1] [--port 8080] [--parallel N] [--ctx N] [-ctk/-ctv T] [-t N]
        [--backend NAME] [--api-key KEY | --api-key-file FILE | LOCALINFER_API_KEY] [--max-queue N]
        [--token-budget N] [--chunk N | --itl-target MS] [--partial-slack F|off] [--decode-share F]
        [--prefix-cache on|off] [--parked N] [--lookup [--draft-max N]] [--allowed-origins O,...]
        [--strict-model-names] [--default-max-tokens N] [--header-timeout S] [--body-timeout S] [--keep-alive S]
        [--max-connections N] [--show-prompts]

Before anything is loaded the plan (``--ctx`` KV cells shared by ``--parallel``
sequences, one unified cache) goes through the same fit check as ``run``; a
plan that does not fit is refused with the flags that would.  The context then
gets ``--parked`` more sequence ids (default 32; the cache's size does
not change), whose finished requests' KV stays in host memory for later prefix
hits until the pool needs it (docs/serving.md).  Then the socket
is bound, ``/health`` answers 503 while the model loads in the engine thread
and 200 once it is ready.  A browser finds a chat page at ``/`` and the engine
view at ``/engine``.  The HTTP side is in ``localinfer/serve/http``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import threading

from localinfer.backends import registry
from localinfer.commands import _common
from localinfer.errors import UsageError

API_KEY_ENV = "LOCALINFER_API_KEY"



def add_arguments(parser: argparse.ArgumentParser) -> None:
    from localinfer.serve.http.config import DEFAULT_PARKED_RECURRENT
    from localinfer.serve.http.limits import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, KEEP_ALIVE_S, MAX_CONNECTIONS
    from localinfer.serve.speculation import DRAFT_MAX

    _common.add_model_args(parser)
    g = parser.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0: a free one)")
    g.add_argument("--parallel", "-np", type=int, default=4, metavar="N", help="requests decoded together (default 4)")
    g.add_argument("--api-key", default=None, metavar="KEY", help=f"require Authorization: Bearer KEY (or ${API_KEY_ENV})")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from the first line of FILE (kept out of the process list)")
    g.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    g.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also accept this Host header name (DNS-rebinding check: IP addresses, localhost, "
                        "*.localhost and this machine's name always pass; '*': any; repeatable)")
    g.add_argument("--allowed-origins", action="append", default=[], metavar="O,...",
                   help="browser origins (scheme://host:port) that may call the server, besides its own and "
                        "localhost's on any port; '*': any (other origins get 403; repeatable)")
    g.add_argument("--default-max-tokens", "--n-predict", type=int, default=None, metavar="N",
                   help="tokens a request that names no max_tokens may generate (default: until the context ends)")
    g.add_argument("--strict-model-names", action="store_true",
                   help="answer 404 to a model name that is not the model's file name or an --alias (default: "
                        "any name is served, as llama-server does)")
    g.add_argument("--header-timeout", type=float, default=None, metavar="S",
                   help=f"seconds a request's headers may take to arrive, then 408 (default {HEADER_TIMEOUT_S:g})")
    g.add_argument("--body-timeout", type=float, default=None, metavar="S",
                   help=f"seconds a request's body may take to arrive, then 408 (default {BODY_TIMEOUT_S:g})")
    g.add_argument("--keep-alive", type=float, default=None, metavar="S",
                   help=f"seconds an idle connection stays open between requests (default {KEEP_ALIVE_S:g})")
    g.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help=f"open connections at most; more are answered 503 (default {MAX_CONNECTIONS}, and below "
                        "the descriptor limit)")
    g.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting beyond --parallel before 429 (default 64)")
    g.add_argument("--token-budget", type=int, default=None, metavar="N",
                   help="most new tokens per step (default: -b, so a step is one llama_decode and decodes go on "
                        "while long prompts are chunked)")
    chunking = g.add_mutually_exclusive_group()
    chunking.add_argument("--chunk", type=int, default=None, metavar="N", help="prompt tokens per request per step")
    chunking.add_argument("--itl-target", type=float, default=None, metavar="MS",
                          help="prefill chunks sized to keep each step under MS milliseconds")
    g.add_argument("--max-gap", default=None, metavar="MS|off",
                   help="while requests decode, prompt chunks are cut so that every step, and so every stream's "
                        "wait for its next token, is predicted to take at most MS milliseconds (default off)")
    g.add_argument("--step-log", default=None, metavar="FILE",
                   help="append one JSON line per engine step to FILE: its time, prediction and chunks "
                        "(benchmarks/step_gaps.py names the steps behind each stream's largest gaps)")
    g.add_argument("--partial-slack", default=None, metavar="F|off",
                   help="a prompt chunk that does not finish its prompt joins a step that finishes another only if "
                        "it makes the step at most F longer, so each first token leaves with the step its own prompt "
                        "ends in (default 0.25; off: fill every step's budget)")
    g.add_argument("--decode-share", type=float, default=None, metavar="F",
                   help="after a step that prefills, decode-only steps take F of its prompt time before the next "
                        "prompt while requests decode, so closed-loop clients spread out instead of "
                        "queueing behind each other's prefills (default 0.05; 0: none)")
    g.add_argument("--prefix-cache", choices=("on", "off"), default="on", help="share KV of common prefixes (default on)")
    g.add_argument("--parked", type=int, default=None, metavar="N",
                   help="finished requests whose KV stays for later prefix hits, evicted as the pool needs it "
                        "(default 32; kept in host memory, all of them in at most 8 GiB or half the free RAM, "
                        "an earlier answer to a prompt sent again, then the least recently used, given up first; "
                        "0: none)")
    g.add_argument("--snapshot-stride", type=int, default=None, metavar="N",
                   help="hybrid and recurrent models: save the recurrent state every N prompt tokens (and at each "
                        "prompt's and reply's last whole block) so prefix hits can restore it (default 1024; 0: at "
                        f"prompt and reply ends only); parked ids default to {DEFAULT_PARKED_RECURRENT} on such models")
    g.add_argument("--lookup", action="store_true",
                   help="prompt-lookup speculative decoding: verify n-gram drafts inside the batched steps")
    g.add_argument("--draft-max", type=int, default=None, metavar="N",
                   help=f"with --lookup: most draft tokens per request and step (default {DRAFT_MAX})")
    g.add_argument("--alias", action="append", default=[], metavar="NAME", help="another model name to accept")
    g.add_argument("--max-body", type=int, default=4 << 20, metavar="BYTES", help="request body cap (default 4 MiB)")
    g.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default 10)")
    g.add_argument("--show-prompts", action="store_true",
                   help="the engine view (/engine, /v1/engine/state) shows prompt and output text (default: counts only)")
    g.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning")


def _check(args) -> str | None:
    """Validate the serving flags; the API key to use (None: no key)."""
    for flag, v, lo, hi in (("--port", args.port, 0, 65535), ("--parallel", args.parallel, 1, 256),
                            ("--max-queue", args.max_queue, 0, 1 << 20), ("--max-body", args.max_body, 1024, 1 << 30),
                            ("--parked", 0 if args.parked is None else args.parked, 0, 256),
                            ("--snapshot-stride", args.snapshot_stride or 0, 0, 1 << 24)):
        if not lo <= v <= hi:
            raise UsageError(f"{flag} {v} is out of range", flag=flag, hint=f"use {lo}..{hi}")
    for flag, v in (("--token-budget", args.token_budget), ("--chunk", args.chunk)):
        if v is not None and v < 1:
            raise UsageError(f"{flag} must be at least 1, got {v}", flag=flag)
    if args.itl_target is not None and not 0 < args.itl_target < 1e6:
        raise UsageError(f"--itl-target must be a positive number of milliseconds, got {args.itl_target}",
                         flag="--itl-target")
    _partial_slack(args.partial_slack)
    _max_gap(args.max_gap)
    if args.decode_share is not None and not 0 <= args.decode_share <= 100:
        raise UsageError(f"--decode-share must be a number in 0..100, got {args.decode_share}",
                         flag="--decode-share", hint="e.g. --decode-share 0.05, or 0 for none")
    if not 0 <= args.grace <= 3600:
        raise UsageError(f"--grace {args.grace} is out of range", flag="--grace", hint="use 0..3600 seconds")
    from localinfer.serve.speculation import check_draft_max

    if args.draft_max is not None:
        if not args.lookup:
            raise UsageError("--draft-max needs --lookup", flag="--draft-max", hint="add --lookup")
        check_draft_max(args.draft_max)
    for flag, v in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout),
                    ("--keep-alive", args.keep_alive)):
        if v is not None and not 0 < v <= 86400:
            raise UsageError(f"{flag} {v} is out of range", flag=flag, hint="use a number of seconds in (0, 86400]")
    if args.default_max_tokens is not None and not 1 <= args.default_max_tokens <= 1 << 24:
        raise UsageError(f"--default-max-tokens {args.default_max_tokens} is out of range",
                         flag="--default-max-tokens", hint="use 1..16777216")
    if args.max_connections is not None and not 1 <= args.max_connections <= 1 << 20:
        raise UsageError(f"--max-connections {args.max_connections} is out of range", flag="--max-connections",
                         hint="use 1..1048576")
    key = _api_key(args)
    if key is not None and (not key.strip() or any(c.isspace() for c in key)):
        raise UsageError("the API key must be non-empty and contain no spaces", flag="--api-key")
    if key is not None and not (key.isascii() and key.isprintable()):
        raise UsageError("--api-key: the API key must be printable ASCII: an HTTP Authorization header cannot "
                         "carry other characters, so no client could send it", flag="--api-key")
    if not _loopback(args.host):
        if key is None and not args.insecure:
            raise UsageError(f"--host {args.host} is reachable from other machines and no API key is set",
                             flag="--host", hint=f"set --api-key KEY (or ${API_KEY_ENV}), or pass --insecure")
        if key is None:
            print(f"warning: serving on {args.host} without an API key: anyone who can reach it can use it",
                  file=sys.stderr)
    return key


def _api_key(args) -> str | None:
    """--api-key, else --api-key-file's first line, else $LOCALINFER_API_KEY; None: no key."""
    if args.api_key is not None and args.api_key_file is not None:
        raise UsageError("give --api-key or --api-key-file, not both", flag="--api-key-file")
    if args.api_key_file is not None:
        from localinfer.util.files import read_capped

        def refuse(problem, exc):
            detail = f": {exc.strerror}" if exc is not None and exc.strerror else f" ({problem})"
            return UsageError(f"cannot read the API key file {args.api_key_file}{detail}", flag="--api-key-file",
                              hint="give a small regular file with the key on its first line")

        text = read_capped(args.api_key_file, 4096, refuse).decode("utf-8", "replace")
        return (text.splitlines() or [""])[0].strip() or _empty_key()
    return args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None


def _empty_key():
    raise UsageError("the API key file is empty", flag="--api-key-file", hint="put the key on its first line")


def origins(values: list[str]) -> tuple[str, ...]:
    """--allowed-origins values (comma-separated, repeatable): '*' or scheme://host[:port] each."""
    out = []
    for v in (o.strip() for text in values for o in text.split(",")):
        if not v:
            continue
        if v != "*" and ("://" not in v or v.split("://", 1)[0] not in ("http", "https", "app", "tauri",
                                                                        "chrome-extension", "moz-extension")
                         or "/" in v.split("://", 1)[1].rstrip("/")):
            raise UsageError(f"--allowed-origins {v!r} is not an origin", flag="--allowed-origins",
                             hint="give scheme://host[:port], e.g. http://localhost:3000, or '*'")
        out.append(v.rstrip("/"))
    return tuple(out)


def _number_or_off(text: str | None, key: str, flag: str, ok, what: str, example: str, per: float = 1.0) -> dict:
    """ServeConfig's ``key`` from ``flag``: {} for the default, None for 'off', else the number (÷ ``per``)."""
    if text is None:
        return {}
    if text.strip().lower() == "off":
        return {key: None}
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not ok(v):
        raise UsageError(f"{flag} must be {what} or 'off', got {text!r}", flag=flag, hint=f"e.g. {flag} {example}")
    return {key: v / per}


def _max_gap(text: str | None) -> dict:
    """--max-gap MS: the largest token gap a step is cut to (``max_gap_s``)."""
    return _number_or_off(text, "max_gap_s", "--max-gap", lambda v: 0 < v < 1e6,
                          "a positive number of milliseconds", "150", per=1e3)


def _partial_slack(text: str | None) -> dict:
    """--partial-slack: a fraction of a prompt-finishing step (``partial_slack``)."""
    return _number_or_off(text, "partial_slack", "--partial-slack", lambda v: 0 <= v <= 100, "a fraction in 0..100",
                          "0.25")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _need_server_packages() -> None:
    import importlib.util

    missing = [m for m in ("starlette", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        from localinfer.errors import BackendUnavailableError

        raise BackendUnavailableError(f"localinfer serve needs {', '.join(missing)}, which are not installed",
                                      hint="./install.sh serve, or pip install 'localinfer[serve]'")


def run(args: argparse.Namespace) -> int:
    """Serve until a signal: exit 0 after a stop by signal in any phase (before the server takes over the
    signals, while it loads, while it serves), 1 when the model fails to load."""
    try:
        return _run(args)
    except KeyboardInterrupt as exc:          # SIGINT/SIGTERM before the server handles signals itself
        print(f"\nstopped (signal {getattr(exc, 'signum', 2)})", file=sys.stderr)
        return 0


def _run(args: argparse.Namespace) -> int:
    _need_server_packages()
    from localinfer.serve.http.app import LOOPBACK_NAMES, AppConfig
    from localinfer.serve.http.metrics import Metrics
    from localinfer.serve.http.runtime import Runtime

    key = _check(args)
    backend = _common.backend_name(args)
    if backend not in registry.serving_backends():
        names = " or ".join(registry.serving_backends())
        raise UsageError(f"serve runs on the {names} executor; backend {backend!r} has none yet",
                         flag="--backend", hint="use --backend " + " or --backend ".join(registry.serving_backends()))
    path, spec = _common.read_spec(args)
    if args.step_log is not None:      # appended to, so never the model file
        from localinfer.util.atomic import check_writable

        check_writable(args.step_log, inputs=(path,))
    plan = _common.plan_from(args, path, spec, n_seq=args.parallel)
    plan = plan.with_(options={**plan.options, "kv_unified": True})
    if args.snapshot_stride is not None:
        check_snapshot_stride(args.snapshot_stride, spec)
    config = serve_config(args, plan.n_batch, recurrent=spec.has_recurrent)
    if backend == "llama.cpp":    # llama.cpp reserves a logit row per sequence id, the parked ones' too
        from localinfer.backends.llamacpp import aside
        from localinfer.backends.llamacpp.memory import outputs_cap

        plan = plan.with_(options={**plan.options, "n_outputs_max": outputs_cap(plan.with_(n_seq=config.n_slots)),
                                   "prefill_aside": aside.wanted()})    # its second context, in the fit check too
    plan = plan.with_(n_seq=config.n_slots)     # + ids for parked sequences: the unified cache keeps its size
    fit = _common.check_fit(spec, plan, backend, args.force)     # the plan as it loads (the graph grows with ids)
    predicted = _common.predicted_devices(spec, plan, fit) if backend == "llama.cpp" else None
    model_id = os.path.basename(str(path)).removesuffix(".gguf")
    hosts = {*LOOPBACK_NAMES, socket.gethostname().lower(), *(h.lower() for h in args.allow_host)}
    if args.host not in ("0.0.0.0", "::"):
        hosts.add(args.host.lower())
    if args.chat_template is not None:      # a missing or broken file is refused now, not on every chat request
        check_template(args.chat_template)
    timeouts = {} if args.body_timeout is None else {"body_timeout_s": args.body_timeout}
    app_config = AppConfig(model_id=model_id, aliases=(os.path.basename(str(path)), *args.alias), api_key=key,
                           allowed_hosts=tuple(sorted(hosts)), max_body_bytes=args.max_body,
                           allowed_origins=origins(args.allowed_origins), strict_model_names=args.strict_model_names,
                           default_max_tokens=args.default_max_tokens, show_prompts=args.show_prompts,
                           template=_template_factory(args, spec), created=int(os.path.getmtime(path)), **timeouts)
    metrics = Metrics()
    runtime = Runtime(_executor_factory(backend, plan, args.parallel, devices=_reporter(metrics, predicted)), config,
                      metrics)
    if plan.options.get("rpc"):
        from localinfer.backends.llamacpp import rpc

        rpc.on_worker_lost(runtime.fail_all)   # open replies end with the error before the process exits
    return _serve(args, runtime, app_config, plan)


def _reporter(metrics, predicted: list[dict] | None):
    """What the executor factory calls once the model is loaded: each device's bytes as llama.cpp logged them,
    beside the prediction, into /metrics (None: no prediction to report beside)."""
    if predicted is None:
        return None
    from localinfer.backends.llamacpp.allocated import with_reported

    return lambda executor: metrics.set_devices(with_reported(predicted, executor.vocab.load_log()))


def check_snapshot_stride(stride: int, spec) -> None:
    """``--snapshot-stride``: a hybrid or recurrent model's, 0 or whole KV blocks of at least 256 tokens (each
    snapshot copies the whole state to host memory; they are keyed by whole blocks)."""
    from localinfer.serve.http.config import ServeConfig

    block = ServeConfig.block_tokens
    if not spec.has_recurrent:
        raise UsageError(f"--snapshot-stride applies to hybrid and recurrent models; {spec.name} has no recurrent "
                         "layers", flag="--snapshot-stride", hint="leave it out: its prefix hits need no snapshot")
    if stride and (stride % block or stride < 256):
        raise UsageError(f"--snapshot-stride {stride} must be 0 or a multiple of the {block}-token KV block of at "
                         "least 256", flag="--snapshot-stride", hint="e.g. 1024 (the default), or 0")


def serve_config(args, n_batch: int, recurrent: bool = False):
    """The engine's settings from the serving flags (``--token-budget`` defaults to the plan's ``n_batch``;
    ``recurrent``: the model holds a recurrent state, so fewer parked ids by default)."""
    from localinfer.serve.http.config import DEFAULT_PARKED_RECURRENT, ServeConfig
    from localinfer.serve.speculation import DRAFT_MAX

    budget = args.token_budget if args.token_budget is not None else n_batch
    park = args.parked if args.parked is not None or not recurrent else DEFAULT_PARKED_RECURRENT
    stride = {} if args.snapshot_stride is None else {"snapshot_stride": args.snapshot_stride}
    return ServeConfig.build(parallel=args.parallel, max_queue=args.max_queue, token_budget=budget,
                             **({} if args.chunk is None else {"chunk_tokens": args.chunk}),
                             itl_target_s=None if args.itl_target is None else args.itl_target / 1e3,
                             prefix_cache=args.prefix_cache == "on", park=park, **stride,
                             **_partial_slack(args.partial_slack), **_max_gap(args.max_gap), step_log=args.step_log,
                             draft_max=(args.draft_max or DRAFT_MAX) if args.lookup else 0,
                             **({} if args.decode_share is None else {"decode_share": args.decode_share}))


def _executor_factory(backend: str, plan, parallel: int, devices=None):
    """What the engine thread calls to load: the backend's serving executor over the plan (``--parallel`` of its
    ids run at once; the rest park finished requests' KV where the backend does that); ``devices(executor)``
    is told when it is open."""
    from localinfer.backends import registry

    def open_executor():
        executor = registry.open_executor(plan, backend, running=parallel)
        if devices is not None:
            try:
                devices(executor)
            except BaseException:
                executor.close()
                raise
        return executor
    return open_executor


def open_llamacpp(plan, *, park_host: bool = True):
    """The server's llama.cpp executor: parked requests' KV in host memory, off the cells every step attends over
    (``park_host``; without it the executor runs no load-time parking probe)."""
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    return LlamaCppExecutor(plan, park_host=park_host)


def check_template(path: str) -> None:
    """Read, compile and try a --chat-template FILE on a one-message conversation (TemplateError if it fails)."""
    from localinfer.errors import TemplateError
    from localinfer.model.templates import ChatTemplate

    tpl = ChatTemplate.from_file(path)
    try:
        tpl.render([{"role": "user", "content": "hello"}])
    except TemplateError as exc:
        raise TemplateError(f"--chat-template {path} fails on a one-message conversation: {exc}",
                            hint="fix the template or leave --chat-template out") from None


def _template_factory(args, spec):
    """The chat template, built once the tokenizer exists (its BOS/EOS text goes into the template)."""
    def build(tokenizer):
        return _common.template_from(args, tokenizer, spec)
    return build


def _serve(args, runtime, app_config, plan) -> int:
    from localinfer.serve.http.runtime import RuntimeState
    from localinfer.serve.http.server import bind, serve

    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}", flag="--port",
                         hint="choose another --port (0: any free one)") from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {app_config.model_id} on http://{shown}:{port}/v1 (parallel {args.parallel}, "
          f"ctx {plan.n_ctx} shared, KV {plan.type_k}/{plan.type_v}); loading...", file=sys.stderr, flush=True)

    def announce_ready(server):
        runtime.ready.wait()
        if runtime.state is RuntimeState.FAILED:       # as llama-server and vLLM do: no server without a model
            print(f"error: the model failed to load: {runtime.load_error}", file=sys.stderr, flush=True)
            server.should_exit = True
        elif runtime.state is RuntimeState.READY:
            print(f"ready: {runtime.context_tokens} KV tokens, {runtime.config.parallel} slots "
                  f"(+{runtime.engine.park_slots} parked)", file=sys.stderr, flush=True)

    with sock:
        limits = {k: v for k, v in (("header_timeout_s", args.header_timeout), ("keep_alive_s", args.keep_alive),
                                    ("max_connections", args.max_connections)) if v is not None}
        signum = serve(runtime, app_config, sock, grace_s=args.grace, log_level=args.log_level,
                       announce=lambda server: threading.Thread(target=announce_ready, args=(server,),
                                                                daemon=True).start(), **limits)
    if runtime.state is RuntimeState.FAILED:
        return 1
    print(f"stopped{f' (signal {signum})' if signum else ''}", file=sys.stderr)
    return 0
