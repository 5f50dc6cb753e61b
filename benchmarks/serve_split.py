"""What decodes cost beside a long prefill in one llama.cpp step: in the prefill's ubatch, or in a call of their own.

``LlamaCppExecutor.split_short`` (CPU, flash attention on) decodes chunks under 64 tokens in a call of their
own before the long ones.  This measures one step of a 302-token prefill on a fresh slot beside ``k``
decodes of other slots that hold 302 tokens each (the shape of the steps while 8 prompts arriving together
are prefilled), split on and off, interleaved ``--reps`` times (on, off, off, on, ...), median ms; and the
largest |Δ| between a decode row computed inside such a step and the same row from a step of the same
decodes alone (0 at 1 thread with the split; at 2 threads ggml's row chunking can part them).

    python benchmarks/serve_split.py [--threads 2] [--reps 5] [--out benchmarks/results/serve_split_cpu.txt]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from localinfer.backends.executor import Chunk
from localinfer.backends.llamacpp.executor import LlamaCppExecutor
from localinfer.model.sources import default_model_path

PROMPT = 302


def measure(threads: int, reps: int, others: int) -> list[str]:
    rng = random.Random(0)
    tok = lambda n: tuple(rng.randrange(1000, 20000) for _ in range(n))
    lines = []
    with LlamaCppExecutor.open(str(default_model_path()), n_slots=others + 1, n_ctx=4096, threads=threads,
                               flash_attn=True) as ex:
        held = [0] * ex.n_slots
        for s in range(others):
            ex.step([Chunk(s, tok(PROMPT), 0)])
            held[s] = PROMPT
        new = others

        def step(k: int, split: bool) -> tuple[float, np.ndarray | None]:
            ex.split_short = split
            chunks = [Chunk(s, (100 + s,), held[s], True) for s in range(k)]
            t0 = time.perf_counter()
            rows = ex.step([*chunks, Chunk(new, tok(PROMPT), 0, True)])
            dt = time.perf_counter() - t0
            for s in range(k):
                ex.drop(s, held[s])
            ex.drop(new)
            return dt, rows.get(0)

        step(0, True)                                      # warm-up
        for k in (0, 1, 3, others):
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(reps):
                for split in ((True, False) if i % 2 == 0 else (False, True)):
                    times[split].append(step(k, split)[0])
            on, off = (statistics.median(times[b]) * 1e3 for b in (True, False))
            lines.append(f"302-token prefill + {k} decodes   split {on:7.1f} ms   one ubatch {off:7.1f} ms   "
                         f"ratio {on / off:.2f}x")
        ex.split_short = True
        decodes = [Chunk(s, (100 + s,), held[s], True) for s in range(others)]
        alone = ex.step(decodes)[0]                        # the same decode rows, a decode-only step
        for s in range(others):
            ex.drop(s, held[s])
        for split in (True, False):
            row = step(others, split)[1]
            lines.append(f"slot 0's decode row beside the prefill vs the same {others} decodes alone, split "
                         f"{'on ' if split else 'off'}: max |delta| {float(np.abs(row - alone).max()):.3f}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--others", type=int, default=7, help="slots holding 302 tokens that decode beside the prefill")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    head = [f"serve_split: decodes beside a 302-token prefill, {args.threads} threads, flash attention on, "
            f"{args.others} other slots of {PROMPT} tokens, unified cache, median of {args.reps}",
            f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} before"]
    lines = head + measure(args.threads, args.reps, args.others)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
