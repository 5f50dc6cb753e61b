"""The torch backend against llama.cpp on the CPU: speed, where the time goes, agreement.

Both engines load the same GGUF through the registry with the same threads and
context; each measurement alternates between them and keeps the median.

* prefill tok/s: one eval of a --prompt-token prompt (logits of the last token only);
* decode tok/s: --tokens single-token evals after a short prompt;
* batch decode: one eval_batch step over --batch sequences (torch only: aggregate tok/s);
* --profile: torch.profiler over decode steps, time by kind of op;
* --agreement: greedy --gen tokens on 10 fixed prompts against llama.cpp (flash attention
  on, its default), for the torch backend as it runs by default and with
  ``llamacpp_rounding`` (its emulation of llama.cpp's CPU kernels, which must give
  the same logits to the bit), with llama.cpp's own flash-attention-off path as the
  yardstick, plus teacher-forced top-1 agreement and the largest logit difference.

    python benchmarks/torch_backend.py [MODEL] [--threads 1] [--prompt 256] [--tokens 32]
        [--rounds 3] [--batch 4] [--profile] [--agreement] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from localinfer.model.sources import resolve_model

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "Water boils at", "In 1492, Columbus", "The best way to learn a language is", "import numpy as np\n",
           "My favourite food is", "The sun is a"]
FILLER = "The quick brown fox jumps over the lazy dog while the river runs past the old mill. "


def _engine(backend: str, model: str, args, **kw):
    plan = LoadPlan(model, n_ctx=kw.pop("n_ctx", args.prompt + args.tokens + 64), n_threads=args.threads,
                    options=kw.pop("options", {"quiet": True}), **kw)
    return load_engine(plan, backend)


def speed(eng, args) -> dict:
    prompt = (eng.tokenize(FILLER * (args.prompt // 8 + 1)))[: args.prompt]
    eng.trim(0)
    t0 = time.perf_counter()
    logits = eng.eval(prompt)[0]
    prefill = len(prompt) / (time.perf_counter() - t0)
    eng.trim(0)
    logits = eng.eval(prompt[:16])[0]
    t0 = time.perf_counter()
    for _ in range(args.tokens):
        logits = eng.eval([int(logits.argmax())])[0]
    return {"prefill_tok_s": prefill, "decode_tok_s": args.tokens / (time.perf_counter() - t0)}


def batch_speed(model: str, args) -> float:
    eng = _engine("torch", model, args, n_seq=args.batch, n_ctx=args.batch * (args.tokens + 64))
    steps = {s: [int(eng.eval(eng.tokenize(PROMPTS[s % len(PROMPTS)]), seq=s)[0].argmax())] for s in range(args.batch)}
    t0 = time.perf_counter()
    for _ in range(args.tokens):
        steps = {s: [int(lg.argmax())] for s, lg in eng.eval_batch(steps).items()}
    rate = args.batch * args.tokens / (time.perf_counter() - t0)
    eng.close()
    return rate


_KINDS = [("matmul", ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm")),
          ("attention", ("aten::_softmax", "aten::softmax", "aten::masked_fill", "aten::tril")),
          ("kv cache", ("aten::index_put_", "aten::_index_put_impl_", "aten::index", "aten::slice")),
          ("casts/copies", ("aten::_to_copy", "aten::copy_", "aten::to", "aten::contiguous", "aten::clone")),
          ("elementwise", ("aten::mul", "aten::add", "aten::silu", "aten::rsqrt", "aten::pow", "aten::mean",
                           "aten::sub", "aten::cat", "aten::stack", "aten::neg", "aten::div"))]


def profile(model: str, args) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    eng = _engine("torch", model, args)
    logits = eng.eval(eng.tokenize(PROMPTS[0]))[0]
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(8):
            logits = eng.eval([int(logits.argmax())])[0]
        wall = time.perf_counter() - t0
    eng.close()
    share = {name: 0.0 for name, _ in _KINDS}
    share["other"] = 0.0
    total = 0.0
    for ev in prof.key_averages():
        t = ev.self_cpu_time_total
        total += t
        kind = next((name for name, ops in _KINDS if ev.key in ops), "other")
        share[kind] += t
    ops_per_token = sum(ev.count for ev in prof.key_averages()) / 8
    return {"ms_per_token": 1e3 * wall / 8, "ops_per_token": ops_per_token,
            "share": {k: v / total for k, v in share.items()}}


def _greedy(eng, prompt: str, n: int, seq: int = 0) -> tuple[list[int], list[float]]:
    eng.trim(0, seq)
    logits = eng.eval(eng.tokenize(prompt), seq=seq)[0]
    out, margins = [], []
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        margins.append(float(top2[1] - top2[0]))
        out.append(int(logits.argmax()))
        logits = eng.eval([out[-1]], seq=seq)[0]
    return out, margins


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def agreement(model: str, args) -> dict:
    ctx = 160 + args.gen
    ours_eng = _engine("torch", model, args, n_ctx=ctx)
    exact_eng = _engine("torch", model, args, n_ctx=ctx, options={"quiet": True, "llamacpp_rounding": True})
    cpp = _engine("llama.cpp", model, args, n_ctx=ctx)
    cpp_off = _engine("llama.cpp", model, args, n_ctx=ctx, flash_attn=False)
    rows = []
    tf = {"agree": 0, "total": 0, "max_dlogit": 0.0, "cpp_off_max_dlogit": 0.0, "rounding_max_dlogit": 0.0,
          "rounding_agree": 0}
    for prompt in PROMPTS:
        ref, ref_margins = _greedy(cpp, prompt, args.gen)
        mine, _ = _greedy(ours_eng, prompt, args.gen)
        exact, _ = _greedy(exact_eng, prompt, args.gen)
        other, _ = _greedy(cpp_off, prompt, args.gen)
        d_ours, d_exact, d_cpp = _first_diff(mine, ref), _first_diff(exact, ref), _first_diff(other, ref)
        rows.append({"prompt": prompt, "torch_diverges_at": d_ours, "rounding_diverges_at": d_exact,
                     "llama_cpp_fa_off_diverges_at": d_cpp,
                     "llama_cpp_margin_there": None if d_ours is None else round(ref_margins[d_ours], 3)})
        ids = cpp.tokenize(prompt)
        seq = ids + ref[:-1]
        at = list(range(len(ids) - 1, len(seq)))
        logits = {}
        for name, eng in (("ref", cpp), ("ours", ours_eng), ("exact", exact_eng), ("off", cpp_off)):
            eng.trim(0)
            logits[name] = eng.eval(seq, logits_at=at)
        tf["agree"] += int((logits["ours"].argmax(1) == logits["ref"].argmax(1)).sum())
        tf["rounding_agree"] += int((logits["exact"].argmax(1) == logits["ref"].argmax(1)).sum())
        tf["total"] += len(at)
        tf["max_dlogit"] = max(tf["max_dlogit"], float(np.abs(logits["ours"] - logits["ref"]).max()))
        tf["rounding_max_dlogit"] = max(tf["rounding_max_dlogit"], float(np.abs(logits["exact"] - logits["ref"]).max()))
        tf["cpp_off_max_dlogit"] = max(tf["cpp_off_max_dlogit"], float(np.abs(logits["off"] - logits["ref"]).max()))
    for eng in (ours_eng, exact_eng, cpp, cpp_off):
        eng.close()
    return {"greedy": rows, "teacher_forced": tf,
            "identical_torch": sum(r["torch_diverges_at"] is None for r in rows),
            "identical_torch_rounding": sum(r["rounding_diverges_at"] is None for r in rows),
            "identical_llama_cpp_fa_off": sum(r["llama_cpp_fa_off_diverges_at"] is None for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--agreement", action="store_true")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    result: dict = {"model": model, "threads": args.threads, "prompt_tokens": args.prompt, "decode_tokens": args.tokens,
                    "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}

    engines = {b: _engine(b, model, args) for b in ("torch", "llama.cpp")}
    runs = {b: [] for b in engines}
    for _ in range(args.rounds):
        for b, eng in engines.items():
            runs[b].append(speed(eng, args))
    for eng in engines.values():
        eng.close()
    med = {b: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for b, rs in runs.items()}
    result["speed"] = med
    print(f"{'':12}{'prefill tok/s':>15}{'decode tok/s':>15}   ({args.prompt}-token prompt, {args.tokens} decode "
          f"steps, {args.threads} thread(s), median of {args.rounds})")
    for b, m in med.items():
        print(f"{b:12}{m['prefill_tok_s']:15.1f}{m['decode_tok_s']:15.1f}")
    ratio = {k: med["torch"][k] / med["llama.cpp"][k] for k in med["torch"]}
    result["ratio_torch_over_llama_cpp"] = ratio
    print(f"{'torch/llama':12}{ratio['prefill_tok_s']:15.2f}{ratio['decode_tok_s']:15.2f}")
    if args.batch > 1:
        result["torch_batch_decode_tok_s"] = rate = batch_speed(model, args)
        print(f"torch eval_batch of {args.batch}: {rate:.1f} tok/s aggregate "
              f"({rate / med['torch']['decode_tok_s']:.2f}x single-sequence decode)")
    if args.profile:
        result["profile"] = prof = profile(model, args)
        parts = ", ".join(f"{k} {v:.0%}" for k, v in sorted(prof["share"].items(), key=lambda kv: -kv[1]))
        print(f"torch decode profile: {prof['ms_per_token']:.1f} ms/token, {prof['ops_per_token']:.0f} aten ops/token; "
              f"self CPU time: {parts}")
    if args.agreement:
        result["agreement"] = agr = agreement(model, args)
        print(f"greedy {args.gen} tokens, 10 prompts, vs llama.cpp (flash attention on):")
        for r in agr["greedy"]:
            at = r["torch_diverges_at"]
            ours = "identical" if at is None else f"diverges at {at} (llama.cpp top-2 margin {r['llama_cpp_margin_there']})"
            exact, off = r["rounding_diverges_at"], r["llama_cpp_fa_off_diverges_at"]
            print(f"  {r['prompt']!r:40} torch: {ours:45} with llamacpp_rounding: "
                  f"{'identical' if exact is None else exact:10} llama.cpp FA off: {'identical' if off is None else off}")
        tf = agr["teacher_forced"]
        print(f"identical: torch {agr['identical_torch']}/10, torch with llamacpp_rounding "
              f"{agr['identical_torch_rounding']}/10, llama.cpp FA off {agr['identical_llama_cpp_fa_off']}/10")
        print(f"teacher-forced top-1 agreement: torch {tf['agree']}/{tf['total']}, with llamacpp_rounding "
              f"{tf['rounding_agree']}/{tf['total']}; max |dlogit| torch {tf['max_dlogit']:.3f}, with "
              f"llamacpp_rounding {tf['rounding_max_dlogit']:.3g}, llama.cpp FA off {tf['cpp_off_max_dlogit']:.3f}")
    result["load_avg_end"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
