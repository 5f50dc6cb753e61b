"""The mlx backend: runner overhead, speed against llama.cpp, greedy agreement with llama.cpp.

    python benchmarks/mlx_backend.py [MODEL] [--tokens 32] [--rounds 3] [--greedy-tokens 64] [--threads N] [--json OUT]

1. Runner overhead: decode tok/s through localinfer (MLXEngine + Runner +
   PlainDecoder + greedy Sampler) against a bare MLX loop on the same model
   object and the same kind of cache (mlx-lm forward + mx.argmax + eval).
   The sides advance one token at a time in turn, so machine load hits both
   alike.  Target: localinfer / bare >= 0.95.
2. MLX against llama.cpp on this machine: prefill and decode tok/s, both
   through the Runner, same GGUF, same prompt, interleaved the same way.
3. Greedy agreement: ten prompts, --greedy-tokens tokens, step-by-step greedy
   on both engines, against llama.cpp on the GGUF itself and on an F32 copy of
   its weights (no activation rounding in llama.cpp).  For each divergence:
   the step and the top-1/top-2 logit gap of each engine there.

Decode tok/s is tokens / (sum of per-token step times) on every side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine

PROMPT = ", ".join(str(i) for i in range(1, 41)) + ","   # greedy keeps counting: no end-of-text
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are", "Water boils at", "In 1969, astronauts", "To make a cup of tea, first",
           "The largest planet in our solar system", "Photosynthesis is the process by which",
           "My favourite programming language is"]


def runner_steps(engine, prompt: list[int], n: int):
    """A generator timing localinfer: yields once after prefill, then once per decoded token."""
    from localinfer.generation.runner import Runner
    from localinfer.generation.sampling import SamplingParams

    runner = Runner(engine)
    stream = runner.stream(prompt, SamplingParams(greedy=True), max_tokens=n + 1, ignore_eos=True)
    for chunk in stream:
        if chunk.token is not None:
            yield chunk.token
    runner.reset()


def bare_steps(engine, prompt: list[int], n: int):
    """mlx-lm's model called directly - forward, argmax, eval - on the same kind of cache."""
    import mlx.core as mx

    from localinfer.backends.mlx import kv

    plan = engine.plan
    cache = kv.make_cache(engine.spec, plan.type_k, plan.type_v, engine.n_ctx)
    y = mx.argmax(engine.model(mx.array([prompt]), cache=cache)[0, -1])
    yield y.item()
    for _ in range(n):
        y = mx.argmax(engine.model(y.reshape(1, 1), cache=cache)[0, -1])
        yield y.item()


def speed(mlx_engine, cpp_engine, prompt: list[int], n: int, rounds: int) -> dict:
    """Decode steps of the three sides interleaved one token at a time (rotating order), so that
    all see the same machine load; prefill timed once per side per round."""
    sides = {"localinfer-mlx": lambda: runner_steps(mlx_engine, prompt, n),
             "bare-mlx": lambda: bare_steps(mlx_engine, prompt, n),
             "localinfer-llama.cpp": lambda: runner_steps(cpp_engine, prompt, n)}
    names = list(sides)
    step_s = {k: [] for k in names}
    prefill_s = {k: [] for k in names}
    for r in range(rounds):
        gens = {}
        for k in names:
            t0 = time.perf_counter()
            gens[k] = sides[k]()
            next(gens[k])
            prefill_s[k].append(time.perf_counter() - t0)
        for i in range(n):
            for k in names[i % 3:] + names[:i % 3]:
                t0 = time.perf_counter()
                next(gens[k])
                step_s[k].append(time.perf_counter() - t0)
        for g in gens.values():
            g.close()
        print(f"round {r}: " + ", ".join(f"{k} {n / sum(step_s[k][-n:]):.2f} tok/s" for k in names), flush=True)
    tok_s = {k: len(v) / sum(v) for k, v in step_s.items()}
    pre = {k: len(prompt) / statistics.median(v) for k, v in prefill_s.items() if k != "bare-mlx"}
    return {"decode_tok_s": tok_s, "prefill_tok_s": pre, "step_seconds": step_s,
            "runner_over_bare": tok_s["localinfer-mlx"] / tok_s["bare-mlx"],
            "median_step_ratio": statistics.median(b / a for a, b in zip(step_s["localinfer-mlx"], step_s["bare-mlx"])),
            "mlx_over_llamacpp_decode": tok_s["localinfer-mlx"] / tok_s["localinfer-llama.cpp"],
            "mlx_over_llamacpp_prefill": pre["localinfer-mlx"] / pre["localinfer-llama.cpp"]}


