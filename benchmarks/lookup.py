"""Prompt-lookup speculative decoding against plain decoding and llama-cpp-python's implementation.

For every prompt of each suite (``benchmarks/lookup_prompts/<suite>/*.txt``, the
user message, wrapped in the model's chat template) it runs greedy decoding
side by side on the same machine:

* plain   - localinfer's PlainDecoder on the chosen backend;
* lookup  - localinfer's LookupDecoder (fresh per prompt, as ``run --lookup``);
* stock10 / stock2 - llama-cpp-python's ``LlamaPromptLookupDecoding`` with
  num_pred_tokens 10 and 2 (needs ``logits_all=True``), llama.cpp backend only.

Decode time is the time from the first emitted token to the last (prefill
excluded), per token ΣT/ΣN.  Each output is compared with plain greedy; at a
divergence the plain run's logit margin between the two tokens is printed
(it should be a near-tie from batched numerics).  A last section measures
the lookup cost per round at 32K tokens of history against a decode step.

    python benchmarks/lookup.py                      # both suites, 256 tokens, llama.cpp
    python benchmarks/lookup.py --suite grounded --limit 3 --no-stock
    python benchmarks/lookup.py --kv q8_0 --json out.json
    python benchmarks/lookup.py --backend torch --no-stock

Targets (issue 5): grounded >= 1.5x plain, free-form >= 0.97x, identical to plain
on >= 95% of prompts, lookup >= 1.3x the better stock setting.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from localinfer.generation.decoding import PlainDecoder
from localinfer.generation.lookup import LookupDecoder
from localinfer.generation.runner import Runner
from localinfer.generation.sampling import Sampler, SamplingParams
from localinfer.model.sources import resolve_model
from localinfer.model.spec import ModelSpec
from localinfer.model.templates import template_for
from localinfer.plan.speculation import clairvoyant_speedup

PROMPTS = Path(__file__).parent / "lookup_prompts"
GREEDY = SamplingParams(greedy=True)
REPLY_MARK = "\n=== reply ===\n"
CLOCKS = {"wall": "decode_s", "cpu": "decode_cpu_s"}
TARGETS = {"grounded_speedup": 1.5, "freeform_speedup": 0.97, "identical_share": 0.95, "vs_stock": 1.3}


def load_suites(names: list[str], limit: int | None) -> dict[str, list[tuple[str, str, str]]]:
    """(name, user message, reply prefix) per prompt file; the prefix follows a ``=== reply ===`` line."""
    suites = {}
    for name in names:
        files = sorted((PROMPTS / name).glob("*.txt"))
        if not files:
            sys.exit(f"error: no prompts in {PROMPTS / name}")
        suites[name] = []
        for f in files[:limit]:
            user, _, reply = f.read_text().partition(REPLY_MARK)
            suites[name].append((f.stem, user.rstrip("\n"), reply))
    return suites


def chat_prompt(engine, template, user: str, reply: str) -> list[int]:
    """The chat-templated user turn, then the start of the assistant's reply as plain text."""
    return template.tokens(engine, [{"role": "user", "content": user}]) + (engine.tokenize(reply) if reply else [])


# ---- the runs ------------------------------------------------------------------
def run_localinfer(runner: Runner, prompt: list[int], decoder, n: int) -> dict:
    runner.reset()  # every run prefills the whole prompt the same way (same numerics for its last token)
    tokens, wall, cpu = [], [], []
    for chunk in runner.stream(prompt, GREEDY, max_tokens=n, decoder=decoder, ignore_eos=True):
        if chunk.token is not None:
            wall.append(time.perf_counter())
            cpu.append(time.process_time())
            tokens.append(chunk.token)
    out = _clocked(tokens, wall, cpu)
    if isinstance(decoder, LookupDecoder):
        out["stats"] = decoder.stats.as_dict()
    return out


def _clocked(tokens: list[int], wall: list[float], cpu: list[float]) -> dict:
    """Decode time from the first emitted token to the last, by wall clock and by this process's CPU time."""
    return {"tokens": tokens, "steps": len(tokens) - 1, "decode_s": wall[-1] - wall[0], "decode_cpu_s": cpu[-1] - cpu[0]}


