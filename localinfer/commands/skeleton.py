"""`localinfer skeleton PRESET|--spec FILE -o OUT.gguf [--type T]` and `--list`."""

from __future__ import annotations

import argparse
import os

from localinfer.errors import UsageError
from localinfer.units import fmt_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("preset", nargs="?", help="preset name (see --list)")
    parser.add_argument("--spec", metavar="FILE", help="TOML or JSON file of architecture fields instead of a preset")
    parser.add_argument("-o", "--output", metavar="OUT.gguf", help="file to write")
    parser.add_argument("--type", metavar="T",
                        help="file type: bf16, q8_0, q4_0, q2_k, q4_k_m, ... (default: the preset's)")
    parser.add_argument("--list", action="store_true", help="list presets and exit")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")


def _list() -> int:
    from gguf_tools.mix import FTYPES
    from gguf_tools.presets import list_presets

    rows = list_presets()
    width = max(len(r[0]) for r in rows)
    print(f"{'preset':<{width}}  {'default':<7}  {'types':<24}  model")
    for key, name, default, types in rows:
        print(f"{key:<{width}}  {default:<7}  {', '.join(types):<24}  {name}")
    print(f"\nany --type of: {', '.join(FTYPES)}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.list:
        return _list()
    from gguf_tools.presets import PRESETS
    from gguf_tools.reader import read_header
    from gguf_tools.skeleton import load_spec_file, write_skeleton

    if bool(args.preset) == bool(args.spec):
        raise UsageError("give either a PRESET or --spec FILE", flag="--spec",
                         hint=f"presets: {', '.join(PRESETS)} (localinfer skeleton --list)")
    if not args.output:
        raise UsageError("missing -o OUT.gguf", flag="-o",
                         hint="e.g. localinfer skeleton qwen3-8b -o /tmp/qwen3-8b.gguf")
    if os.path.isdir(args.output):
        raise UsageError(f"-o {args.output} is a directory", flag="-o", hint="give a file name ending in .gguf")
    from localinfer.errors import OutputError
    from localinfer.util.atomic import check_writable

    check_writable(args.output)  # "newdir/" names a folder; a missing or read-only folder is named
    if os.path.exists(args.output) and not args.force:
        raise UsageError(f"{args.output} exists", flag="-o",
                         hint="pass --force to overwrite it, or choose another name")
    flag = "--spec" if args.spec else "PRESET"
    try:
        source = load_spec_file(args.spec) if args.spec else args.preset
        path = write_skeleton(source, args.output, type=args.type)
    except OSError as exc:  # disk full, ...: name the output, not the temp file
        raise OutputError(f"cannot write {args.output}: {exc.strerror or exc}", path=args.output,
                          hint="free some disk space or choose another path") from None
    except ValueError as exc:
        bad_type = args.type and "unknown type" in str(exc)
        raise UsageError(str(exc), flag="--type" if bad_type else flag,
                         hint="localinfer skeleton --list shows presets and types") from None
    h = read_header(path)
    name = h.get("general.name", "")
    print(f"wrote {path}: {name}, {len(h.tensors)} tensors, {h.file_size:,} bytes ({fmt_bytes(h.file_size)}), "
          f"tensor data {h.tensor_bytes:,} bytes; the data section is a sparse hole (no weights)")
    return 0
