"""The `localinfer` command: one module per subcommand, imported only when used.

Every subcommand lives in ``localinfer/commands/<name>.py`` and defines
``add_arguments(parser)`` and ``run(args) -> int``.  This module is the single
error boundary: library errors become ``error: ...`` / ``hint: ...`` lines and
a non-zero exit; ``--debug`` or ``LOCALINFER_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from localinfer import __version__
from localinfer.util import signals
from localinfer.util.signals import Terminated

# name -> one-line help.  Order is the order of `localinfer --help`.
COMMANDS: dict[str, str] = {
    "fit": "will the model fit on each device, and how (header only)",
    "devices": "list device profiles",
    "inspect": "show a GGUF file's metadata, tensors and byte accounting",
    "skeleton": "write a header-only GGUF for a model you have not downloaded",
    "run": "generate a reply to one prompt",
    "chat": "interactive chat",
    "bench": "measure prefill/decode speed, latency and memory",
    "plan": "choose the best configuration for a workload and deadline",
    "report": "cross-device capacity and speed report",
    "replay": "replay a request trace through the serving scheduler on a simulated clock",
    "serve": "an OpenAI-compatible HTTP server on the serving engine",
    "worker": "serve this machine's devices to other hosts (llama.cpp RPC)",
}


def _command_module(name: str):
    return importlib.import_module(f"localinfer.commands.{name}")


def build_parser(command: str | None, argv: list[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="localinfer",
        description="Plan and run GGUF language models on the machines you own.",
    )
    parser.add_argument("--version", action="version", version=f"localinfer {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        if name == command:
            module = _command_module(name)
            # a command whose flags depend on its first argument (`bench serve`) chooses them from what follows it
            forms = getattr(module, "arguments_for", None)
            (forms(argv[argv.index(name) + 1:]) if forms else module.add_arguments)(p)
            parser.set_defaults(_subparser=p)
    return parser


def _find_command(argv: list[str]) -> str | None:
    for arg in argv:
        if arg in COMMANDS:
            return arg
        if not arg.startswith("-"):
            return None
    return None


def _report(exc: BaseException) -> int:
    from gguf_tools.errors import printable
    from localinfer.errors import exit_code

    print(f"error: {printable(str(exc).replace(chr(10), ' '))}", file=sys.stderr)
    hint = getattr(exc, "hint", None)
    if hint:
        print(f"hint: {printable(str(hint))}", file=sys.stderr)
    return exit_code(exc)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("LOCALINFER_DEBUG", "") not in ("", "0")
    command = _find_command(argv)
    signals.install()
    try:
        parser = build_parser(command, argv)
        args, extra = parser.parse_known_args(argv)
        if extra:
            # report unknown flags against the subcommand's own usage
            getattr(args, "_subparser", parser).error("unrecognized arguments: " + " ".join(extra))
        if not args.command:
            parser.print_help()
            return 0
        return int(_command_module(args.command).run(args) or 0)
    except KeyboardInterrupt as exc:
        if debug:
            raise
        terminated = isinstance(exc, Terminated)
        print("\nterminated" if terminated else "\ninterrupted", file=sys.stderr)
        return exc.exit_code if terminated else 130
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except Exception as exc:  # the one error boundary
        from gguf_tools.errors import GGUFFormatError
        from localinfer.errors import LocalinferError

        if debug:
            raise
        if isinstance(exc, (LocalinferError, GGUFFormatError)):
            return _report(exc)
        if isinstance(exc, OSError):
            return _report(exc)
        print(f"error: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print("hint: rerun with --debug and report the traceback", file=sys.stderr)
        return 70


if __name__ == "__main__":
    sys.exit(main())
