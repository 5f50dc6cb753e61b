"""How long `localinfer report` takes: 3 models × every profile × 3 contexts × 3 KV types.

Builds three header-only skeletons (Qwen3-8B, Qwen3-235B-A22B Q2_K, Llama-3.1-8B), then times,
in this process, reading the headers, building the report and rendering each format (best of
--repeats), and separately the whole command in a fresh interpreter.  The peer measured in the
same run is a fresh interpreter that only imports the CLI (startup cost any command pays).
Target: the report renders in < 2 s.

    python benchmarks/report_speed.py [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gguf_tools.skeleton import write_skeleton
from localinfer.commands.report import render
from localinfer.devices.profiles import all_devices
from localinfer.model.spec import ModelSpec
from localinfer.plan.speed import Workload
from localinfer.report.capacity import build_report

MODELS = (("qwen3-8b", None), ("qwen3-235b-a22b", "q2_k"), ("llama-3.1-8b", None))
CONTEXTS = (2048, 8192, 32768)
KV = ("f16", "q8_0", "q4_0")


def best(fn, repeats: int, clock=time.perf_counter) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = clock()
        out = fn()
        times.append(clock() - t)
    return min(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="report-speed-"))
    paths = [write_skeleton(p, tmp / f"{p}.gguf", type=t) for p, t in MODELS]
    devices = all_devices()
    load = os.getloadavg()
    t_read, _ = best(lambda: [ModelSpec.from_gguf(p) for p in paths], args.repeats)
    wl = Workload(16, 8192, 256, deadline_s=7)
    figures = {"read_headers_s": t_read}

    def cold(fmt: str) -> str:           # fresh specs: nothing memoised from an earlier repeat
        fresh = [ModelSpec.from_gguf(p) for p in paths]
        return render(build_report(fresh, devices, CONTEXTS, KV, plots=fmt == "html", workload=wl), fmt)

    for fmt in ("text", "md", "json", "html"):
        figures[f"read_build_render_{fmt}_s"], _ = best(lambda f=fmt: cold(f), args.repeats)
    figures["read_build_render_html_cpu_s"], _ = best(lambda: cold("html"), args.repeats, time.process_time)
    cli = [sys.executable, "-m", "localinfer", "report", *map(str, paths), "--format", "html",
           "-o", str(tmp / "r.html")]
    figures["cli_html_s"], _ = best(lambda: subprocess.run(cli, check=True, capture_output=True), args.repeats)
    peer = [sys.executable, "-c", "import localinfer.cli, localinfer.model.spec"]
    figures["peer_startup_s"], _ = best(lambda: subprocess.run(peer, check=True), args.repeats)
    cells = len(MODELS) * len(devices) * len(CONTEXTS) * len(KV)
    print(f"{len(MODELS)} models × {len(devices)} devices × {len(CONTEXTS)} contexts × {len(KV)} KV types = {cells} cells; "
          f"load average {load[0]:.1f} on {os.cpu_count()} CPUs; best of {args.repeats}")
    for k, v in figures.items():
        print(f"  {k:30} {v * 1e3:8.1f} ms")
    in_process = figures["read_build_render_html_s"]
    print(f"html report in process (headers read, built, rendered): {in_process * 1e3:.0f} ms wall, "
          f"{figures['read_build_render_html_cpu_s'] * 1e3:.0f} ms CPU; whole command {figures['cli_html_s']:.2f} s "
          f"= {figures['cli_html_s'] / figures['peer_startup_s']:.1f} × interpreter startup; "
          f"target < 2 s in process: {'met' if in_process < 2 else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_avg": load, "cells": cells, **figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
