"""Which step-time model predicts a served load's steps: fitted on some steps, judged on the others (issue 45).

Reads ``serve --step-log`` files (one JSON line a step: its chunks as [request, start, tokens, ...], its start and end),
turns each step into the features a linear step model can weigh, and fits them by non-negative least squares:

- ``base``: fixed + tokens + causal pairs + chunks (serve's fitted LinearStepModel before the seventeenth session);
- ``view``: the same + decode rows x the step's view (the positions every chunk of the step holds after it, the
  cells llama.cpp's attention walks for each row on a CPU: ggml's flash attention visits every cell of the view,
  masked or not);
- ``view-all``: the same with every chunk's rows (a prompt's tokens too) against the view;
- ``split-pairs``: base with the pairs of chunks under ``ROW_CHUNK`` tokens (decode rows) a term apart from the
  prompts' (a row walks its cells one by one, a prompt's tile shares the walk): serve's model since then;
- ``held``: split-pairs + each prompt chunk's positions already held (a chunk of ``ROW_CHUNK`` tokens or more after
  h pays about h times a fixed price beside its pairs: on the 2-vCPU VM a 64-token chunk 2,048 positions in cost
  1.45 us a pair more than at 0, a 512-token one 0.94: prompt_held.py).

Each model is fitted on the steps with at most ``--train-rows`` decode rows and judged on all, by the number of
decode rows and the step's prompt (none; a first chunk; a later one, of 2 tokens or more after positions its
request holds: also a chunk after a prefix-cache hit): median and p90 of |predicted - actual| / actual, and the
median signed error (negative: the model says the step is shorter than it was, which is what makes deadline
admission admit requests it then cuts).

    python3 benchmarks/step_model_fit.py LOG [LOG ...] [--train-rows 4]
    python3 benchmarks/step_model_fit.py LOG --served      # the server's own predictions of its prompt steps
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.model.cost import attention_pairs  # noqa: E402
from localinfer.serve.step_log import read_step_log  # noqa: E402
from localinfer.serve.step_model import features as step_features  # noqa: E402


def steps(paths) -> list[tuple[list[tuple[int, int]], float]]:
    """(shapes [(tokens, start)], seconds) of every step with chunks, in the logs' order."""
    out = []
    for p in paths:
        for rec in read_step_log(p):
            shapes = [(int(c[2]), int(c[1])) for c in rec.get("chunks", [])]
            if shapes and not rec.get("interrupted") and rec["end_s"] > rec["start_s"]:
                out.append((shapes, float(rec["end_s"]) - float(rec["start_s"])))
    return out


MODELS = ("base", "view", "view-all", "split-pairs", "held")


def features(shapes, model: str) -> list[float]:
    """The model's features of one step (module docstring); ``view-all`` counts every chunk's rows, not only
    decodes', against the view.  ``held`` is serve's own (``step_model.features``), ``split-pairs`` the same
    without its held positions; their columns in the order the names are printed in."""
    if model in ("split-pairs", "held"):
        tokens, pairs, rows, chunks, held = step_features(shapes)
        return [1.0, tokens, pairs, chunks, rows] + ([held] if model == "held" else [])
    f = [1.0, float(sum(c for c, _ in shapes)), float(sum(attention_pairs(c, h) for c, h in shapes)),
         float(len(shapes))]
    if model != "base":
        rows = sum(c for c, _ in shapes if model == "view-all" or c == 1)
        f.append(float(rows * sum(c + h for c, h in shapes)))
    return f


def judge(data, model: str, train_rows: int) -> tuple[np.ndarray, dict]:
    X = np.array([features(s, model) for s, _ in data])
    y = np.array([t for _, t in data])
    rows = np.array([sum(1 for c, _ in s if c == 1) for s, _ in data])
    prompt = np.array([("later" if any(c > 1 and h > 0 for c, h in s) else "first") if any(c > 1 for c, _ in s)
                       else "no" for s, _ in data])
    train = rows <= train_rows
    scale = X[train].max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(X[train] / scale, y[train])
    coef = coef / scale
    err = (X @ coef - y) / y
    by = defaultdict(list)
    for r, p, e in zip(rows, prompt, err):
        by[(int(r), str(p))].append(e)
    return coef, by


def served(paths) -> None:
    """Each prompt step's time against what the server's step model predicted for it (the log's ``predicted_s``),
    then per log and kind of prompt step (a request's first chunk, or a later one) the ratios' median, the median
    and p90 of |ratio - 1|, and the extremes."""
    for p in paths:
        kinds = defaultdict(list)
        for i, rec in enumerate(read_step_log(p)):
            prompt = [c for c in rec.get("chunks", []) if c[2] > 1]
            if prompt and rec.get("predicted_s") and not rec.get("interrupted"):
                took, said = rec["end_s"] - rec["start_s"], rec["predicted_s"]
                kinds["later" if any(c[1] > 0 for c in prompt) else "first"].append(said / took)
                print(f"{p} step {i}: prompt chunks {[c[2] for c in prompt]}, {len(rec['chunks']) - len(prompt)} "
                      f"decode rows: took {took * 1e3:.0f} ms, predicted {said * 1e3:.0f} ms ({said / took:.2f}x)")
        for kind, v in sorted(kinds.items()):
            v = np.array(v)
            print(f"{p} {kind} chunks: {len(v)} steps, predicted/took median {np.median(v):.3f}, |err| p50 "
                  f"{np.median(abs(v - 1)):.1%} p90 {np.quantile(abs(v - 1), 0.9):.1%}, {v.min():.2f}-{v.max():.2f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--train-rows", type=int, default=4, help="fit on steps with at most this many decode rows")
    ap.add_argument("--served", action="store_true", help="print the server's own predictions of its prompt steps")
    a = ap.parse_args(argv)
    if a.served:
        served(a.logs)
        return 0
    data = steps(a.logs)
    print(f"{len(data)} steps from {len(a.logs)} log(s); fitted on steps of <= {a.train_rows} decode rows")
    for model in MODELS:
        coef, by = judge(data, model, a.train_rows)
        names = ["fixed ms", "per token us", "per pair ns", "per chunk us",
                 "per row-cell ns" if model.startswith("view") else "per decode pair ns", "per held position us"]
        units = [1e3, 1e6, 1e9, 1e6, 1e9, 1e6]
        print(f"\n{model}: " + ", ".join(f"{n} {c * u:.3g}" for n, c, u in zip(names, coef, units)))
        print("  rows  prompt  steps  |err| p50   p90   signed p50")
        for (r, p), e in sorted(by.items()):
            e = np.array(e)
            print(f"  {r:4d}  {p:>6}  {len(e):5d}  {np.median(np.abs(e)):8.1%}  "
                  f"{np.quantile(np.abs(e), 0.9):6.1%}  {np.median(e):+8.1%}")
    print(json.dumps({"steps": len(data), "train_rows": a.train_rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
