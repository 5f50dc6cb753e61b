"""Where the engine thread's time outside ``llama_decode`` goes, per step, in a served closed loop.

    python3 benchmarks/serve_host_work.py [--concurrency 1] [--requests 8] [--json OUT]

Runs ``localinfer serve`` (the embedded model, --parallel 8 --ctx 4096 -t 2 -fa on --max-queue 1024, as
serve_peers.py does) in this process with a wall-clock timer and a thread-CPU timer around each of the engine's
per-step calls, drives it with serve_load.py (300-token prompts, 128 tokens out; its uncounted warm-up request is in
the steps), stops it, and prints each call's time per engine step (from the first serving step on: the calibration
at load is left out).  ``StepEngine.step`` minus ``LlamaCppEngine.decode_batch`` is the step's host work inside the
engine; the Runtime rows are the engine thread's work between steps.  The CPU column is the engine thread's own
(inside ``decode_batch`` ggml's other threads are not in it); where it is below the wall time the thread waited or
was preempted.  The timers cost a few us a call (the thread clock is a system call).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from localinfer.backends.llamacpp import engine as llama_engine, executor as llama_executor  # noqa: E402
from localinfer.cli import main as cli_main  # noqa: E402
from localinfer.generation import sampling  # noqa: E402
from localinfer.serve import engine as serve_engine, parking, scheduler  # noqa: E402
from localinfer.serve.http import runtime, sampler as serve_sampler  # noqa: E402

TIMED = [(runtime.Runtime, "_events"), (runtime.Runtime, "_dispatch"), (runtime.Runtime, "_side_work"),
         (runtime.Runtime, "_publish"), (serve_engine.StepEngine, "step"), (serve_engine.StepEngine, "_chunk"),
         (scheduler.Scheduler, "schedule"), (scheduler.Scheduler, "complete"),
         (llama_executor.LlamaCppExecutor, "step"), (llama_executor.LlamaCppExecutor, "_decode"),
         (llama_engine.LlamaCppEngine, "fill_batch"), (llama_engine.LlamaCppEngine, "decode_batch"),
         (llama_engine.LlamaCppEngine, "logit_rows"), (sampling.Sampler, "sample"),
         (serve_sampler.ServeSampler, "sample"), (serve_engine.StepEngine, "_release"),
         (parking.Parking, "release"), (serve_engine.StepEngine, "_record")]


def timed(table: dict, cls, name: str) -> None:
    f, label, clock, cpu = getattr(cls, name), f"{cls.__name__}.{name}", time.perf_counter_ns, time.thread_time_ns
    first = label == "StepEngine.step"

    def wrapper(*args, **kwargs):
        if first and not table[label][1]:
            table.clear()             # the first serving step: the load's calibration steps are not counted
        t, c = clock(), cpu()
        try:
            return f(*args, **kwargs)
        finally:
            row = table[label]
            row[0] += clock() - t
            row[1] += 1
            row[2] += cpu() - c
    setattr(cls, name, wrapper)


def drive(port: int, args, out: dict) -> None:
    """Wait for the server, run the load, then stop the server (SIGINT: its graceful stop)."""
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.2)
    try:
        load = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--url", base + "/v1",
                               "--concurrency", str(args.concurrency), "--requests", str(args.requests),
                               "--seed", str(args.seed)], capture_output=True, text=True)
        out["load"] = json.loads(load.stdout)["runs"][0] if load.returncode == 0 else {"error": load.stderr[-2000:]}
    except Exception as exc:  # noqa: BLE001 - reported below; the server is stopped either way
        out["load"] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.kill(os.getpid(), signal.SIGINT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--seed", type=int, default=int(time.time()) % 10_000)
    p.add_argument("--port", type=int, default=18391)
    p.add_argument("--json", default=None, help="write the table here as JSON")
    args = p.parse_args()
    table: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for cls, name in TIMED:
        timed(table, cls, name)
    out: dict = {}
    threading.Thread(target=drive, args=(args.port, args, out), daemon=True).start()
    rc = cli_main(["serve", "--port", str(args.port), "--parallel", "8", "--ctx", "4096", "-t", "2", "-fa", "on",
                   "--max-queue", "1024"])
    load = out.get("load", {})
    if rc or "error" in load or not table["StepEngine.step"][1]:
        print(f"serve_host_work: no figures (serve exit {rc}; load: {load.get('error', 'no steps')})", file=sys.stderr)
        return 1
    steps = table["StepEngine.step"][1] or 1
    rows = {k: {"calls": n, "us_per_step": ns / 1e3 / steps, "cpu_us_per_step": c / 1e3 / steps}
            for k, (ns, n, c) in table.items()}
    host = (table["StepEngine.step"][0] - table["LlamaCppEngine.decode_batch"][0]) / 1e3 / steps
    print(f"concurrency {args.concurrency}: {steps} steps, tok/s {load.get('output_tok_s')}, "
          f"ITL p50 {load.get('itl_p50_ms')} ms; StepEngine.step outside llama_decode {host:.0f} us a step")
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1]["us_per_step"]):
        print(f"  {k:34s} {v['calls']:7d} calls  {v['us_per_step']:9.1f} us a step  "
              f"(thread CPU {v['cpu_us_per_step']:7.1f})")
    if args.json:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        Path(args.json).write_text(json.dumps({
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": head.stdout.strip() or None,
            "seed": args.seed, "concurrency": args.concurrency, "requests": args.requests, "steps": steps,
            "load": load, "host_us_per_step": host, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