def interleaved(methods: dict, repeats: int) -> dict[str, dict]:
    """Run every method ``repeats`` times in the order A B C ... then ... C B A (and again), summing
    decode time and steps per method: on a machine whose speed drifts, each method then sits at the
    same mean time, so a linear drift cancels out of the ratios."""
    order = list(methods)
    runs: dict[str, list[dict]] = {m: [] for m in order}
    for rep in range(repeats):
        for m in order if rep % 2 == 0 else order[::-1]:
            runs[m].append(methods[m]())
    out = {}
    for m, recs in runs.items():
        merged = dict(recs[0])
        for key in ("steps", "decode_s", "decode_cpu_s"):
            merged[key] = sum(r[key] for r in recs)
        merged["tokens_by_repeat"] = [r["tokens"] for r in recs]
        merged["ms_per_token_by_repeat"] = [{c: 1000 * r[k] / r["steps"] for c, k in CLOCKS.items()} for r in recs]
        if "stats" in recs[0]:
            merged["stats_by_repeat"] = [r["stats"] for r in recs]
        out[m] = merged
    return out


class Stock:
    """llama-cpp-python's high-level Llama with its prompt-lookup draft model."""

    def __init__(self, model: str, plan: LoadPlan):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self._draft = LlamaPromptLookupDecoding
        self.llm = llama_cpp.Llama(model, n_ctx=plan.n_ctx, n_threads=plan.threads, n_threads_batch=plan.threads,
                                   n_batch=plan.n_batch, logits_all=True, verbose=False)
        eos = [self.llm.token_eos()]

        def ban_eos(_ids, scores):  # the same 256 tokens as localinfer's runs (ignore_eos)
            scores[eos] = -np.inf
            return scores

        self.ban_eos = llama_cpp.LogitsProcessorList([ban_eos])

    def run(self, prompt: list[int], n: int, num_pred: int) -> dict:
        self.llm.draft_model = self._draft(num_pred_tokens=num_pred)
        tokens, wall, cpu = [], [], []
        gen = self.llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True,
                                logits_processor=self.ban_eos)
        try:
            for tok in gen:
                wall.append(time.perf_counter())
                cpu.append(time.process_time())
                tokens.append(int(tok))
                if len(tokens) >= n:
                    break
        finally:
            gen.close()
        return _clocked(tokens, wall, cpu)


def divergence(engine, runner: Runner, prompt: list[int], plain: list[int], other: list[int]) -> dict | None:
    """First position where other differs from plain, and plain's logit margin there (rerun sequentially)."""
    j = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), None)
    if j is None:
        return None if len(plain) == len(other) else {"position": min(len(plain), len(other)), "margin": None}
    seen = {}

    class Recorder(Sampler):
        def sample(self, logits, history):
            if len(history) == len(prompt) + j:
                seen["logits"] = np.array(logits)
            return super().sample(logits, history)

    runner.reset()
    runner.generate(prompt, GREEDY, max_tokens=j + 1, decoder=PlainDecoder(), sampler=Recorder(GREEDY, banned=engine.eos_ids))
    lg = seen["logits"]
    top2 = np.sort(lg)[-2:]
    return {"position": j, "plain_token": plain[j], "other_token": other[j],
            "margin": float(lg[plain[j]] - lg[other[j]]), "top2_gap": float(top2[1] - top2[0]),
            "plain_text": engine.detokenize(plain[max(0, j - 8):j + 1]), "other_text": engine.detokenize(other[max(0, j - 8):j + 1])}


# ---- lookup cost at 32K --------------------------------------------------------
def lookup_cost(engine, history: list[int], rounds: int = 2000) -> dict:
    """Mean and p99 time of LookupDecoder.propose + observe per round over a 32K-token history."""
    dec = LookupDecoder()
    t0 = time.perf_counter()
    dec.start(history)
    build = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    context, pending = list(history[:-1]), history[-1]
    per_round = []
    src = len(history) // 3
    for _ in range(rounds):
        t0 = time.perf_counter()
        draft = dec.propose(context, pending, room=1 << 20, is_eos=engine.is_eos)
        # the target copies a passage of the history with an edit now and then
        n = len(draft.tokens) + 1
        emitted = [history[(src + i) % len(history)] if rng.random() > 0.05 else int(rng.integers(engine.n_vocab))
                   for i in range(n)]
        src += n
        dec.observe(draft, emitted)
        per_round.append(time.perf_counter() - t0)
        context += [pending, *emitted[:-1]]
        pending = emitted[-1]
    per_round.sort()
    return {"history_tokens": len(history), "index_build_s": build, "rounds": rounds,
            "mean_s": statistics.fmean(per_round), "p99_s": per_round[int(0.99 * len(per_round))]}


def decode_step(engine, tokens: list[int], n: int = 24) -> float:
    """Median time of one single-token eval (plain decode step) after a short context."""
    engine.trim(0)
    engine.eval(tokens[:511], logits_at=[])
    times = []
    for t in tokens[511:511 + n]:
        t0 = time.perf_counter()
        engine.eval([t])
        times.append(time.perf_counter() - t0)
    engine.trim(0)
    return statistics.median(times)


