"""Load test any OpenAI-compatible server: closed-loop concurrency levels and open-loop Poisson arrivals.

    python benchmarks/serve_load.py --url http://127.0.0.1:8080/v1 [--concurrency 1,4,8] [--rate 0.5,1]
    python benchmarks/serve_load.py MODEL.gguf --threads 2 --ctx 4096 --parallel 8     # starts localinfer serve

The same code and flags as ``localinfer bench serve`` (:mod:`localinfer.loadgen.load`, which describes
what is sent, measured and polled, and the ``peaks`` keys); this script differs only in its output: the
JSON goes to ``--out FILE`` (written atomically) or to stdout, and one summary line per run to stderr.
MODEL ``default`` is the embedded model.  Only 127.0.0.1 servers are expected here; the URL is whatever
you give.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.commands.bench import add_load_arguments, serve_document
from localinfer.errors import LocalinferError
from localinfer.loadgen.load import ProgressBar, render_table
from localinfer.util.atomic import atomic_write


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_arguments(ap)
    ap.add_argument("--out", "--json", dest="json", default=None, help="write the JSON here (default: stdout)")
    args = ap.parse_args(argv)
    if (args.url is None) == (args.model is None):
        ap.error("give --url URL or MODEL")
    if args.model == "default":
        args.model = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # so the server we started is stopped too
    try:
        doc = serve_document(args, progress=ProgressBar())
        text = json.dumps(doc, indent=1)
        if args.json and args.json != "-":
            atomic_write(args.json, text + "\n")
        else:
            print(text)
    except LocalinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    print(render_table(doc), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
