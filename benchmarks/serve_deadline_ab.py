"""Deadline-aware admission, two code trees A/B: Poisson arrivals with deadlines, fresh servers alternated per seed.

    python benchmarks/serve_deadline_ab.py --a /tmp/old --b /tmp/new --rate 0.6 --seeds 21-26 \
        --out benchmarks/results/serve_deadline_ab_cpu

Each tree is a checkout of localinfer (``git clone`` at the commits compared).  For every seed both trees serve
the same load (serve_load.py: ``--requests`` at ``--rate`` a second, 300-token prompts, 128-token replies, every
request with a ``--deadline-ms`` deadline and the same SLO), each on a fresh ``serve`` (``--parallel 8 --ctx 4096
-t 2 -fa on``), A first on odd seeds and B first on even ones.  A request is *cut* when it was admitted and then
finished at its deadline (``localinfer_requests_finished_total{reason="deadline"}`` less the refusals answered 429),
its prompt's compute wasted.  Printed per run and in total: served, within the SLO, cut, refused, output tok/s,
goodput (requests within the SLO a second) and TTFT p50, with the load average beside each run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.serve_peers import stop, wait_ready  # noqa: E402


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        return list(range(lo, hi + 1))
    return [int(x) for x in text.split(",")]


def _metric(text: str, name: str, label: str) -> float:
    m = re.search(rf"^{name}\{{[^}}]*{label}[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run_one(tree: str, model: str, seed: int, args, port: int) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    log = open(Path(tempfile.gettempdir()) / f"deadline_ab_{port}.log", "w")
    srv = subprocess.Popen([sys.executable, "-m", "localinfer", "serve", model, "--port", str(port), "--parallel", "8",
                            "--ctx", "4096", "-t", str(args.threads), "-fa", "on", "--max-queue", "1024"],
                           cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base + "/v1", srv, Path(log.name))
        load_before = os.getloadavg()[0]
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, str(HERE / "serve_load.py"), "--url", base + "/v1", "--rate",
                            str(args.rate), "--concurrency", "", "--requests", str(args.requests), "--prompt-tokens",
                            "300", "--output-tokens", "128", "--slo-ttft", str(args.deadline_ms / 1000), "--slo-e2e",
                            str(args.deadline_ms / 1000), "--deadline-ms", str(args.deadline_ms), "--seed", str(seed),
                            "--out", out.name], check=True, timeout=args.requests / args.rate + 180,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            r = json.load(open(out.name))["runs"][0]
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        factor = None
        for _ in range(10):      # after the load: the first read starts the engine thread's snapshots
            snap = json.loads(urllib.request.urlopen(base + "/v1/engine/state", timeout=10).read()).get("snapshot")
            if snap:
                factor = (snap.get("deadline_factor") or {}).get("factor")
                break
            time.sleep(0.3)
    finally:
        stop(srv)
        log.close()
    at_deadline = _metric(metrics, "localinfer_requests_finished_total", 'reason="deadline"')
    refused = _metric(metrics, "localinfer_requests_rejected_total", 'status="429"')
    return {"seed": seed, "ok": r["ok"], "good": r["good"], "cut": at_deadline - refused, "refused": refused,
            "tok_s": r["output_tok_s"], "goodput": r["goodput_req_s"], "ttft_p50_ms": r["ttft_p50_ms"],
            "load_1m": round((load_before + os.getloadavg()[0]) / 2, 2),
            "deadline_factor": None if factor is None else round(factor, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="tree A (a localinfer checkout)")
    ap.add_argument("--b", required=True, help="tree B")
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded model)")
    ap.add_argument("--rate", type=float, default=0.6)
    ap.add_argument("--seeds", default="21-26", help="LO-HI or a comma list")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--deadline-ms", type=int, default=10000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=18557)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.txt")
    args = ap.parse_args(argv)
    if args.model is None:
        from localinfer.model.sources import default_model_path
        args.model = str(default_model_path())
    trees = {"A": args.a, "B": args.b}
    heads = {k: subprocess.run(["git", "-C", t, "rev-parse", "--short", "HEAD"], capture_output=True,
                               text=True).stdout.strip() for k, t in trees.items()}
    runs, lines = [], [f"serve_deadline_ab.py {' '.join(argv if argv is not None else sys.argv[1:])}",
                        f"A = {heads['A']} ({args.a}), B = {heads['B']} ({args.b}); {os.cpu_count()} CPUs, "
                        f"started {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    for seed in _seeds(args.seeds):
        for k in ("A", "B") if seed % 2 else ("B", "A"):
            row = {"tree": k, **run_one(trees[k], args.model, seed, args, args.port)}
            runs.append(row)
            lines.append(f"{k} seed {seed}: served {row['ok']:3d} within SLO {row['good']:3d} cut {row['cut']:3.0f} "
                         f"refused {row['refused']:3.0f} tok/s {row['tok_s']:6.2f} goodput {row['goodput']:.3f} "
                         f"TTFT p50 {row['ttft_p50_ms']:7.0f} ms  load {row['load_1m']}  "
                         f"factor {row['deadline_factor']}")
            print(lines[-1], flush=True)
    lines += [f"ended {time.strftime('%H:%M UTC', time.gmtime())}", ""]
    totals = {}
    for k in ("A", "B"):
        rs = [r for r in runs if r["tree"] == k]
        totals[k] = t = {"good": sum(r["good"] for r in rs), "cut": sum(r["cut"] for r in rs),
                         "ok": sum(r["ok"] for r in rs), "refused": sum(r["refused"] for r in rs),
                         "tok_s": sum(r["tok_s"] for r in rs) / len(rs),
                         "goodput": sum(r["goodput"] for r in rs) / len(rs)}
        lines.append(f"{k} ({heads[k]}): served {t['ok']} within SLO {t['good']} cut {t['cut']:.0f} refused "
                     f"{t['refused']:.0f}; mean tok/s {t['tok_s']:.2f}, mean goodput {t['goodput']:.3f} req/s")
    wins = sum(1 for s in _seeds(args.seeds)
               if [r["good"] for r in runs if r["seed"] == s and r["tree"] == "B"][0]
               > [r["good"] for r in runs if r["seed"] == s and r["tree"] == "A"][0])
    lines.append(f"B served more within the SLO than A on {wins} of {len(_seeds(args.seeds))} seeds")
    print("\n".join(lines[-4:]))
    if args.out:
        doc = {"rate": args.rate, "requests": args.requests, "deadline_ms": args.deadline_ms, "heads": heads,
               "trees": trees, "runs": runs, "totals": totals, "machine": os.uname().nodename}
        Path(args.out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
        Path(args.out + ".txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
