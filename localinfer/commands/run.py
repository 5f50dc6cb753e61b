"""`localinfer run [MODEL] -p TEXT | -f FILE`: generate one reply.

The prompt goes through the model's chat template unless ``--raw`` (as
``ollama run`` and ``mlx_lm.generate`` do).  ``--json-schema FILE`` or ``--grammar FILE``
(Lark, llguidance's dialect) constrains the reply (docs/structured.md).  The reply streams to stdout and a
stats line goes to stderr; ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import sys

from localinfer.commands import _common

MAX_PROMPT_FILE = 64 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", metavar="TEXT", help="the prompt")
    src.add_argument("-f", "--file", metavar="FILE", help="read the prompt from FILE ('-': stdin)")
    _common.add_model_args(parser)
    _common.add_sampling_args(parser)
    parser.add_argument("--system", metavar="TEXT", help="system message (chat template only)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the reply and the stats")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="constrain the reply to the JSON schema in FILE")
    shape.add_argument("--grammar", metavar="FILE", help="constrain the reply to the Lark grammar in FILE")


def grammar_from_args(args):
    """The grammar --json-schema or --grammar names (compiled now, so a bad file fails before the model loads)."""
    from localinfer.generation.constraints import grammar_from_file

    if getattr(args, "json_schema", None):
        return grammar_from_file(args.json_schema, "json_schema", "--json-schema")
    if getattr(args, "grammar", None):
        return grammar_from_file(args.grammar, "lark", "--grammar")
    return None


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    from localinfer.errors import UsageError

    try:
        if args.file == "-":
            from localinfer.util.signals import waiting_for_input

            with waiting_for_input():
                data = sys.stdin.buffer.read(MAX_PROMPT_FILE + 1)
        else:
            with open(args.file, "rb") as f:
                data = f.read(MAX_PROMPT_FILE + 1)
    except OSError as exc:
        raise UsageError(f"cannot read prompt file {args.file}: {exc.strerror}", flag="-f") from None
    if len(data) > MAX_PROMPT_FILE:
        raise UsageError(f"prompt file {args.file} is over {MAX_PROMPT_FILE >> 20} MiB", flag="-f")
    return data.decode("utf-8", errors="replace")


def prompt_tokens(args, engine, spec, text: str) -> list[int]:
    if args.raw:
        engine.check_text_fits(len(text.encode("utf-8", "replace")))  # by bytes, before tokenizing
        return engine.tokenize(text, add_bos=True, special=False)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
    return _common.template_from(args, engine, spec).tokens(engine, messages)


def run(args: argparse.Namespace) -> int:
    from localinfer.generation.runner import Runner

    if args.raw and args.system:
        from localinfer.errors import UsageError

        raise UsageError("--system needs the chat template; drop --raw", flag="--system")
    text = read_prompt(args)
    params = _common.sampling_from(args)
    max_tokens = _common.max_tokens_from(args)
    decoder = _common.decoder_from(args)
    grammar = grammar_from_args(args)
    engine, spec, plan, backend = _common.load(args, quiet=args.json)
    with engine:
        prompt = prompt_tokens(args, engine, spec, text)
        runner = Runner(engine)
        constraint = None
        if grammar is not None:
            from localinfer.generation.constraints import Constraint, grammar_tokenizer

            constraint = Constraint(grammar_tokenizer(engine), grammar, "--json-schema" if args.json_schema
                                    else "--grammar")
        stream = runner.stream(prompt, params, max_tokens=max_tokens, stop=args.stop, decoder=decoder,
                               ignore_eos=args.ignore_eos, constraint=constraint)
        parts = []
        for chunk in stream:
            parts.append(chunk.text)
            if not args.json and chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        memory = engine.memory()
        devices = _common.device_report(args, engine)
    tm = chunk.timings
    if args.json:
        out = {
            "model": str(plan.model_path), "backend": backend, "text": "".join(parts),
            "finish_reason": chunk.finish_reason, "timings": tm.as_dict(), "decode": chunk.stats.as_dict(),
            "lookup": bool(args.lookup), "sampling": params.as_dict(), "max_tokens": max_tokens,
            "plan": {"n_ctx": plan.n_ctx, "type_k": plan.type_k, "type_v": plan.type_v,
                     "threads": plan.threads, "n_gpu_layers": plan.n_gpu_layers},
            "memory": memory,
        }
        if devices is not None:
            out["devices"] = devices
        json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
        print()
    else:
        print()
        print(stats_line(tm, chunk.finish_reason, chunk.stats if args.lookup else None), file=sys.stderr)
    return 0


def stats_line(tm, finish_reason: str, lookup_stats=None) -> str:
    """One human line: tokens, prefill and decode speed, TTFT, finish reason."""
    parts = [f"{tm.generated} tokens"]
    if tm.prefill_tok_s:
        parts.append(f"prefill {tm.prefill_tokens} tok at {tm.prefill_tok_s:.1f} tok/s")
    if tm.decode_tok_s:
        parts.append(f"decode {tm.decode_tok_s:.1f} tok/s")
    if tm.ttft is not None:
        parts.append(f"TTFT {tm.ttft * 1000:.0f} ms")
    if lookup_stats is not None and lookup_stats.rounds:
        parts.append(f"lookup {lookup_stats.tokens_per_round:.2f} tok/round, "
                     f"{lookup_stats.acceptance * 100:.0f}% accepted")
    reason = "context full" if tm.context_full else finish_reason
    return "[" + ", ".join(parts) + f"; {reason}]"
