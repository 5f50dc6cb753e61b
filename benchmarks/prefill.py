"""Prefill: the engine's per-slot logits against llama-cpp-python's paths on one long prompt.

* localinfer: ``LlamaCppEngine.eval(prompt, logits_at=[-1])``, logits for the last token only,
  once with its default flash-attention setting (auto) and once with it off as in the peer;
* llama-cpp-python default (``logits_all=False``, flash attention off): ``Llama.eval(prompt)``;
* llama-cpp-python ``logits_all=True`` (what its prompt-lookup decoding needs): a
  full-vocabulary row for every prompt token.

All are loaded in one process with the same model, threads, n_ctx and
n_batch/n_ubatch, and measured interleaved round after round (the order
rotates), so a change in machine load hits every side alike; medians are reported.

    python benchmarks/prefill.py [MODEL] [--tokens 2048] [--threads 1] [--rounds 5] [--json OUT]

Target: localinfer >= llama-cpp-python default on a 2K prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

TEXT = (Path(__file__).with_name("data") / "kv_text.txt").read_text(encoding="utf-8")


def sides(model: str, n: int, threads: int) -> dict:
    from llama_cpp import Llama

    from localinfer.backends.engine import LoadPlan
    from localinfer.backends.registry import load_engine

    ctx = n + 256
    out = {}
    for name, fa in (("localinfer", None), ("localinfer_fa_off", False)):
        e = load_engine(LoadPlan(model, n_ctx=ctx, n_threads=threads, n_batch=512, n_ubatch=512, flash_attn=fa))
        toks = (e.tokenize(TEXT) * 8)[:n]

        def run(e=e, toks=toks):
            e.trim(0)
            e.eval(toks, logits_at=[-1])
        out[name] = run
    for name, all_logits in (("default", False), ("logits_all", True)):
        llm = Llama(model, n_ctx=ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, n_ubatch=512,
                    logits_all=all_logits, verbose=False)
        toks = (llm.tokenize(TEXT.encode(), add_bos=False) * 8)[:n]

        def run(llm=llm, toks=toks):
            llm.reset()
            llm.eval(toks)
        out[name] = run
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    from localinfer.model.sources import resolve_model

    model = str(resolve_model(args.model))
    runs = sides(model, args.tokens, args.threads)
    names = list(runs)
    rows = []
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            runs[name]()
            dt = time.perf_counter() - t0
            rows.append({"round": r, "side": name, "seconds": dt, "tok_s": args.tokens / dt})
            print(f"round {r}  {name:<18} {args.tokens} tokens  {dt:7.3f} s  {args.tokens / dt:8.1f} tok/s", flush=True)
    med = {s: statistics.median(x["tok_s"] for x in rows if x["side"] == s) for s in names}
    print("\nmedian prefill tok/s: " + ", ".join(f"{s} {v:.1f}" for s, v in med.items()))
    print(f"localinfer / default = {med['localinfer'] / med['default']:.3f} (target >= 1.0); "
          f"with flash attention off as the peer: {med['localinfer_fa_off'] / med['default']:.3f}; "
          f"localinfer / logits_all = {med['localinfer'] / med['logits_all']:.3f}")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"threads {args.threads}, {os.cpu_count()} CPUs, load average {load}")
    if args.json:
        with open(args.json, "w") as fo:
            json.dump({"benchmark": "prefill", "model": model, "tokens": args.tokens, "threads": args.threads,
                       "rows": rows, "median": med, "load_avg": load}, fo, indent=1)


if __name__ == "__main__":
    main()
