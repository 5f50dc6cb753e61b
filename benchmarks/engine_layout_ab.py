"""Does the serving engine's own KV layout slow ``llama_decode``? One process, drift cancelled (issue 45, item 1).

The serve engine (the server's scheduler, host parking, compaction unless ``--no-compaction``) runs a closed loop of
4 clients over the executor ``serve`` builds (40 ids, 4096 cells, 2 threads, flash attention), no HTTP; every 25
engine steps, 8 four-row steps of a fresh executor (4 sequences after 300-token prompts, refilled as they reach 420
positions) run right after the engine's last 8 four-row calls; on both sides the executor's ``_decode`` is timed
(batch filling, ``llama_decode``, the logits rows).  The ratio of the two medians,
pair by pair, cancels this VM's minute-to-minute drift; its median and quartiles are printed.

    python3 benchmarks/engine_layout_ab.py [--requests 24] [--no-compaction]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.backends.executor import Chunk                                        # noqa: E402
from localinfer.backends.llamacpp import aside                                        # noqa: E402
from localinfer.backends.llamacpp.executor import LlamaCppExecutor                    # noqa: E402
from localinfer.model.sources import default_model_path                               # noqa: E402
from localinfer.serve.http.config import SERVE_SCHEDULER, ServeConfig, build_engine   # noqa: E402

ROWS, EVERY, PAIR = 4, 25, 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--no-compaction", action="store_true")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed if args.seed is not None else int(time.time()))
    model = str(default_model_path())
    opts = dict(n_slots=40, n_ctx=4096, threads=2, flash_attn=True, quiet=True)
    ex = LlamaCppExecutor.open(model, park_host=True, prefill_aside=aside.wanted(), **opts)    # as serve's plan
    clean = LlamaCppExecutor.open(model, **opts)
    if args.no_compaction:
        ex.compaction.able = False
    engine_d4: list[float] = []
    clean_d4: list[float] = []

    def timing(executor, into: list[float]):
        """Time ``executor``'s 4-row ``_decode`` calls (batch filling, llama_decode, logits rows), the same on both
        sides."""
        decode = executor._decode

        def timed(rows):
            t = time.perf_counter()
            out = decode(rows)
            if len(rows) == ROWS:
                into.append(time.perf_counter() - t)
            return out
        executor._decode = timed

    timing(ex, engine_d4)
    timing(clean, clean_d4)
    _, eng, _ = build_engine(ex, ServeConfig(scheduler=dataclasses.replace(SERVE_SCHEDULER, max_running=8)))
    pos = 0

    def clean_steps() -> float:
        nonlocal pos
        if pos == 0 or pos + PAIR > 420:
            for s in range(ROWS):
                if clean.slot_len(s):
                    clean.drop(s)
                clean.step([Chunk(s, tuple(int(x) for x in rng.integers(100, 20000, 300)), 0, True)])
            pos = 300
        clean_d4.clear()
        for _ in range(PAIR):
            clean.step([Chunk(s, (7,), pos, True) for s in range(ROWS)])
            pos += 1
        return statistics.median(clean_d4)

    live: set[str] = set()
    sent = done = steps = 0
    pairs: list[float] = []
    while done < args.requests:
        while len(live) < ROWS and sent < args.requests:
            live.add(eng.submit([int(x) for x in rng.integers(100, 20000, 300)], 128).id)
            sent += 1
        for ev in eng.step():
            if ev.token is None:
                live.discard(ev.request_id)
                eng.forget(ev.request_id)
                done += 1
        steps += 1
        if steps % EVERY == 0 and len(engine_d4) >= PAIR:
            e = statistics.median(engine_d4[-PAIR:])
            engine_d4.clear()
            pairs.append(e / clean_steps())
    q = statistics.quantiles(pairs, n=4)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {os.cpu_count()} CPUs, loadavg {os.getloadavg()[0]:.2f}; "
          f"compaction {'off' if args.no_compaction else 'on'} ({ex.compaction.count} compactions), "
          f"{args.requests} requests, {steps} engine steps")
    print(f"engine 4-row decode / a fresh executor's: median {statistics.median(pairs):.3f} over {len(pairs)} "
          f"pairs, quartiles {q[0]:.3f} / {q[2]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
