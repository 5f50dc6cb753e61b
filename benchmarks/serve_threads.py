"""Where each server's CPU goes, thread by thread, per generated token (issue 45, item 1: thread behaviour).

Starts ``localinfer serve`` and llama-server (the same commands as serve_peers.py), drives each in turn with a
closed loop (serve_load.py), and reads every thread's user+system CPU time from ``/proc/PID/task/*/stat``
before and after: the CPU milliseconds each thread (named by its comm) spent per token generated, the wall time
per token (from the load's start to its end, the load generator's own start-up included), and the sum of the threads
alive at the end (one that exits during the load is not counted).  Python's threads are all named ``python3``:
which is the engine thread, llama.cpp's OpenMP worker, the asyncio loop (the process's first thread, ``main``) or the
relay is read from their shares, not from a name.  On a machine with as many cores as llama.cpp threads, every
millisecond another thread runs is taken from a core a graph's thread computes on.

    python3 benchmarks/serve_threads.py --llama-server PATH [--concurrency 1] [--requests 8] [--rounds 2]

Linux only (procfs).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import serve_peers  # noqa: E402  (its commands, readiness and stop)

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """Seconds of user+system CPU per thread, keyed ``name:tid`` (``main`` for the process's first thread)."""
    out: dict[str, float] = collections.defaultdict(float)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue                                      # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out["main" if int(tid) == pid else f"{name}:{tid}"] += (int(fields[11]) + int(fields[12])) / TICK
    return dict(out)


def measure(name: str, url: str, pid: int, args, tmp: Path, seed: int) -> dict:
    before, t0 = thread_cpu(pid), time.monotonic()
    out = tmp / f"{name}.json"
    flags = ["--requests", str(args.requests), "--prompt-tokens", "300", "--output-tokens", str(args.output_tokens),
             "--concurrency", str(args.concurrency), "--seed", str(seed)]
    serve_peers.subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--url", url,
                                "--label", name, *flags, "--out", str(out)], check=True, timeout=1800)
    wall, after = time.monotonic() - t0, thread_cpu(pid)
    run = json.loads(out.read_text())["runs"][0]
    tokens = args.requests * args.output_tokens
    per = {k: round(1e3 * (after.get(k, 0.0) - before.get(k, 0.0)) / tokens, 3) for k in after}
    per = {k: v for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.01}
    return {"server": name, "tok_s": run.get("output_tok_s"), "wall_ms_per_token": round(1e3 * wall / tokens, 3),
            "cpu_ms_per_token": round(sum(per.values()), 3), "threads_ms_per_token": per,
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--serve-arg", action="append", default=[])
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.llama_cpp_python = None
    model = str(serve_peers.resolve_model(None))
    ports = {n: serve_peers.free_port() for n in ("localinfer", "llama-server", "llama-cpp-python")}
    cmds = serve_peers.commands(args, model, 4096, ports)
    url_of = lambda n: f"http://127.0.0.1:{ports[n]}/v1"
    rows, procs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            for n, cmd in cmds.items():
                log = tmp / f"{n}.log"
                procs[n] = (serve_peers.subprocess.Popen(cmd, stdout=log.open("w"),
                                                         stderr=serve_peers.subprocess.STDOUT), log)
            for n, (proc, log) in procs.items():
                serve_peers.wait_ready(url_of(n), proc, log)
            names = list(cmds)
            for rnd in range(args.rounds):
                for n in names[rnd % 2:] + names[:rnd % 2]:
                    row = measure(n, url_of(n), procs[n][0].pid, args, tmp, seed=7 + rnd)
                    row["round"] = rnd + 1
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            serve_peers.stop(*(proc for proc, _ in procs.values()))
    doc = {"machine": serve_peers.machine(), "commands": cmds, "concurrency": args.concurrency,
           "requests": args.requests, "output_tokens": args.output_tokens, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