# ---- report ---------------------------------------------------------------------
def fmt_ms(s: float | None) -> str:
    return "      -" if s is None else f"{1000 * s:7.2f}"


def per_token(rec: dict | None, clock: str) -> float | None:
    return rec[CLOCKS[clock]] / rec["steps"] if rec and rec["steps"] > 0 else None


def summarise(rows: list[dict], method: str, clock: str) -> float | None:
    """Σ T / Σ N over the rows' runs of one method."""
    recs = [r[method] for r in rows if r.get(method)]
    steps = sum(r["steps"] for r in recs)
    return sum(r[CLOCKS[clock]] for r in recs) / steps if steps else None


def print_row(r: dict, clock: str) -> None:
    p, lk = per_token(r["plain"], clock), per_token(r["lookup"], clock)
    st = r["lookup"]["stats"]
    s10, s2 = per_token(r.get("stock10"), clock), per_token(r.get("stock2"), clock)
    best = min((s for s in (s10, s2) if s), default=None)
    print(f"{r['suite']:9} {r['prompt'][:22]:22} {r['prompt_tokens']:5d} {len(r['lookup']['tokens']):4d} "
          f"{fmt_ms(p)} {fmt_ms(lk)} {p / lk:6.2f}x {st['tokens_per_round']:7.2f} {st['acceptance']:6.2f} "
          f"{'yes' if r['identical'] else 'NO':>4} {fmt_ms(s10)} {fmt_ms(s2)} "
          f"{'-' if best is None else f'{best / lk:6.2f}x':>7}")
    d = r["divergence"]
    if d:
        print(f"{'':10}diverges at token {d['position']}: plain's logit margin {d.get('margin', float('nan')):.4f} "
              f"(top-2 gap {d.get('top2_gap', float('nan')):.4f}) plain={d.get('plain_text')!r} "
              f"lookup={d.get('other_text')!r}")


def summary(rows: list[dict], suites: dict, clock: str) -> dict:
    """Per-suite ΣT/ΣN figures and the issue's pass/fail checks; printed as it goes."""
    out: dict = {"clock": clock}
    checks = []
    print()
    for suite in suites:
        sub = [r for r in rows if r["suite"] == suite]
        p, lk = summarise(sub, "plain", clock), summarise(sub, "lookup", clock)
        s10, s2 = summarise(sub, "stock10", clock), summarise(sub, "stock2", clock)
        entry = {"plain_s_per_token": p, "lookup_s_per_token": lk, "speedup": p / lk,
                 "identical": sum(r["identical"] for r in sub), "prompts": len(sub)}
        line = f"{suite}: plain {1000 * p:.2f} ms/tok, lookup {1000 * lk:.2f} ms/tok -> {p / lk:.2f}x"
        if s10 and s2:
            best = min(s10, s2)
            entry.update(stock10_s_per_token=s10, stock2_s_per_token=s2, vs_best_stock=best / lk,
                         best_stock_vs_plain=p / best,
                         stock10_identical=sum(r["stock10"]["identical"] for r in sub),
                         stock2_identical=sum(r["stock2"]["identical"] for r in sub))
            line += (f"; stock10 {1000 * s10:.2f}, stock2 {1000 * s2:.2f} ms/tok (the better is {p / best:.2f}x plain)"
                     f" -> lookup {best / lk:.2f}x the better stock")
        print(line)
        out[suite] = entry
        target = TARGETS["grounded_speedup"] if suite == "grounded" else TARGETS["freeform_speedup"]
        checks.append((f"{suite} speedup {p / lk:.2f}x >= {target}x", p / lk >= target))
        if suite == "grounded" and "vs_best_stock" in entry:
            checks.append((f"grounded lookup {entry['vs_best_stock']:.2f}x the better stock >= {TARGETS['vs_stock']}x",
                           entry["vs_best_stock"] >= TARGETS["vs_stock"]))
    same = sum(r["identical"] for r in rows) / len(rows)
    out["identical_share"] = same
    checks.append((f"identical to plain greedy on {same:.0%} of prompts (>= {TARGETS['identical_share']:.0%})",
                   same >= TARGETS["identical_share"]))
    for text, ok in checks:
        print(f"[{'PASS' if ok else 'FAIL'}] {text}")
    out["checks"] = dict(checks)
    return out


