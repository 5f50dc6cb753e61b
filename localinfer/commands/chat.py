"""`localinfer chat [MODEL]`: an interactive chat (the embedded model by default).

The model loads only after the fit check passes (``--force`` overrides it);
see :mod:`localinfer.generation.chat` for the keys and /commands.
"""

from __future__ import annotations

import argparse
import os
import sys

from localinfer.commands import _common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _common.add_model_args(parser)
    _common.add_sampling_args(parser)
    parser.add_argument("--system", metavar="TEXT", help="system message")
    parser.add_argument("--context-shift", action="store_true",
                        help="when the context is full, drop the oldest turns instead of stopping")
    parser.add_argument("--save", metavar="FILE", help="write the transcript to FILE after every reply (atomically)")
    parser.add_argument("--load", metavar="FILE", help="continue a transcript written by /save or --save")


def _check_template(template, engine, system: str | None) -> None:
    """Render a first message once, so a template that cannot render any conversation stops chat here."""
    from localinfer.errors import TemplateError

    probe = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "hello"}]
    try:
        template.tokens(engine, probe)
    except TemplateError as exc:
        raise TemplateError(f"the chat template cannot render a first message: {exc}",
                            hint=exc.hint or "pass --chat-template FILE to use another template") from None


def run(args: argparse.Namespace) -> int:
    from gguf_tools.inspect import safe_text
    from localinfer.generation.chat import ChatSession, read_transcript

    params = _common.sampling_from(args)
    max_tokens = _common.max_tokens_from(args)
    decoder = _common.decoder_from(args)
    if args.stop:
        from localinfer.errors import UsageError

        raise UsageError("--stop is not used by chat; the chat template ends each reply", flag="--stop")
    loaded = read_transcript(args.load) if args.load else None
    if args.save:
        from localinfer.model.sources import resolve_model
        from localinfer.util.atomic import check_writable

        check_writable(args.save, inputs=[resolve_model(args.model)])  # before the model loads
    engine, spec, plan, _backend = _common.load(args)
    with engine:
        template = _common.template_from(args, engine, spec)
        _check_template(template, engine, args.system)
        if sys.stdin.isatty():
            try:
                import readline  # noqa: F401  (line editing and Up-arrow history for input())
            except ImportError:
                pass
        session = ChatSession(engine, template, params=params, max_tokens=max_tokens, decoder=decoder,
                              system=args.system, context_shift=args.context_shift, save_path=args.save,
                              model_name=safe_text(spec.name or os.path.basename(str(plan.model_path)), 80),
                              ignore_eos=args.ignore_eos)
        if loaded:
            session.messages, system = loaded
            session.system = system if system is not None else session.system
        return session.loop() if sys.stdin.isatty() else session.loop(read_piped_line)


MAX_PIPED_LINE = 1 << 20      # characters of one line read from a pipe or file (/dev/zero has no newline)


def read_piped_line(prompt: str) -> str:
    """``input()`` for a stdin that is not a terminal, at most MAX_PIPED_LINE characters a line."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = sys.stdin.readline(MAX_PIPED_LINE + 1)
    if not line:
        raise EOFError
    if len(line) > MAX_PIPED_LINE:
        from localinfer.errors import UsageError

        raise UsageError(f"an input line is over {MAX_PIPED_LINE:,} characters", hint="is stdin a text file?")
    return line.removesuffix("\n")
