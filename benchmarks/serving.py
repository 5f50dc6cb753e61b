"""Serving on this machine: 8 concurrent greedy requests through the step engine against the same 8
one after another through Runner, and when the two give the same text.

Throughput, at 1 and 2 threads, flash attention on, per-slot KV streams (generate_batch's layout):

* sequential - ``Runner.generate`` per prompt on a one-sequence llama.cpp engine; decode tok/s is
  Σ decode tokens / Σ decode seconds (the time after each first token);
* engine     - ``serve.batch.run_batch``: the scheduler and block manager over ``LlamaCppExecutor``
  with 8 slots; all 8 prompts prefill in the first step, then every step decodes 8 tokens in one
  ``llama_decode``; decode tok/s is 8·(N − 1) / (last token time − first token time).

The CPU clock (process time) counts only the time this process ran, so at 1 thread it is robust to
other processes on the machine; at 2 threads it also counts threads spinning at ggml's barriers.
Both run with EOS banned (sequential) or ignored (engine), so each request yields exactly N tokens;
the two are timed A B B A A B and the medians compared, and the best runs (other processes share this
machine's cores, and a 2-thread run stalls whenever one of its threads is descheduled; every run is printed).  Step overhead is the share of the
engine's wall time spent outside ``llama_decode`` (batch building, sampling 8 rows, bookkeeping).

Identity: for threads 1/2 × flash attention on/off × KV layout (per-slot streams / unified),
how many of 8 greedy replies (32 tokens, natural stop, 4 slots so slots are refilled) equal the
reply Runner gives alone with the same settings.

Shared prefix: 6 requests whose prompts start with the same 1,008-token system prompt (+ a private
question), 3 slots on a unified cache, 1 thread; the first request arrives alone, the other 5 once
its prompt is in KV.  TTFT p50 of the 5 with the prefix cache (a hit is ``llama_memory_seq_cp`` from
a running request) against without, and llama.cpp's cells at the peak against the formula
shared prefix + Σ private tokens (checked after every step).

Preemption: with a KV pool too small for the running requests (on-demand admission), how many
preemptions and recomputed tokens, and whether the replies stay those of a run that reserves KV.

    python benchmarks/serving.py [--tokens 64] [--out benchmarks/results/serving_cpu.txt]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from localinfer.backends.engine import LoadPlan
from localinfer.backends.llamacpp.engine import LlamaCppEngine
from localinfer.generation.runner import Runner
from localinfer.generation.sampling import SamplingParams
from localinfer.model.sources import default_model_path
from localinfer.model.spec import ModelSpec
from localinfer.model.templates import template_for
from localinfer.serve.batch import run_batch
from localinfer.backends.llamacpp.executor import LlamaCppExecutor

GREEDY = SamplingParams(temperature=0)
QUESTIONS = ["What is 2+2?", "Say hi.", "Name a fruit.", "What colour is the sky?", "Give me a number.",
             "Who wrote Hamlet?", "Name a planet.", "Why do cats purr?"]
SLOT_CELLS = 256


def machine() -> str:
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.machine()}, {cpus} vCPUs, {model or 'unknown CPU'} ({simd}), no GPU used"


def prompts_for(engine, model) -> list[list[int]]:
    tpl = template_for(ModelSpec.from_gguf(model))
    return [tpl.tokens(engine, [{"role": "user", "content": q}]) for q in QUESTIONS]


def sequential(engine, prompts, n: int, **kw) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    decode_tokens = decode_s = 0.0
    replies = []
    for p in prompts:
        r = Runner(engine)
        r.reset()
        g = r.generate(p, GREEDY, max_tokens=n, **kw)
        decode_tokens += len(g.timings.itl)
        decode_s += g.timings.decode_seconds
        replies.append(g.tokens)
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "decode_tok_s": decode_tokens / decode_s, "replies": replies}


def batched(ex, prompts, n: int, parallel: int, **kw) -> dict:
    d0, t0, c0 = ex.decode_seconds, time.perf_counter(), time.process_time()
    res = run_batch(ex, ex.engine, prompts, GREEDY, max_tokens=n, parallel=parallel, **kw)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    first = max(r.token_times[0] for r in res if r.token_times)
    last = max(r.token_times[-1] for r in res if r.token_times)
    decode_tokens = sum(max(len(r.token_times) - 1, 0) for r in res)
    return {"wall_s": wall, "cpu_s": cpu, "decode_tok_s": decode_tokens / (last - first) if last > first else 0.0,
            "overhead": 1 - (ex.decode_seconds - d0) / wall, "replies": [r.tokens for r in res]}


def throughput(model: str, threads: int, n: int, out: list[str]) -> None:
    with LlamaCppEngine(LoadPlan(model, n_ctx=SLOT_CELLS, n_threads=threads, flash_attn=True)) as eng, \
            LlamaCppExecutor.open(model, n_slots=8, n_ctx=8 * SLOT_CELLS, threads=threads, unified=False) as ex:
        prompts = prompts_for(eng, model)
        seq, bat = [], []
        for order in ("AB", "BA", "AB"):
            for who in order:
                if who == "A":
                    seq.append(sequential(eng, prompts, n, ignore_eos=True))
                else:
                    bat.append(batched(ex, prompts, n, 8, ignore_eos=True))
    s, b = _median(seq, "decode_tok_s"), _median(bat, "decode_tok_s")
    sw, bw = _median(seq, "wall_s"), _median(bat, "wall_s")
    sc, bc = _median(seq, "cpu_s"), _median(bat, "cpu_s")
    ov = _median(bat, "overhead")
    bb, sb = max(r["decode_tok_s"] for r in bat), max(r["decode_tok_s"] for r in seq)
    runs_b = ", ".join(format(r["decode_tok_s"], ".1f") for r in bat)
    runs_s = ", ".join(format(r["decode_tok_s"], ".1f") for r in seq)
    out.append(f"threads={threads}: decode {b:7.1f} tok/s engine (8 concurrent) vs {s:6.1f} tok/s sequential "
               f"-> {b / s:.2f}x | end to end {8 * n / bw:6.1f} vs {8 * n / sw:6.1f} output tok/s -> "
               f"{sw / bw:.2f}x | CPU clock {8 * n / bc:6.1f} vs {8 * n / sc:6.1f} output tokens per CPU-second -> "
               f"{sc / bc:.2f}x | best run each {bb:.1f} vs {sb:.1f} -> {bb / sb:.2f}x | step overhead {ov:.1%} of "
               f"the engine's wall time | decode runs: engine {runs_b}; sequential {runs_s}")
    print(out[-1], flush=True)


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def identity(model: str, out: list[str]) -> None:
    for threads in (1, 2):
        for fa in (True, False):
            with LlamaCppEngine(LoadPlan(model, n_ctx=SLOT_CELLS, n_threads=threads, flash_attn=fa)) as eng:
                prompts = prompts_for(eng, model)
                alone = sequential(eng, prompts, 32)["replies"]
            for unified in (False, True):
                with LlamaCppExecutor.open(model, n_slots=4, n_ctx=4 * SLOT_CELLS, threads=threads, flash_attn=fa,
                                           unified=unified) as ex:
                    got = batched(ex, prompts, 32, 4)["replies"]
                same = sum(a == g for a, g in zip(alone, got))
                layout = "unified KV     " if unified else "per-slot stream"
                out.append(f"threads={threads} flash_attn={'on ' if fa else 'off'} {layout}: "
                           f"{same}/{len(alone)} replies identical to Runner alone")
                print(out[-1], flush=True)


def shared_prefix(model: str, out: list[str], prefix_len: int = 1008, n: int = 6, slots: int = 3) -> None:
    from localinfer.serve.assembly import build_step_engine
    from localinfer.serve.request import Request
    from localinfer.serve.scheduler import SchedulerConfig

    ttft = {}
    with LlamaCppExecutor.open(model, n_slots=slots, n_ctx=4096, threads=1) as ex:
        text = "You are a careful assistant. Answer in one short sentence. " * 200
        system = ex.engine.tokenize(text, add_bos=True)[:prefix_len]
        prompts = [tuple(system + ex.engine.tokenize(f" Question {i}: {q}")) for i, q in enumerate(QUESTIONS)]
        for cache in (True, False):
            eng = build_step_engine(ex, SchedulerConfig(max_running=slots), block_tokens=16, prefix_cache=cache)
            first = eng.add_request(Request("r0", prompts[0], 4, arrival_s=ex.clock()))
            while not first.output:
                eng.step()
            now, peak, exact = ex.clock(), (0, 0), True
            rest = [eng.add_request(Request(f"r{i}", prompts[i], 4, arrival_s=now)) for i in range(1, n)]
            while eng.unfinished:
                eng.step()
                running = eng.scheduler.running
                cells = ex.cells_used()
                shared = prefix_len if cache and running else 0
                formula = shared + sum(r.computed - shared for r in running)
                exact &= cells == formula == eng.blocks.tokens_in_use()
                peak = max(peak, (cells, formula))
            ttft[cache] = statistics.median(r.ttft_s for r in rest)
            if cache:
                hits = sum(1 for r in rest if r.cached)
                out.append(f"prefix cache on : TTFT p50 {ttft[cache] * 1e3:7.1f} ms over {len(rest)} requests "
                           f"({hits} hits); peak cells {peak[0]} = formula {peak[1]} "
                           f"(shared {prefix_len} + private); every step equal: {exact}")
            else:
                out.append(f"prefix cache off: TTFT p50 {ttft[cache] * 1e3:7.1f} ms; peak cells {peak[0]} "
                           f"= Σ tokens {peak[1]}; every step equal: {exact}")
            print(out[-1], flush=True)
    out.append(f"TTFT p50 without / with the prefix cache: {ttft[False] / ttft[True]:.1f}x")
    print(out[-1], flush=True)


def preemption(model: str, out: list[str]) -> None:
    """8 requests, 4 slots, on-demand admission in a pool of 12 blocks of 16 (192 cells for ~4 x 70)."""
    with LlamaCppExecutor.open(model, n_slots=4, n_ctx=4 * SLOT_CELLS, threads=1, unified=False) as ex:
        prompts = prompts_for(ex.engine, model)
        want = run_batch(ex, ex.engine, prompts, GREEDY, max_tokens=32, parallel=4)
        got = run_batch(ex, ex.engine, prompts, GREEDY, max_tokens=32, parallel=4, admission="on_demand",
                        kv_blocks=12)
    same = sum(a.tokens == b.tokens for a, b in zip(want, got))
    out.append(f"KV pool of 192 cells, on-demand admission: {sum(r.preemptions for r in got)} preemptions, "
               f"{sum(r.recomputed_tokens for r in got)} tokens recomputed; {same}/{len(got)} replies identical "
               f"to the run that reserves every request's KV up front")
    print(out[-1], flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request in the throughput runs")
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2-135M)")
    ap.add_argument("--out", type=Path, default=None, help="also write the printout here")
    args = ap.parse_args(argv)
    model = args.model or str(default_model_path())
    import llama_cpp

    t0 = time.perf_counter()
    out = [f"# benchmarks/serving.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
           f"# machine: {machine()}; load average at start {os.getloadavg()[0]:.2f}",
           (f"# model: {os.path.basename(model)}; llama-cpp-python {llama_cpp.__version__}; flash attention on; "
            f"8 chat prompts {QUESTIONS[0]!r}, {QUESTIONS[1]!r}.. ({args.tokens} tokens each)")]
    print("\n".join(out), flush=True)
    out.append("## throughput: 8 concurrent requests through the step engine vs the same 8 through Runner")
    for threads in (1, 2):
        throughput(model, threads, args.tokens, out)
    out.append("## identity: greedy replies (32 tokens, 4 slots refilled) against Runner alone, same settings")
    identity(model, out)
    out.append("## preemption: 8 requests, 4 slots, per-slot streams, 1 thread")
    preemption(model, out)
    out.append("## shared 1,008-token prefix, 6 requests, 3 slots, unified KV, 1 thread")
    shared_prefix(model, out)
    out.append(f"# {time.perf_counter() - t0:.0f} s; load average at the end {os.getloadavg()[0]:.2f} "
               f"(other processes share these cores)")
    print(out[-1])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
