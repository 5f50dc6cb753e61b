"""A decode step (one sequence, or ``--rows N`` together) three ways, in one run: llama-server's own per-token
time, localinfer's executor step, and the bare ``llama_decode`` under it (issue 45: where a closed loop's
milliseconds go).

    python benchmarks/decode_step_peers.py [--rounds 2] [--rows N] [--llama-server PATH]

``--rows N``: N sequences decode together (N different 300-token prompts, sent to llama-server at once, so its
slots prefill together and then decode in lockstep, each request's per-token time a step of N rows; the executor
steps N one-token chunks, and the bare decode is one more N-row batch).

A 300-token prompt, then 128 greedy tokens (64 executor steps), 4 times per round, the first left out.  llama-server (the same flags as serve_peers.py:
-np 8 --kv-unified -t 2 -fa on, 4096 cells) answers /completion with ``cache_prompt: false``; its
``timings.predicted_per_token_ms`` is its generation time over the tokens (decode, sampling, its loop; no HTTP).
localinfer's LlamaCppExecutor (the server's executor: 40 ids, 4096 cells, 2 threads, flash attention) steps one
chunk a token; beside each step a bare ``llama_decode`` of one more token at the next position, timed alone (the
executor's Python around it: batch filling, logits copy, checks).  Medians per repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llama_cpp as _L
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.backends.executor import Chunk                        # noqa: E402
from localinfer.backends.llamacpp.executor import LlamaCppExecutor    # noqa: E402
from localinfer.model.sources import default_model_path               # noqa: E402

SERVER = Path.home() / ".cache/localinfer/llama-server-0.3.36/build/bin/llama-server"


def server(binary: str, model: str, prompts: list[list[int]], port: int = 18998) -> list[float]:
    cmd = [binary, "-m", model, "--port", str(port), "-c", "4096", "-np", "8", "--kv-unified", "-t", "2", "-tb", "2",
           "-fa", "on", "--no-webui"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        def one(prompt, rep):
            body = json.dumps({"prompt": prompt, "n_predict": 128, "temperature": 0, "ignore_eos": True,
                               "cache_prompt": False, "seed": rep}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                         {"Content-Type": "application/json"})
            return json.load(urllib.request.urlopen(req, timeout=300))["timings"]["predicted_per_token_ms"]

        got = []
        with ThreadPoolExecutor(len(prompts)) as pool:
            for rep in range(4):        # the first (graph reservation, caches cold) is left out
                got.append(statistics.median(pool.map(one, prompts, [rep] * len(prompts))))
        return got[1:]
    finally:
        p.terminate()
        p.wait()


def ours(model: str, prompts: list[list[int]]) -> tuple[list[float], list[float]]:
    steps, raws = [], []
    slots = range(len(prompts))
    with LlamaCppExecutor.open(model, n_slots=40, n_ctx=4096, threads=2, flash_attn=True, quiet=True) as ex:
        eng = ex.engine
        for rep in range(4):
            ex.step([Chunk(s, tuple(p), 0, True) for s, p in zip(slots, prompts)])
            step, raw, pos = [], [], len(prompts[0])
            for _ in range(64):
                t = time.perf_counter()
                ex.step([Chunk(s, (7,), pos, True) for s in slots])
                step.append(time.perf_counter() - t)
                eng.fill_batch((7,) * len(slots), (pos + 1,) * len(slots), tuple(slots), (True,) * len(slots))
                eng._batch.n_tokens = len(slots)
                t = time.perf_counter()
                if _L.llama_decode(eng.context, eng._batch) != 0:
                    raise SystemExit("llama_decode failed")
                raw.append(time.perf_counter() - t)
                pos += 2
                for s in slots:
                    ex._len[s] = pos          # the bare decode's position is the executor's too
            for s in slots:
                ex.drop(s)
            if not rep:
                continue
            steps.append(statistics.median(step) * 1e3)
            raws.append(statistics.median(raw) * 1e3)
    return steps, raws


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1, help="sequences decoding together (default 1)")
    ap.add_argument("--llama-server", default=str(SERVER))
    args = ap.parse_args(argv)
    model = str(default_model_path())
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(100, 20000, 300)] for _ in range(args.rows)]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {os.cpu_count()} CPUs, loadavg {os.getloadavg()[0]:.2f}; "
          f"{args.rows} rows a step; ms a step")
    for _ in range(args.rounds):
        peer = server(args.llama_server, model, prompts)
        step, raw = ours(model, prompts)
        fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)    # noqa: E731
        print(f"llama-server per token {fmt(peer)}   executor step {fmt(step)}   bare llama_decode {fmt(raw)}   "
              f"step / llama-server {statistics.median(step) / statistics.median(peer):.2f}x   "
              f"loadavg {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
