"""How wide a KV view llama.cpp attends over while serving: ``n_kv`` under a closed loop, per server.

    python benchmarks/serve_nkv.py [--llama-server PATH] [--concurrency 4] [--rounds 2] [--out FILE]

llama.cpp attends over the cells up to the highest one in use (``n_kv``: ``used_max_p1`` padded to 256),
and flash attention still visits every masked cell in it, so cells nobody decodes (a parked sequence, a
slot's old prompt) slow every step.  Each server runs with ``LLAMA_KV_CACHE_DEBUG=1``, which makes
llama.cpp log ``find_slot: ... n = <used_max_p1>`` for every ubatch (localinfer echoes llama.cpp's log with
``LOCALINFER_LLAMA_LOG=1``; llama-server with ``-v``); the script counts the ubatches at each ``n_kv``
during one closed-loop level (``benchmarks/serve_load.py``: the closed scenario of serve_peers.py, fresh
~300-token prompts, 128 tokens out) and prints them beside the level's tok/s and ITL.  The servers take
turns, ``--rounds`` times, so a shared machine's drift falls on all of them.  The debug log itself costs
time (one Python callback per line for localinfer), so compare these tok/s only with each other.

Servers: ``localinfer serve`` (parked KV in host memory), ``localinfer serve --parked 0``, and llama-server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serve_peers import SCENARIOS, commands, free_port, load, machine, stop, wait_ready   # noqa: E402
from localinfer.model.sources import resolve_model                                      # noqa: E402

N_RE = re.compile(r"find_slot: stream\[\d+\], n = +(\d+)")
PAD = 256


def n_kv_counts(text: str) -> Counter:
    """ubatches at each n_kv (llama.cpp's used_max_p1 padded to 256) in a stretch of debug log."""
    return Counter(max(PAD, -(-int(n) // PAD) * PAD) for n in N_RE.findall(text))


def measure(name: str, cmd: list[str], env: dict, url: str, level: list[str], seed: int, tmp: Path) -> dict:
    log = tmp / f"{name}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(url, proc, log)
        start = log.stat().st_size
        run = load(argparse.Namespace(smoke=False), name, url, SCENARIOS["closed"], level, tmp, seed)["runs"][0]
        with log.open("rb") as f:
            f.seek(start)
            counts = n_kv_counts(f.read().decode("utf-8", "replace"))
    finally:
        stop(proc)
    steps = sorted(counts.elements())
    return {"server": name, "tok_s": run["output_tok_s"], "itl_p50_ms": run["itl_p50_ms"],
            "ttft_p50_ms": run["ttft_p50_ms"], "ubatches": len(steps),
            "n_kv_median": statistics.median(steps) if steps else None, "n_kv": dict(sorted(counts.items()))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", help="path of a llama-server binary")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    r = resolve_model(None)
    model = str(getattr(r, "path", r))
    ctx = SCENARIOS["closed"]["ctx"]
    env = {**os.environ, "LLAMA_KV_CACHE_DEBUG": "1", "LOCALINFER_LLAMA_LOG": "1"}
    level = ["--concurrency", str(args.concurrency)]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for rnd in range(args.rounds):
            ports = {n: free_port() for n in ("localinfer", "llama-server", "llama-cpp-python")}
            peer = argparse.Namespace(threads=args.threads, llama_server=args.llama_server, llama_cpp_python=None)
            cmds = commands(peer, model, ctx, ports)
            runs = {"localinfer": cmds["localinfer"], "localinfer --parked 0": cmds["localinfer"] + ["--parked", "0"]}
            if args.llama_server:
                runs["llama-server"] = cmds["llama-server"] + ["-v"]
            for name, cmd in runs.items():
                port = ports["llama-server" if name == "llama-server" else "localinfer"]
                row = measure(name.replace(" ", "_"), cmd, env, f"http://127.0.0.1:{port}/v1", level, 11 + rnd,
                              Path(d))
                row.update(server=name, round=rnd + 1)
                rows.append(row)
                top = sorted(row["n_kv"].items(), key=lambda kv: -kv[1])[:3]
                print(f"round {rnd + 1}  {name:<24}{row['tok_s']:>7.1f} tok/s  ITL p50 {row['itl_p50_ms']:>5.1f} ms"
                      f"  n_kv median {row['n_kv_median']}  most: "
                      + ", ".join(f"{k} ({v / row['ubatches']:.0%})" for k, v in top), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "concurrency": args.concurrency,
                                              "threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
