"""How wide a KV view llama.cpp attends over while serving, and what a decode step costs at each width.

    python benchmarks/serve_nkv.py [--llama-server PATH] [--concurrency 8] [--rounds 2] [--servers LIST] \
        [--out FILE]

llama.cpp attends over the cells up to the highest one in use (``n_kv``: ``used_max_p1`` padded to 256),
and flash attention still reads the mask of every cell in it, so cells nobody decodes (a parked sequence, a
slot's old prompt, holes left by finished requests) widen every step.  Each server runs with
``LLAMA_KV_CACHE_DEBUG=1``, which makes llama.cpp log, for every ubatch and each sequence in it,
``find_slot: ... n = <used_max_p1>, used = <cells in use>, head = ...`` and then every sequence's
``min[s] / max[s]`` positions (localinfer echoes llama.cpp's log with ``LOCALINFER_LLAMA_LOG=1``;
llama-server with ``-v``).  The script stamps each line as it arrives and reads the ubatches back: their
view (``n`` before the ubatch lands), the cells used, the holes below the view's top (``n - used``), the
rows (a sequence's ``max`` one higher at the next ubatch: a decode row), and the time to the next ubatch.
It prints, for the decode-only ubatches of ``--concurrency`` rows, the view's distribution and the median
time per step at each ``n_kv``; and for the whole run the decode tokens by the rows of their ubatch and the time
by kind of ubatch (prompt, decode of N rows: ``seconds_by_kind``).  The load is one closed-loop level
(``benchmarks/serve_load.py``: the closed scenario of serve_peers.py, fresh ~300-token prompts, 128 tokens out);
the servers take turns, ``--rounds`` times.  The debug log itself costs time (one Python callback per line for
localinfer, a log line per token for llama-server's ``-v``), so compare these step times only with each other.

Servers: ``localinfer`` (parked KV in host memory), ``localinfer --parked 0``, ``llama-server``.
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
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serve_peers import SCENARIOS, commands, free_port, load, machine, stop, wait_ready   # noqa: E402
from localinfer.model.sources import resolve_model                                      # noqa: E402

SLOT_RE = re.compile(r"find_slot: stream\[\d+\], n = +(\d+), used = +(\d+), head = +(\d+)")
SEQ_RE = re.compile(r"find_slot: stream\[\d+\] min\[(\d+)\] = +(-?\d+), max\[\d+\] = +(-?\d+)")
PAD = 256


def n_kv(n: int) -> int:
    return max(PAD, -(-n // PAD) * PAD)


@dataclass
class Ubatch:
    """One ubatch as llama.cpp's find_slot logged it, before its tokens landed."""
    t: float                   # when its first line arrived (s)
    n: int                     # used_max_p1: the highest cell in use, plus one
    used: int                  # cells in use
    head: int                  # where llama.cpp's search for free cells starts
    n_seqs: int = 0            # sequences in the ubatch (one "n =" line each)
    max_pos: dict[int, int] = field(default_factory=dict)    # every sequence in the cache: its highest position


def parse(lines) -> list[Ubatch]:
    """The ubatches of a stamped debug log (lines ``"<seconds> <text>"``)."""
    out: list[Ubatch] = []
    last_key = None
    for line in lines:
        stamp, _, text = line.partition(" ")
        if m := SLOT_RE.search(text):
            key = tuple(int(x) for x in m.groups())
            if key != last_key:       # a ubatch prints one such line per sequence it holds, all alike
                out.append(Ubatch(float(stamp), *key))
                last_key = key
            out[-1].n_seqs += 1
        elif (m := SEQ_RE.search(text)) and out:
            out[-1].max_pos[int(m.group(1))] = int(m.group(3))
    return out


def decode_steps(ubatches: list[Ubatch], rows: int) -> list[tuple[Ubatch, float]]:
    """The ubatches of ``rows`` decode rows and nothing else (each of its sequences one position further at the
    next ubatch), with the time to the next ubatch."""
    got = []
    for a, b in zip(ubatches, ubatches[1:]):
        grew = [b.max_pos.get(s, -1) - p for s, p in a.max_pos.items()]
        if a.n_seqs == rows and sum(1 for g in grew if g == 1) == rows and all(g <= 1 for g in grew):
            got.append((a, b.t - a.t))
    return got


def _rows_and_prompts(a: Ubatch, b: Ubatch) -> tuple[int, int]:
    """Ubatch ``a``'s decode rows and prompt chunks, read from the next ubatch ``b``: a prompt chunk is a sequence
    more than one position further at ``b``, or new there with more than one position; every other sequence in
    ``a`` is a decode row (a finishing one included: it is gone at ``b``)."""
    prompts = sum(1 for s, p in a.max_pos.items() if b.max_pos.get(s, -1) - p > 1)
    prompts += sum(1 for s, p in b.max_pos.items() if s not in a.max_pos and p > 0)
    return max(0, a.n_seqs - prompts), prompts


def decode_rows(ubatches: list[Ubatch]) -> Counter:
    """Decode tokens by how many decode rows their ubatch held, prompt tokens beside them or not: where a row costs
    less in a fuller batch, the mean is the lever."""
    got: Counter = Counter()
    for a, b in zip(ubatches, ubatches[1:]):
        rows, _ = _rows_and_prompts(a, b)
        if rows:
            got[rows] += rows
    return got


