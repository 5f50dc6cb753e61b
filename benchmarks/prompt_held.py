"""What a prompt chunk costs after the positions its request already holds, in process (issue 45, the step model).

    python3 benchmarks/prompt_held.py [--model PATH] [--threads 2] [--reps 2] [--json OUT]

One llama.cpp executor as serve opens it for one request (4,096 cells, flash attention): for each h in 0, 512,
1,024, 2,048 a request prefilled to h positions, then a chunk of c = 64, 128, 256 or 512 tokens timed after it
(the faster of ``--reps``, each over a fresh prefix).  Prints each time, the price of a pair each chunk length
implies from h = 0 to 2,048 (one price a pair fits one length only where the chunk also pays once per held
position), and least-squares fits of the serving step model's prompt terms to the grid: tokens + pairs (one price a
pair) against tokens + pairs + held positions (``LinearStepModel.per_held_s``), each with and without a constant,
by their largest and root-mean-square relative errors.
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

from localinfer.model.cost import attention_pairs  # noqa: E402

HELD = (0, 512, 1024, 2048)
CHUNKS = (64, 128, 256, 512)


def grid(model: str, threads: int, reps: int) -> list[tuple[int, int, float]]:
    from localinfer.backends.executor import Chunk
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    rng = np.random.default_rng(0)
    words = lambda n: tuple(int(x) for x in rng.integers(100, 30000, n))  # noqa: E731
    out = []
    with LlamaCppExecutor.open(model, n_slots=2, n_ctx=4096, threads=threads) as ex:
        ex.step([Chunk(0, words(64), 0, True)])          # the first graph of each shape is not timed below
        for h in HELD:
            for c in CHUNKS:
                took = []
                for _ in range(reps):
                    ex.drop(0)
                    if h:
                        ex.step([Chunk(0, words(h), 0)])
                    t = time.perf_counter()
                    ex.step([Chunk(0, words(c), h, True)])
                    took.append(time.perf_counter() - t)
                out.append((c, h, min(took)))
                print(f"  chunk {c:4d} after {h:5d}: {min(took) * 1e3:8.1f} ms", flush=True)
    return out


def fits(rows: list[tuple[int, int, float]]) -> list[dict]:
    c, h, t = (np.array([r[i] for r in rows], dtype=float) for i in range(3))
    pairs = np.array([attention_pairs(int(a), int(b)) for a, b in zip(c, h)], dtype=float)
    one = np.ones_like(c)
    out = []
    for name, X in (("tokens + pairs", np.c_[c, pairs]), ("tokens + pairs + held", np.c_[c, pairs, h]),
                    ("const + tokens + pairs", np.c_[one, c, pairs]),
                    ("const + tokens + pairs + held", np.c_[one, c, pairs, h])):
        coef, *_ = np.linalg.lstsq(X, t, rcond=None)
        err = X @ coef / t - 1
        out.append({"model": name, "coefficients": [float(v) for v in coef],
                    "max_abs_err": float(np.abs(err).max()), "rms_err": float(np.sqrt((err ** 2).mean()))})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.model is None:
        from localinfer.model.sources import default_model_path

        a.model = str(default_model_path())
    print(f"{os.path.basename(a.model)}, {a.threads} threads, flash attention, the faster of {a.reps}")
    rows = grid(a.model, a.threads, a.reps)
    t = {(c, h): s for c, h, s in rows}
    print("a pair's price from 0 to 2,048 held positions, by chunk length:")
    for c in CHUNKS:
        price = (t[(c, 2048)] - t[(c, 0)]) / (attention_pairs(c, 2048) - attention_pairs(c, 0))
        print(f"  {c:4d} tokens: {price * 1e6:.2f} us a pair")
    got = fits(rows)
    for f in got:
        coef = ", ".join(f"{v:.3g}" for v in f["coefficients"])
        print(f"  {f['model']:30s} [{coef}]  max |err| {f['max_abs_err']:.1%}  rms {f['rms_err']:.1%}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": os.path.basename(a.model), "threads": a.threads,
                                            "grid": rows, "fits": got,
                                            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