def verify_ceiling(engine, history: list[int], depth: int, clock: str = "wall",
                   sizes=(1, 2, 3, 4, 6, 8, 11, 17), repeats: int = 9) -> dict:
    """T(m): median time of one eval of m tokens with logits at all m, at ``depth`` tokens of context.

    The best any drafting can do is every draft accepted, m tokens per T(m), so
    max_m m·T(1)/T(m) bounds the speedup on this engine and machine.  The sizes
    are measured round-robin, so a drift in the machine's speed touches all alike.
    """
    tick = time.process_time if clock == "cpu" else time.perf_counter
    ctx = history[:depth]
    engine.trim(0)
    engine.eval(ctx, logits_at=[len(ctx) - 1])
    times: dict[int, list[float]] = {m: [] for m in sizes}
    for _ in range(repeats):
        for m in sizes:
            t0 = tick()
            engine.eval(history[depth:depth + m], logits_at=range(m))
            times[m].append(tick() - t0)
            engine.trim(depth)
    engine.trim(0)
    t = {m: statistics.median(v) for m, v in times.items()}
    ceiling = {m: m * t[1] / t[m] for m in sizes}
    return {"depth": depth, "clock": clock, "seconds": t, "ceiling_by_m": ceiling, "ceiling": max(ceiling.values())}


def clairvoyant_bound(rows: list[dict], prompts: dict[tuple[str, str], list[int]], curve: list[float]) -> dict:
    """Per suite, the speedup of a drafter that knows how long each copy in plain's output holds.

    It verifies each round at the measured cost curve and drafts exactly what
    will be accepted, so no prompt-lookup policy can do better on this engine
    and machine: a target above it is out of reach of any drafter.
    """
    out: dict = {}
    for r in rows:
        tokens = r["plain"]["tokens"]
        history = prompts[r["suite"], r["prompt"]] + tokens[:1]  # decode time starts at the first token
        r["clairvoyant"] = {"speedup": clairvoyant_speedup(history, tokens[1:], curve)}
        s = out.setdefault(r["suite"], {"tokens": 0, "time": 0.0})
        s["tokens"] += len(tokens) - 1
        s["time"] += (len(tokens) - 1) / r["clairvoyant"]["speedup"]
    return {suite: s["tokens"] / s["time"] for suite, s in out.items()}


