"""Does the torch backend's ``llamacpp_rounding`` give llama.cpp's logits to the bit on a long prompt?

A --prompt-token prompt goes through both engines with the same context,
threads and batch size (long enough that llama.cpp takes its tiled attention
kernel for the prefill chunks and, past a 512-cell KV view, the split-KV decode
kernel when it has more than one thread), then --steps greedy decode steps
follow llama.cpp's tokens.  Prints, per step, whether the logits are equal and
the largest difference; the short cases are in tests/test_torch_llamacpp_exact.py.

    python benchmarks/llamacpp_exact.py [--prompt 600] [--threads 2] [--steps 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from localinfer.model.sources import resolve_model

TEXT = "The quick brown fox jumps over the lazy dog near the river bank while the old miller watches. "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    kw = {"n_ctx": args.ctx, "n_threads": args.threads}
    ours = load_engine(LoadPlan(model, options={"quiet": True, "llamacpp_rounding": True}, **kw), "torch")
    ref = load_engine(LoadPlan(model, options={"quiet": True}, **kw), "llama.cpp")
    ids = ref.tokenize(TEXT * (args.prompt // 15 + 1))[: args.prompt]
    t0 = time.perf_counter()
    a = ours.eval(ids, logits_at=[len(ids) - 1])
    prefill_s = time.perf_counter() - t0
    b = ref.eval(ids, logits_at=[len(ids) - 1])
    rows = [{"step": "prefill", "kv_len": len(ids), "equal": bool(np.array_equal(a, b)),
             "max_abs_diff": float(np.abs(a - b).max())}]
    token = int(b[-1].argmax())
    for i in range(args.steps):
        a, b = ours.eval([token])[0], ref.eval([token])[0]
        rows.append({"step": i, "kv_len": ref.kv_len(), "equal": bool(np.array_equal(a, b)),
                     "max_abs_diff": float(np.abs(a - b).max())})
        token = int(b.argmax())
    for r in rows:
        print(f"{r['step']!s:>8}  kv {r['kv_len']:5}  {'equal' if r['equal'] else 'DIFFERENT':9}  max |d| {r['max_abs_diff']:.3g}")
    equal = sum(r["equal"] for r in rows)
    print(f"{equal}/{len(rows)} equal to the bit ({args.prompt}-token prompt, {args.threads} thread(s), "
          f"context {args.ctx}); emulated prefill {prefill_s:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "prompt_tokens": args.prompt, "threads": args.threads,
                                               "ctx": args.ctx, "cpus": os.cpu_count(), "rows": rows,
                                               "emulated_prefill_s": prefill_s}, indent=2) + "\n")


if __name__ == "__main__":
    main()
