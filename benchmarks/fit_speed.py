"""How long does `localinfer fit` take on an 80 GiB model?  Target: < 0.5 s for the whole command.

Writes a Qwen3-235B-A22B Q2_K skeleton (79.8 GiB, sparse: a few KiB on disk),
then times the complete command — a fresh `python -m localinfer fit MODEL`
process checking this machine and every device profile — against a bare
`python -c pass` started the same way (the interpreter's own start-up,
measured in the same run so machine load affects both).  Also reports the
in-process time of the fit itself and the CPU time of the command.

    python benchmarks/fit_speed.py [--runs 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def in_process(path: str) -> float:
    code = ("import time, sys; t0 = time.perf_counter(); "
            "from localinfer.devices.profiles import all_devices; from localinfer.plan.fit import fit_device, FitRequest; "
            "from localinfer.model.spec import ModelSpec; "
            f"s = ModelSpec.from_gguf({path!r}); [fit_device(s, d, FitRequest(n_ctx=8192)) for d in all_devices()]; "
            "print(time.perf_counter() - t0)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(out.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from gguf_tools.skeleton import write_skeleton

    with tempfile.TemporaryDirectory() as d:
        model = str(write_skeleton("qwen3-235b-a22b", Path(d) / "qwen3-235b-q2_k.gguf", type="q2_k"))
        size = os.path.getsize(model)
        fit_cmd = [sys.executable, "-m", "localinfer", "fit", model, "--ctx", "8192"]
        base_cmd = [sys.executable, "-c", "pass"]
        timed(fit_cmd)                                  # warm the page cache and .pyc files
        fit = [timed(fit_cmd) for _ in range(args.runs)]
        base = [timed(base_cmd) for _ in range(args.runs)]
        inproc = [in_process(model) for _ in range(args.runs)]
    n_dev = 1 + len(list((Path(__file__).resolve().parent.parent / "profiles").glob("*.toml")))
    fit_wall = statistics.median(w for w, _ in fit)
    row = {
        "model_bytes": size, "devices": n_dev, "runs": args.runs,
        "fit_command_wall_s": fit_wall, "fit_command_cpu_s": statistics.median(c for _, c in fit),
        "python_startup_wall_s": statistics.median(w for w, _ in base),
        "fit_in_process_s": statistics.median(inproc),
        "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
    }
    row["fit_minus_startup_s"] = fit_wall - row["python_startup_wall_s"]
    print(f"model: Qwen3-235B-A22B Q2_K skeleton, {size / 2**30:.2f} GiB; {n_dev} devices (this machine + profiles)")
    print(f"{'measure':<44}{'median':>10}")
    for key, label in (("fit_command_wall_s", "localinfer fit MODEL --ctx 8192 (wall)"),
                       ("fit_command_cpu_s", "  the same, CPU time"),
                       ("python_startup_wall_s", "python -c pass (wall, same machine, same run)"),
                       ("fit_minus_startup_s", "fit minus interpreter start-up"),
                       ("fit_in_process_s", "imports + header + all devices, in process")):
        print(f"{label:<44}{row[key]:>9.3f}s")
    print(f"target: whole command < 0.5 s — {'met' if fit_wall < 0.5 else 'NOT met'} "
          f"(load average {row['load_average']:.1f} on {row['cpus']} CPUs)")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
