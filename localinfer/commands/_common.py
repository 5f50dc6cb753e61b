"""Flags shared by `run`, `chat` and `bench`, and turning them into objects.

Defaults are not repeated here: a flag left out keeps the default of the
dataclass the API uses (LoadPlan, SamplingParams, runner.DEFAULT_MAX_TOKENS).
Backends come from the registry by name (``--backend NAME``), so third-party
engines get the same flags.
"""

from __future__ import annotations

import argparse
import os
import sys

from localinfer.backends.engine import KV_TYPES, LoadPlan
from localinfer.errors import UsageError
from localinfer.generation.load import PLAN_DEFAULTS as _PLAN_DEFAULTS


def add_model_args(p: argparse.ArgumentParser, *, kv_choices: bool = True) -> None:
    """MODEL, backend, context, KV type, threads, offload and --force."""
    p.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file (default: the embedded SmolLM2-135M)")
    g = p.add_argument_group("loading")
    from localinfer.backends.registry import DEFAULT_BACKEND, names

    g.add_argument("--backend", default=None, metavar="NAME",
                   help=f"engine to run on: {', '.join(names())} (default {DEFAULT_BACKEND})")
    g.add_argument("-c", "--ctx", type=int, default=None, metavar="N",
                   help=f"context length in tokens (default: the model's, at most {_PLAN_DEFAULTS['n_ctx']})")
    if kv_choices:
        g.add_argument("-ctk", "--cache-type-k", dest="type_k", default=None, choices=KV_TYPES, metavar="TYPE",
                       help="K cache type: f16 (default), q8_0, q4_0, ...")
        g.add_argument("-ctv", "--cache-type-v", dest="type_v", default=None, choices=KV_TYPES, metavar="TYPE",
                       help="V cache type; a quantized V switches flash attention on")
    g.add_argument("-fa", "--flash-attn", dest="flash_attn", default=None, choices=("on", "off", "auto"),
                   help="flash attention (default: on when V is quantized, else the backend's choice)")
    g.add_argument("-ngl", "--gpu-layers", dest="n_gpu_layers", type=int, default=None, metavar="N",
                   help="layers on the accelerator, the output layer counted as one (-1: all)")
    g.add_argument("-t", "--threads", dest="n_threads", type=int, default=None, metavar="N", help="CPU threads")
    g.add_argument("-b", "--batch", dest="n_batch", type=int, default=None, metavar="N", help="prompt tokens per eval")
    g.add_argument("-ub", "--ubatch", dest="n_ubatch", type=int, default=None, metavar="N",
                   help="tokens per compute graph (smaller: less compute memory)")
    g.add_argument("-lm", "--load-mode", default=None, choices=("mmap", "none", "mlock", "mmap+mlock"),
                   help="llama.cpp: map the file (mmap, the default), read it into memory (none), lock it")
    g.add_argument("--no-repack", action="store_true", default=None,
                   help="llama.cpp: no CPU weight repacking (slower CPU matmuls, no anonymous copy)")
    g.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template to use instead of the GGUF's")
    g.add_argument("--force", action="store_true", help="load even when the fit check says it does not fit")
    g.add_argument("--rpc", default=None, metavar="HOST:PORT,...",
                   help="split the layers across these llama.cpp RPC workers (`localinfer worker` on each host)")
    g.add_argument("-ts", "--tensor-split", default=None, metavar="A,B,...",
                   help="layer shares per device, RPC workers first (default: by free memory, as llama.cpp)")
    from localinfer.commands._overrides import add_override_args

    add_override_args(g)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling, reply length, stop strings and prompt-lookup decoding."""
    from localinfer.generation.runner import DEFAULT_MAX_TOKENS
    from localinfer.generation.sampling import SamplingParams

    d = SamplingParams()
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=int, default=None, metavar="N",
                   help=f"most tokens to generate (default {DEFAULT_MAX_TOKENS})")
    g.add_argument("--temp", dest="temperature", type=float, default=None, metavar="T",
                   help=f"temperature, 0: greedy (default {d.temperature:g})")
    g.add_argument("--top-k", type=int, default=None, metavar="K",
                   help=f"keep the K likeliest tokens, 0: off (default {d.top_k})")
    g.add_argument("--top-p", type=float, default=None, metavar="P",
                   help=f"nucleus sampling mass, 1: off (default {d.top_p:g})")
    g.add_argument("--min-p", type=float, default=None, metavar="P",
                   help=f"drop tokens below P x the likeliest, 0: off (default {d.min_p:g})")
    g.add_argument("--repeat-penalty", type=float, default=None, metavar="X",
                   help=f"repetition penalty, 1: off (default {d.repeat_penalty:g})")
    g.add_argument("--repeat-last-n", type=int, default=None, metavar="N",
                   help=f"tokens the penalty looks back over (default {d.repeat_last_n})")
    g.add_argument("--seed", type=int, default=None, metavar="S", help="random seed (default: random)")
    g.add_argument("--greedy", action="store_true", default=None, help="always take the likeliest token")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="never stop at end-of-generation tokens")
    g = p.add_argument_group("prompt-lookup speculative decoding")
    g.add_argument("--lookup", action="store_true", help="draft tokens by n-gram lookup in the context")
    g.add_argument("--lookup-ngram", type=int, default=None, metavar="N", help="longest n-gram matched")
    g.add_argument("--draft-max", type=int, default=None, metavar="N", help="most draft tokens per round")


def sampling_from(args: argparse.Namespace):
    """SamplingParams from the flags given (the rest keep their defaults)."""
    from localinfer.generation.sampling import SamplingParams

    given = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                           "repeat_last_n", "seed", "greedy") if getattr(args, k, None) is not None}
    return SamplingParams(**given)


def max_tokens_from(args: argparse.Namespace) -> int:
    from localinfer.generation.runner import DEFAULT_MAX_TOKENS
    from localinfer.generation.sampling import check_max_tokens

    n = getattr(args, "max_tokens", None)
    return DEFAULT_MAX_TOKENS if n is None else check_max_tokens(n, "-n")


def decoder_from(args: argparse.Namespace):
    """A LookupDecoder with --lookup (imported only then), else plain decoding."""
    if not getattr(args, "lookup", False):
        if args.lookup_ngram is not None or args.draft_max is not None:
            raise UsageError("--lookup-ngram and --draft-max need --lookup", flag="--lookup")
        from localinfer.generation.decoding import PlainDecoder

        return PlainDecoder()
    from localinfer.generation.lookup import LookupDecoder

    kw = {}
    if args.lookup_ngram is not None:
        kw["ngram_max"] = args.lookup_ngram
        kw["ngram_min"] = min(2, args.lookup_ngram)
    if args.draft_max is not None:
        kw["draft_max"] = args.draft_max
    return LookupDecoder(**kw)


def read_spec(args: argparse.Namespace):
    """(model path, ModelSpec) from the MODEL argument; header reads only."""
    from localinfer.generation.load import open_model

    opened = open_model(args.model, getattr(args, "backend", None))
    return opened.path, opened.spec


def plan_from(args: argparse.Namespace, path, spec, **overrides) -> LoadPlan:
    """A LoadPlan from the loading flags, checked against the model."""
    from localinfer.generation.load import load_plan, usable_cores

    threads, cores = getattr(args, "n_threads", None), usable_cores()
    if threads is not None and cores < threads <= 1024:
        print(f"warning: -t {threads} is more than the {cores} cores this process may use; using {cores}",
              file=sys.stderr)
    names = ("type_k", "type_v", "n_gpu_layers", "n_threads", "n_batch", "n_ubatch", "flash_attn")
    options = {k: getattr(args, k, None) for k in names}
    from localinfer.commands._overrides import override_fields

    load = {**load_options(args), **split_options(args), **override_fields(args)}
    if load:
        options["options"] = {**load, **overrides.pop("options", {})}
    options.update(overrides)
    return load_plan(path, spec, ctx=args.ctx, force=getattr(args, "force", False), **options)


def load_options(args: argparse.Namespace) -> dict:
    """LoadPlan options for -lm and --no-repack (llama.cpp's load mode; the fit check models them)."""
    mode, out = getattr(args, "load_mode", None), {}
    if mode is not None:
        out.update(mmap=mode in ("mmap", "mmap+mlock"), mlock="mlock" in mode)
    if getattr(args, "no_repack", None):
        out["repack"] = False
    return out


def split_options(args: argparse.Namespace) -> dict:
    """LoadPlan options for --rpc (endpoints) and --tensor-split (shares); {} without them."""
    from localinfer.plan.split import parse_shares

    rpc, ts = getattr(args, "rpc", None), getattr(args, "tensor_split", None)
    out = {}
    if rpc:
        from localinfer.backends.llamacpp.rpc_probe import parse_endpoints

        out["rpc"] = tuple(parse_endpoints(rpc))
    if ts:
        out["tensor_split"] = parse_shares(ts)
    if out and (getattr(args, "backend", None) or "llama.cpp") not in ("llama.cpp", "llamacpp", "llama_cpp", "cpp"):
        raise UsageError("--rpc and --tensor-split split layers with llama.cpp", flag="--rpc",
                         hint="drop --backend")
    return out


def check_split(spec, plan: LoadPlan, force: bool):
    """The split check of a plan with --rpc/--tensor-split: asks the workers (a typed error naming one that does
    not answer) and refuses a device that would overflow, unless --force.  Returns the SplitFit."""
    from localinfer.errors import DoesNotFitError
    from localinfer.plan import split_devices
    from localinfer.plan.split import fit_split

    endpoints = plan.options.get("rpc") or ()
    from localinfer.backends.llamacpp.rpc_probe import probe

    setup = split_devices.from_workers([probe(ep) for ep in endpoints])
    if not setup.devices:
        raise UsageError("--tensor-split needs devices to split over: add --rpc HOST:PORT", flag="--tensor-split")
    req = plan_request(spec, plan)
    sf = fit_split(spec, setup.devices, req, shares=plan.options.get("tensor_split"), host_usable=setup.host_usable,
                   cpu_features=setup.host.cpu_features, search=False)
    if sf.fits or force:
        if not sf.fits:
            print(f"warning: {sf.reason} (loading anyway: --force)", file=sys.stderr)
        return sf
    worst = max(sf.breakdown.devices, key=lambda d: d.total - d.usable)
    raise DoesNotFitError(sf.reason, needed=worst.total, available=worst.usable,
                          hint="try `localinfer fit --rpc ...` for a --tensor-split that fits (or --force)")


def plan_request(spec, plan: LoadPlan):
    """The FitRequest a LoadPlan implies for llama.cpp (the split check and run --json's prediction)."""
    from localinfer.backends.memory import FitRequest
    from localinfer.backends.registry import memory_model

    return FitRequest(n_ctx=max(1, -(-plan.n_ctx // plan.n_seq)), n_seq=plan.n_seq, type_k=plan.type_k,
                      type_v=plan.type_v, flash_attn=plan.flash_attn, n_gpu_layers=plan.n_gpu_layers,
                      n_batch=plan.n_batch, n_ubatch=min(plan.n_ubatch, plan.n_batch), n_ctx_total=plan.n_ctx,
                      **memory_model("llama.cpp").load_request(plan))


def backend_name(args: argparse.Namespace) -> str:
    from localinfer.backends.registry import DEFAULT_BACKEND, canonical

    return canonical(args.backend or DEFAULT_BACKEND)


def check_fit(spec, plan: LoadPlan, backend: str, force: bool):
    """Refuse a plan that does not fit on this machine (``--force`` loads anyway, with a warning)."""
    from localinfer.generation.load import check_fit as verdict

    if plan.options.get("rpc") or plan.options.get("tensor_split"):
        return check_split(spec, plan, force)
    result = verdict(spec, plan, backend, force)
    if result is None:
        print(f"note: the {backend} backend has no memory model; the fit check is skipped", file=sys.stderr)
    elif not result.fits:
        print(f"warning: {result.reason} (loading anyway: --force)", file=sys.stderr)
    return result


def load(args: argparse.Namespace, *, quiet: bool = False, **overrides):
    """(engine, spec, plan, backend name): flags -> fit check -> loaded engine."""
    from localinfer.backends.registry import load_engine

    path, spec = read_spec(args)
    plan = plan_from(args, path, spec, **overrides)
    backend = backend_name(args)
    result = check_fit(spec, plan, backend, args.force)
    args.fit_check = (spec, plan, result)        # device_report's prediction, made when asked for
    if not quiet:
        print(f"loading {os.path.basename(str(path))} ({backend}, ctx {plan.n_ctx}, KV {plan.type_k}/{plan.type_v})...",
              file=sys.stderr, flush=True)
    engine = load_engine(plan, backend)
    return engine, spec, plan, backend


def predicted_devices(spec, plan: LoadPlan, fit) -> list[dict] | None:
    """Per device, the bytes the fit check predicts llama.cpp allocates for ``plan`` as it is loaded: the split's
    devices and the host (``fit`` a SplitFit), else the device ``fit`` checked (a CPU alone is one row).  None
    when llama.cpp is not the backend (``allocated`` rows: weights, kv, compute)."""
    from localinfer.backends.llamacpp import allocated
    from localinfer.backends.registry import memory_model
    from localinfer.plan.split import SplitFit

    model, req = memory_model("llama.cpp"), plan_request(spec, plan)
    if isinstance(fit, SplitFit):
        if req == fit.request:
            return allocated.predicted_split(fit.breakdown)
        from localinfer.devices.profiles import local_device

        return allocated.predicted_split(model.split(spec, fit.devices, req, plan.options.get("tensor_split"),
                                                     cpu_features=local_device().cpu_features))
    if fit is None or fit.request.backend != "llama.cpp":
        return None
    bd = fit.breakdown if req == fit.request else model.breakdown(spec, fit.device, req)[0]   # the fit check's own
    return allocated.predicted_terms(bd)


def device_report(args: argparse.Namespace, engine) -> list[dict] | None:
    """Per device: what llama.cpp allocated (its log) beside the fit check's prediction (llama.cpp runs)."""
    if getattr(args, "fit_check", None) is None or not hasattr(engine, "load_log"):
        return None
    predicted = predicted_devices(*args.fit_check)
    if predicted is None:
        return None
    from localinfer.backends.llamacpp.allocated import with_reported

    return with_reported(predicted, engine.load_log())


def template_from(args: argparse.Namespace, engine, spec):
    """The chat template: --chat-template FILE, else the GGUF's, else ChatML (with a warning)."""
    from localinfer.model.templates import template_with_vocab

    tpl = template_with_vocab(spec, engine, args.chat_template)
    if "fallback" in tpl.origin:
        print("warning: the model has no chat template; using ChatML (pass --chat-template FILE to choose)",
              file=sys.stderr)
    return tpl
