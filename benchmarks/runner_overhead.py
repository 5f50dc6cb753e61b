"""Runner overhead: decode tok/s through `localinfer run` vs llama-cpp-python's own create_completion.

Same model, prompt, threads, context and greedy decoding in both; each side
runs in a fresh process, alternating, and decode tok/s is measured the same
way on both: (tokens - 1) / (time from the first streamed token to the last).
The prompt is a count (1, 2, ... 20,) that greedy decoding continues, so neither side
meets an end-of-text token and both generate exactly --tokens.

    python benchmarks/runner_overhead.py [MODEL] [--tokens 128] [--threads 1] [--rounds 5] [--json OUT]

Target: localinfer / llama-cpp-python >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROMPT = ", ".join(str(i) for i in range(1, 21)) + ","  # greedy continues counting: no end-of-text token

_PEER = r"""
import json, sys, time
from llama_cpp import Llama
model, prompt, n, threads, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = Llama(model, n_ctx=ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
stamps = []
for chunk in llm.create_completion(prompt, max_tokens=n, temperature=0.0, stream=True):
    if chunk["choices"][0]["finish_reason"] is None:  # the closing chunk carries no token
        stamps.append(time.perf_counter())
print(json.dumps({"tokens": len(stamps), "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}))
"""


def ours(model: str, n: int, threads: int, ctx: int) -> dict:
    cmd = [sys.executable, "-m", "localinfer", "run", model, "-p", PROMPT, "--raw", "--temp", "0", "-n", str(n),
           "-t", str(threads), "--ctx", str(ctx), "--json"]
    doc = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    t = doc["timings"]
    return {"tokens": t["generated_tokens"], "decode_tok_s": t["decode_tok_s"], "finish": doc["finish_reason"]}


def peer(model: str, n: int, threads: int, ctx: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _PEER, model, PROMPT, str(n), str(threads), str(ctx)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    from localinfer.model.sources import resolve_model

    model = str(resolve_model(args.model))
    rows = []
    for r in range(args.rounds):
        pair = [("localinfer", ours), ("llama-cpp-python", peer)]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            m = fn(model, args.tokens, args.threads, args.ctx)
            rows.append({"round": r, "side": name, **m})
            print(f"round {r}  {name:<17} {m['tokens']:>4} tokens  {m['decode_tok_s']:8.2f} tok/s", flush=True)
    med = {side: statistics.median(x["decode_tok_s"] for x in rows if x["side"] == side)
           for side in ("localinfer", "llama-cpp-python")}
    ratio = med["localinfer"] / med["llama-cpp-python"]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\nmedian decode tok/s: localinfer run {med['localinfer']:.2f}, create_completion "
          f"{med['llama-cpp-python']:.2f}; ratio {ratio:.3f} (target >= 0.95)")
    print(f"threads {args.threads}, {args.tokens} tokens, {os.cpu_count()} CPUs, load average {load}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "runner_overhead", "model": model, "threads": args.threads, "tokens": args.tokens,
                       "rows": rows, "median": med, "ratio": ratio, "load_avg": load}, f, indent=1)


if __name__ == "__main__":
    main()
