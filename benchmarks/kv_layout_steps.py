"""What a decode step costs over a wave's KV layout against a churned one, and a compacted one (in process).

    python benchmarks/kv_layout_steps.py [--rounds 2] [--loop] [--rows 8]

Both layouts hold 8 sequences in one unified cache of 4096 cells (SmolLM2 by default, 2 threads, flash
attention on) with ~3,330 cells in use.  ``wave``: 8 prompts of 300 random tokens, then 117 decode steps
of 8 rows (as llama-server's closed loop lays cells out: the prompts in 8 runs, then the decodes
interleaved above them).  ``churn``: 8 slots starting 16 steps apart, each replaced by a fresh 300-token
prompt after 128 decodes, for 300 steps (as a staggered closed loop leaves them: llama.cpp places new cells
from its moving head, into the holes finished sequences left).  For each: the cells in use, how many runs
of adjacent cells each sequence's cells form (``cells()`` lists them in cache order; neither layout has an
empty cell below its top), and the median of 30 more 8-row decode steps.  ``compacted``: the churn, then the
executor's ``compact()`` (each sequence's cells written back in one run, localinfer/backends/llamacpp/compaction.py).

``--loop``: the churn itself timed whole (400 steps: 8 staggered sequences, each replaced after 128 decodes), with
the executor's compaction policy off and on, alternated: total seconds, seconds inside llama_decode, compactions
and what they cost.  Every sequence is compacted automatically in serving; the policy off is the layout before.
``--rows N``: N sequences instead of 8, started 128 / N steps apart.  Each line says whether lone prompts went to
the executor's second context (aside.py; asked for as serve does, unless ``LOCALINFER_PREFILL_ASIDE=0``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.backends.executor import Chunk                        # noqa: E402
from localinfer.backends.llamacpp import aside                        # noqa: E402
from localinfer.backends.llamacpp.executor import LlamaCppExecutor    # noqa: E402
from localinfer.model.sources import default_model_path               # noqa: E402

ROWS = 8


def runs(ex) -> list[int]:
    """Per slot, the runs of adjacent cells its cells form (a dense cache: cache order is cell order)."""
    got: dict[int, int] = {}
    last = None
    for _pos, slots in ex.cells():
        if slots[0] != last:
            got[slots[0]] = got.get(slots[0], 0) + 1
        last = slots[0]
    return sorted(got.values())


def decode(ex, lens: list[int], n: int) -> list[float]:
    ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        ex.step([Chunk(s, (7,), lens[s], True) for s in range(ROWS)])
        ms.append((time.perf_counter() - t0) * 1e3)
        lens[:] = [x + 1 for x in lens]
    return ms


def wave(ex, toks) -> list[int]:
    for s in range(ROWS):
        ex.step([Chunk(s, toks(300), 0)])
    lens = [300] * ROWS
    decode(ex, lens, 117)
    return lens


def churn(ex, toks, steps: int = 400, settle: int | None = 300) -> list[int]:
    """ROWS slots starting 128 / ROWS steps apart, each replaced by a fresh prompt after 128 decodes; from step
    ``settle`` on none is replaced and it stops once every slot holds 360 tokens (``settle`` None: replaced to the
    end)."""
    lens, left = [0] * ROWS, [0] * ROWS
    for step in range(steps):
        chunks = []
        for s in range(ROWS):
            if not lens[s] and step >= 128 // ROWS * s:
                chunks.append(Chunk(s, toks(300), 0, True))
                left[s] = 128
            elif lens[s]:
                chunks.append(Chunk(s, (7,), lens[s], True))
        ex.step(chunks)
        for c in chunks:
            lens[c.slot] = c.start + len(c.tokens)
            left[c.slot] -= len(c.tokens) == 1
        settled = settle is not None and step >= settle
        if settled and min(lens) >= 360:
            break
        for s in range(ROWS):
            if lens[s] and not left[s] and not settled:
                ex.drop(s)
                lens[s] = 0
    return lens


def compacted(ex, toks) -> list[int]:
    lens = churn(ex, toks)
    assert ex.compact()
    return lens


def open_executor(model: str, threads: int) -> LlamaCppExecutor:
    return LlamaCppExecutor.open(model, n_slots=ROWS + 1, n_ctx=4096, threads=threads, flash_attn=True, quiet=True,
                                 prefill_aside=aside.wanted())     # as serve asks for it


def main(argv=None) -> int:
    global ROWS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--loop", action="store_true", help="time the churn loop whole, compaction policy off and on")
    ap.add_argument("--rows", type=int, default=ROWS, help="sequences, 1 to 9 (default 8)")
    args = ap.parse_args(argv)
    if not 1 <= args.rows <= 9:      # each holds up to 428 of the 4096 cells
        ap.error(f"--rows must be 1 to 9, got {args.rows}")
    ROWS = args.rows
    model = args.model or str(default_model_path())
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} loadavg {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, "
          f"threads {args.threads}, {ROWS} sequences", flush=True)
    if args.loop:
        for rnd in range(args.rounds):
            for auto in ((False, True) if rnd % 2 == 0 else (True, False)):
                rng = np.random.default_rng(1)
                toks = lambda n: tuple(int(t) for t in rng.integers(100, 20000, n))    # noqa: E731
                with open_executor(model, args.threads) as ex:
                    ex.compaction.auto = auto
                    t0 = time.perf_counter()
                    churn(ex, toks, settle=None)
                    total, c = time.perf_counter() - t0, ex.compaction
                    print(f"loop compaction {'on ' if auto else 'off'}  total {total:6.2f} s  llama_decode "
                          f"{ex.decode_seconds:6.2f} s  compactions {c.count} taking {c.seconds:.2f} s "
                          f"({c.bytes / 2**20:.0f} MiB moved)  aside {ex.prefill_aside is not None}  "
                          f"loadavg {os.getloadavg()[0]:.2f}", flush=True)
        return 0
    for _ in range(args.rounds):
        for name, build in (("wave", wave), ("churn", churn), ("compacted", compacted)):
            rng = np.random.default_rng(1)
            toks = lambda n: tuple(int(t) for t in rng.integers(100, 20000, n))    # noqa: E731
            with open_executor(model, args.threads) as ex:
                ex.compaction.auto = False
                lens = build(ex, toks)
                used, r = ex.cells_used(), runs(ex)
                ms = decode(ex, lens, 30)
            print(f"{name:<9} cells {used}  runs per slot {r}  {ROWS}-row decode step median "
                  f"{statistics.median(ms):.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
