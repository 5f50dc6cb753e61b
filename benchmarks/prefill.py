"""Prefill: the engine's per-slot logits against llama-cpp-python's paths on one long prompt.

* localinfer: ``LlamaCppEngine.eval(prompt, logits_at=[-1])`` (logits for the last token only);
* llama-cpp-python default (``logits_all=False``): ``Llama.eval(prompt)``, last token of each n_batch chunk;
* llama-cpp-python ``logits_all=True`` (what prompt-lookup decoding needs there): a
  full-vocabulary row for every prompt token.

Same model, threads, n_ctx, n_batch/n_ubatch; each side in a fresh process,
alternating; the best of --repeats evals per process.

    python benchmarks/prefill.py [MODEL] [--tokens 2048] [--threads 1] [--rounds 3] [--json OUT]

Target: localinfer >= llama-cpp-python default on a 2K prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys, time
side, model, n, threads, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
text = open(sys.argv[6], encoding="utf-8").read()
ctx = n + 256
best = float("inf")
if side == "localinfer":
    from localinfer.backends import load_engine
    from localinfer.engine import LoadPlan
    e = load_engine(LoadPlan(model, n_ctx=ctx, n_threads=threads, n_batch=512, n_ubatch=512))
    toks = (e.tokenize(text) * 50)[:n]
    for _ in range(repeats):
        e.trim(0)
        t0 = time.perf_counter(); e.eval(toks, logits_at=[-1]); best = min(best, time.perf_counter() - t0)
else:
    from llama_cpp import Llama
    llm = Llama(model, n_ctx=ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, n_ubatch=512,
                logits_all=(side == "logits_all"), verbose=False)
    toks = (llm.tokenize(text.encode(), add_bos=False) * 50)[:n]
    for _ in range(repeats):
        llm.reset()
        t0 = time.perf_counter(); llm.eval(toks); best = min(best, time.perf_counter() - t0)
print(json.dumps({"side": side, "tokens": n, "seconds": best, "tok_s": n / best}))
"""

TEXT = ("Maps are arguments about the world. A river drawn in blue asserts that water runs there all year; "
        "a dotted line admits doubt. Surveyors walked the hills with chains and compasses, and their errors "
        "travelled into atlases for a century. ") * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-logits-all", action="store_true", help="skip the logits_all=True side")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    from localinfer.models import resolve_model

    model = str(resolve_model(args.model))
    sides = ["localinfer", "default"] + ([] if args.no_logits_all else ["logits_all"])
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(TEXT)
    rows = []
    try:
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                out = subprocess.run([sys.executable, "-c", _CHILD, side, model, str(args.tokens), str(args.threads),
                                      str(args.repeats), f.name], check=True, capture_output=True, text=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                rows.append({"round": r, **row})
                print(f"round {r}  {side:<11} {row['tokens']} tokens  {row['seconds']:7.3f} s  {row['tok_s']:8.1f} tok/s",
                      flush=True)
    finally:
        os.unlink(f.name)
    med = {s: statistics.median(x["tok_s"] for x in rows if x["side"] == s) for s in sides}
    print("\nmedian prefill tok/s: " + ", ".join(f"{s} {v:.1f}" for s, v in med.items()))
    print(f"localinfer / default = {med['localinfer'] / med['default']:.3f} (target >= 1.0)"
          + ("" if args.no_logits_all else f"; localinfer / logits_all = {med['localinfer'] / med['logits_all']:.3f}"))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"threads {args.threads}, {os.cpu_count()} CPUs, load average {load}")
    if args.json:
        with open(args.json, "w") as fo:
            json.dump({"benchmark": "prefill", "model": model, "tokens": args.tokens, "threads": args.threads,
                       "rows": rows, "median": med, "load_avg": load}, fo, indent=1)


if __name__ == "__main__":
    main()