def compact_json(doc: dict) -> str:
    """Indented JSON with every list of numbers (the token lists) on one line."""
    return re.sub(r"\[[-0-9.,eE\s]+\]", lambda m: "".join(m.group(0).split()).replace(",", ", "),
                  json.dumps(doc, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2-135M)")
    ap.add_argument("--backend", default="llama.cpp")
    ap.add_argument("--suite", default="grounded,freeform", help="comma-separated suites")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each suite")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    ap.add_argument("--kv", default="f16", help="KV cache type for K and V (f16, q8_0, q4_0)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="time the table and checks use; cpu (this process's CPU time) resists other load "
                         "on a shared machine when --threads 1; the JSON has both")
    ap.add_argument("--no-stock", action="store_true", help="skip llama-cpp-python's LlamaPromptLookupDecoding")
    ap.add_argument("--ngram", type=int, default=None, help="LookupDecoder ngram_max")
    ap.add_argument("--ngram-min", type=int, default=None, help="LookupDecoder ngram_min")
    ap.add_argument("--draft-max", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each method per prompt, in A B C .. C B A order, times summed (cancels drift)")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    args = ap.parse_args(argv)

    model = str(resolve_model(args.model))
    plan = LoadPlan(model, n_ctx=args.ctx, n_threads=args.threads, type_k=args.kv, type_v=args.kv)
    engine = load_engine(plan, args.backend)
    runner = Runner(engine)
    template = template_for(ModelSpec.from_gguf(model))
    stock = None if args.no_stock or args.backend != "llama.cpp" else Stock(model, plan)
    lookup_kw = {k: v for k, v in (("ngram_max", args.ngram), ("ngram_min", args.ngram_min),
                                   ("draft_max", args.draft_max)) if v is not None}
    suites = load_suites(args.suite.split(","), args.limit)
    load0 = os.getloadavg()

    warm = chat_prompt(engine, template, "Say hello.", "")
    run_localinfer(runner, warm, PlainDecoder(), 8)
    if stock:
        stock.run(warm, 8, 2)

    print(f"# {engine.name} {os.path.basename(model)} kv={args.kv} threads={plan.threads} "
          f"lookup={lookup_kw or 'defaults'}; ms per decoded token ({args.clock} clock), load {load0[0]:.1f}")
    print(f"{'suite':9} {'prompt':22} {'ptok':>5} {'gen':>4} {'plain':>7} {'lookup':>7} {'speedup':>7} "
          f"{'tok/rnd':>7} {'accept':>6} {'same':>4} {'stock10':>7} {'stock2':>7} {'vs best':>7}")
    rows: list[dict] = []
    history: list[int] = []
    prompt_tokens: dict[tuple[str, str], list[int]] = {}
    for suite, prompts in suites.items():
        for name, user, reply in prompts:
            prompt = chat_prompt(engine, template, user, reply)
            prompt_tokens[suite, name] = prompt
            history += prompt
            row = {"suite": suite, "prompt": name, "prompt_tokens": len(prompt)}
            methods = {
                "plain": lambda p=prompt: run_localinfer(runner, p, PlainDecoder(), args.max_tokens),
                "lookup": lambda p=prompt: run_localinfer(runner, p, LookupDecoder(**lookup_kw), args.max_tokens)}
            if stock:
                methods["stock10"] = lambda p=prompt: stock.run(p, args.max_tokens, 10)
                methods["stock2"] = lambda p=prompt: stock.run(p, args.max_tokens, 2)
            row.update(interleaved(methods, args.repeats))
            plain = row["plain"]["tokens"]
            row["identical"] = all(t == plain for t in row["lookup"]["tokens_by_repeat"])
            row["divergence"] = divergence(engine, runner, prompt, plain, row["lookup"]["tokens"])
            for m in ("stock10", "stock2"):
                if m in row:
                    row[m]["identical"] = all(t == plain for t in row[m]["tokens_by_repeat"])
            rows.append(row)
            print_row(row, args.clock)
    result = {"summary": summary(rows, suites, args.clock)}

    history = (history * (32768 // len(history) + 1))[:32768]
    cost = lookup_cost(engine, history)
    step = summarise(rows, "plain", "wall") or decode_step(engine, history)
    cost.update(decode_step_s=step, share_of_step=cost["mean_s"] / step)
    print(f"\nlookup at {cost['history_tokens']} tokens of history: index built once in "
          f"{1000 * cost['index_build_s']:.1f} ms; per round mean {1e6 * cost['mean_s']:.1f} us, "
          f"p99 {1e6 * cost['p99_s']:.1f} us = {100 * cost['share_of_step']:.2f}% of a {1000 * step:.2f} ms "
          f"decode step (target < 1%)")
    depth = min(int(statistics.median(r["prompt_tokens"] for r in rows)), args.ctx - 32)
    draft_max = lookup_kw.get("draft_max", LookupDecoder().draft_max)
    sizes = sorted({1, 2, 3, 4, 6, 8, 11, 17, draft_max + 1})
    ceiling = verify_ceiling(engine, history, depth, args.clock, sizes=sizes, repeats=15)
    print(f"verify cost ({args.clock} clock) at {depth} tokens of context: " + ", ".join(
        f"T({m}) {1000 * t:.1f} ms" for m, t in ceiling["seconds"].items()))
    print(f"ceiling with every draft accepted: {ceiling['ceiling']:.2f}x plain "
          f"(max over m of m*T(1)/T(m); a speedup target above it cannot be met on this engine and machine)")
    result["verify_ceiling"] = ceiling
    measured = sorted(ceiling["seconds"])
    curve = list(np.interp(range(1, draft_max + 2), measured, [ceiling["seconds"][m] for m in measured]))
    bound = clairvoyant_bound(rows, prompt_tokens, curve)
    result["clairvoyant"] = {"curve_s": curve, "speedup": bound}
    for suite, b in bound.items():
        reached = result["summary"][suite]["speedup"]
        if reached > b:
            share = "above it: the bound and the runs are timed apart, so the gap is timing noise"
        else:
            share = f"{100 * (reached - 1) / (b - 1):.0f}% of its gain" if b > 1 and reached > 1 else "no gain"
        print(f"{suite}: a clairvoyant drafter (drafts exactly what plain's output copies, at most {draft_max} a "
              f"round, at this verify cost) reaches {b:.2f}x; lookup reached {reached:.2f}x, {share}")
    if args.json:
        for r in rows:
            for m in ("plain", "lookup", "stock10", "stock2"):
                if m in r:
                    r[m]["ms_per_token"] = {c: None if per_token(r[m], c) is None else 1000 * per_token(r[m], c)
                                            for c in CLOCKS}
        result.update(env={"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
                           "threads": plan.threads, "load_before": load0, "load_after": os.getloadavg(),
                           "backend": engine.name, "model": model, "kv": args.kv, "max_tokens": args.max_tokens,
                           "lookup": lookup_kw},
                      rows=rows, lookup_cost=cost)
        Path(args.json).write_text(compact_json(result))
        print(f"wrote {args.json}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