def seconds_by_kind(ubatches: list[Ubatch]) -> dict[str, float]:
    """The run's time between ubatches by what the earlier one held: ``prompt`` (any prompt chunk, decode rows
    beside it or not) or ``decode N`` (N rows, nothing else).  llama.cpp also logs a ubatch for each sequence a
    state write places (localinfer's compaction, a parked prefix written back), so for localinfer ``prompt`` holds
    those writes and the time until the next ubatch after them."""
    got: dict[str, float] = defaultdict(float)
    for a, b in zip(ubatches, ubatches[1:]):
        rows, prompts = _rows_and_prompts(a, b)
        got["prompt" if prompts else f"decode {rows}"] += b.t - a.t
    return {k: round(v, 3) for k, v in sorted(got.items())}


def summary(ubatches: list[Ubatch], rows: int) -> dict:
    """One run's figures: its decode-only steps of ``rows`` rows by view width, decode tokens by rows, time by kind."""
    steps = decode_steps(ubatches, rows)
    by_rows = decode_rows(ubatches)
    by_kv: dict[int, list[float]] = defaultdict(list)
    for u, dt in steps:
        by_kv[n_kv(u.n)].append(dt * 1e3)
    med = lambda xs: round(statistics.median(xs), 2) if xs else None
    return {"ubatches": len(ubatches), "decode_steps": len(steps),
            "n_kv_all": dict(sorted(Counter(n_kv(u.n) for u in ubatches).items())),
            "n_kv": {k: len(v) for k, v in sorted(by_kv.items())},
            "step_ms_by_n_kv": {k: med(v) for k, v in sorted(by_kv.items())},
            "step_ms_median": med([dt * 1e3 for _, dt in steps]),
            "n_median": med([u.n for u, _ in steps]), "used_median": med([u.used for u, _ in steps]),
            "holes_median": med([u.n - u.used for u, _ in steps]),
            "head_median": med([u.head for u, _ in steps]),
            "decode_tokens_by_rows": dict(sorted(by_rows.items())),
            "seconds_by_kind": seconds_by_kind(ubatches),
            "mean_rows_a_decode_token": round(sum(k * v for k, v in by_rows.items()) / max(1, sum(by_rows.values())),
                                              3)}


def _stamp(src, dst) -> None:
    for raw in iter(src.readline, b""):
        dst.write(f"{time.perf_counter():.6f} {raw.decode('utf-8', 'replace')}")
    dst.close()


def measure(name: str, cmd: list[str], env: dict, url: str, level: list[str], seed: int, tmp: Path) -> dict:
    log = tmp / f"{name}.log"
    f = log.open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    reader = threading.Thread(target=_stamp, args=(proc.stdout, f), daemon=True)
    reader.start()
    try:
        wait_ready(url, proc, log)
        f.flush()
        start = time.perf_counter()
        run = load(argparse.Namespace(smoke=False), name, url, SCENARIOS["closed"], level, tmp, seed)["runs"][0]
    finally:
        stop(proc)
        reader.join(30)
    with log.open() as fh:
        ubatches = [u for u in parse(fh) if u.t >= start]
    return {"server": name, "tok_s": run["output_tok_s"], "itl_p50_ms": run["itl_p50_ms"],
            "ttft_p50_ms": run["ttft_p50_ms"], **summary(ubatches, int(level[1]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", help="path of a llama-server binary")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--servers", default="localinfer,llama-server",
                    help="comma-separated: localinfer, localinfer --parked 0, llama-server")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    r = resolve_model(None)
    model = str(getattr(r, "path", r))
    ctx = SCENARIOS["closed"]["ctx"]
    env = {**os.environ, "LLAMA_KV_CACHE_DEBUG": "1", "LOCALINFER_LLAMA_LOG": "1"}
    level = ["--concurrency", str(args.concurrency)]
    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    rows = []
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with tempfile.TemporaryDirectory() as d:
        for rnd in range(args.rounds):
            ports = {n: free_port() for n in ("localinfer", "llama-server", "llama-cpp-python")}
            peer = argparse.Namespace(threads=args.threads, llama_server=args.llama_server, llama_cpp_python=None,
                                      serve_arg=[])
            cmds = commands(peer, model, ctx, ports)
            runs = {"localinfer": cmds["localinfer"], "localinfer --parked 0": cmds["localinfer"] + ["--parked", "0"]}
            if args.llama_server:
                runs["llama-server"] = cmds["llama-server"] + ["-v"]
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                port = ports["llama-server" if name == "llama-server" else "localinfer"]
                row = measure(name.replace(" ", "_"), runs[name], env, f"http://127.0.0.1:{port}/v1", level,
                              args.seed + rnd, Path(d))
                row.update(server=name, round=rnd + 1)
                rows.append(row)
                print(f"round {rnd + 1}  {name:<22}{row['tok_s']:>6.1f} tok/s  ITL p50 {row['itl_p50_ms']:>5.1f} ms  "
                      f"{row['decode_steps']} decode steps of {args.concurrency} rows: view n median "
                      f"{row['n_median']}, used {row['used_median']}, holes {row['holes_median']}, head "
                      f"{row['head_median']}, step {row['step_ms_median']} ms", flush=True)
                print("      n_kv: " + ", ".join(f"{k} x{v} {row['step_ms_by_n_kv'][k]} ms"
                                              for k, v in row["n_kv"].items()), flush=True)
                print(f"      decode tokens by rows a ubatch: {row['decode_tokens_by_rows']} (mean "
                      f"{row['mean_rows_a_decode_token']}); seconds by kind: {row['seconds_by_kind']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "when": when, "concurrency": args.concurrency,
                                              "threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
