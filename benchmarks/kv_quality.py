"""KV cache quantization quality: perplexity of a fixed text with f16, q8_0 and q4_0 K/V caches.

The text (benchmarks/data/kv_text.txt, about 900 tokens) is evaluated in one
sequence, in chunks of --chunk tokens with logits at every position, so each
token is predicted from the whole text before it through the quantized cache.
Flash attention is on for every run (llama.cpp needs it for a quantized V), so
only the cache type differs.

    python benchmarks/kv_quality.py [MODEL] [--threads 1] [--chunk 64] [--json OUT]

Target: perplexity with q8_0 within 1% of f16; q4_0 reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

TEXT = Path(__file__).with_name("data") / "kv_text.txt"


def perplexity(engine, tokens: list[int], chunk: int) -> tuple[float, float]:
    """(perplexity, mean negative log-likelihood) of tokens[1:] given everything before."""
    engine.trim(0)
    nll, count = 0.0, 0
    prev = None
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        logits = engine.eval(piece, logits_at=list(range(len(piece)))).astype(np.float64)
        m = logits.max(axis=1, keepdims=True)
        logp = logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
        targets = piece[1:]
        nll -= float(logp[np.arange(len(targets)), targets].sum())
        if prev is not None:
            nll -= float(prev[piece[0]])
        count += len(targets) + (prev is not None)
        prev = logp[-1]
    engine.trim(0)
    return math.exp(nll / count), nll / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--kv", default="f16,q8_0,q4_0")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    from localinfer.backends.engine import LoadPlan
    from localinfer.backends.registry import load_engine
    from localinfer.model.sources import resolve_model

    model = str(resolve_model(args.model))
    text = TEXT.read_text(encoding="utf-8")
    rows = []
    for kv in args.kv.split(","):
        plan = LoadPlan(model, n_ctx=2048, type_k=kv, type_v=kv, flash_attn=True, n_threads=args.threads)
        with load_engine(plan) as e:
            tokens = e.tokenize(text, add_bos=True)
            t0 = time.perf_counter()
            ppl, nll = perplexity(e, tokens, args.chunk)
            rows.append({"kv": kv, "tokens": len(tokens), "perplexity": ppl, "nll": nll,
                         "kv_bytes": e.memory()["kv"], "seconds": time.perf_counter() - t0})
        print(f"KV {kv:<5} {len(tokens)} tokens  perplexity {ppl:8.4f}  KV {rows[-1]['kv_bytes'] / 2**20:6.2f} MiB",
              flush=True)
    base = next((r for r in rows if r["kv"] == "f16"), rows[0])
    print()
    for r in rows:
        r["vs_f16"] = r["perplexity"] / base["perplexity"] - 1
        print(f"{r['kv']:<5} perplexity {r['perplexity']:.4f}  {r['vs_f16'] * 100:+.2f}% vs {base['kv']}")
    print("target: q8_0 within 1% of f16")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "kv_quality", "model": model, "text": str(TEXT), "chunk": args.chunk,
                       "rows": rows, "load_avg": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