def greedy(engine, tokens: list[int], n: int, stop_after: list[int] | None = None):
    """(tokens, top1-top2 gaps); with stop_after, stop at the first token that differs from it."""
    engine.trim(0)
    out, gaps, row = [], [], engine.eval(tokens)[0]
    for i in range(n):
        top = np.sort(row)[-2:]
        out.append(int(row.argmax()))
        gaps.append(float(top[1] - top[0]))
        if (stop_after is not None and out[-1] != stop_after[i]) or i == n - 1:
            break
        row = engine.eval([out[-1]])[0]
    engine.trim(0)
    return out, gaps


def agreement(mlx_engine, ref_engine, n: int, label: str) -> dict:
    cases = []
    for prompt in PROMPTS:
        toks = ref_engine.tokenize(prompt)
        ref, ref_gaps = greedy(ref_engine, toks, n)
        ours, our_gaps = greedy(mlx_engine, toks, n, stop_after=ref)
        same = ours == ref
        case = {"prompt": prompt, "identical": same}
        if not same:
            i = len(ours) - 1
            case.update(step=i, mlx_gap=our_gaps[i], ref_gap=ref_gaps[i],
                        mlx_token=mlx_engine.detokenize([ours[i]]), ref_token=ref_engine.detokenize([ref[i]]))
        cases.append(case)
        print(f"  {label:<14} {'same' if same else 'DIFF'}  {prompt!r}"
              + ("" if same else f"  step {case['step']}: mlx {case['mlx_token']!r} (gap {case['mlx_gap']:.4f}) "
                 f"vs {case['ref_token']!r} (gap {case['ref_gap']:.4f})"), flush=True)
    identical = sum(c["identical"] for c in cases)
    print(f"  {label}: {identical}/{len(cases)} identical over {n} tokens", flush=True)
    return {"reference": label, "tokens": n, "identical": identical, "cases": cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per overhead/speed run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--greedy-tokens", type=int, default=64, help="0 skips the agreement check")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    from localinfer.backends.mlx.reference import write_f32_copy
    from localinfer.model.sources import resolve_model

    model = str(resolve_model(args.model))
    mlx_engine = load_engine(LoadPlan(model, n_ctx=args.ctx), "mlx")
    cpp_engine = load_engine(LoadPlan(model, n_ctx=args.ctx, n_threads=args.threads), "llama.cpp")
    print(f"{os.path.basename(model)}: mlx on {mlx_engine.device} ({mlx_engine.dtype}), "
          f"llama.cpp with {cpp_engine.plan.threads} threads", flush=True)
    doc = {"benchmark": "mlx_backend", "model": model, "machine": platform.machine(), "cpus": os.cpu_count(),
           "apple_silicon": sys.platform == "darwin" and platform.machine() == "arm64",
           "load_avg_start": os.getloadavg()}
    doc["speed"] = speed(mlx_engine, cpp_engine, mlx_engine.tokenize(PROMPT), args.tokens, args.rounds)
    s = doc["speed"]
    print(f"\nrunner overhead: localinfer/bare MLX decode = {s['runner_over_bare']:.3f} "
          f"(median per-step ratio {s['median_step_ratio']:.3f}; target >= 0.95)")
    print(f"MLX / llama.cpp on this machine: decode {s['mlx_over_llamacpp_decode']:.3f}, "
          f"prefill {s['mlx_over_llamacpp_prefill']:.3f}")
    if args.greedy_tokens:
        print("\ngreedy agreement:", flush=True)
        doc["greedy"] = [agreement(mlx_engine, cpp_engine, args.greedy_tokens, "same GGUF")]
        with tempfile.TemporaryDirectory() as tmp:
            copy = write_f32_copy(model, Path(tmp) / "f32.gguf")
            with load_engine(LoadPlan(str(copy), n_ctx=args.ctx, n_threads=args.threads), "llama.cpp") as f32:
                doc["greedy"].append(agreement(mlx_engine, f32, args.greedy_tokens, "F32 copy"))
    doc["load_avg_end"] = os.getloadavg()
    if not doc["apple_silicon"]:
        print("\nno Apple Silicon here: MLX ran on the CPU; the Metal comparison was not run")
    print(f"{os.cpu_count()} CPUs, load average {doc['load_avg_start']} -> {doc['load_avg_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)


if __name__ == "__main__":
    main()
