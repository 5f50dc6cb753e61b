"""llama.cpp's real ``llama-fit-params`` against localinfer's port of ``common/fit.cpp``: the automatic context
(step 2) and several devices (the per-device layer split and where a partial layer overflows).

Each case writes a header-only skeleton GGUF, starts one ``localinfer worker --mem SIZE`` per device on loopback
(RPC workers of the sizes given, one thread each), runs the real tool with ``--rpc EP1,EP2,...`` and either no
``-c`` (llama.cpp's automatic context, which step 2 may lower to ``-fitc`` 4096), an explicit ``-c 0`` (the full
context: that sets ``-fitc`` to UINT32_MAX, no lowering) or a set context, and compares its answer line
(``-c N -ngl N [-ts ...] [-ot "..."]``) with :func:`localinfer.plan.fit_cpp.fit_cpp_split` over localinfer's
memory model of the same workers (:func:`localinfer.backends.llamacpp.split.split_breakdown`, as the dry run
sizes it); then the tool's ``--fit-print`` of its own plan (MiB of model, context, compute per device and the host) against localinfer's
bytes of the same flags.  Workers are stopped after each case.

    python -m benchmarks.fit_params_devices "$(scripts/build_llama_server.sh llama-fit-params)" \
        --out benchmarks/results/fit_params_devices.txt
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

MiB = 1 << 20
TOOL_TIMEOUT = 600

# label, preset, file type, MiB advertised by each worker, context (None: not given, 0: an explicit -c 0)[, -np
# [, the user's -ts]]
CASES = (
    ("ctx: fits after lowering the context", "llama-3.1-8b", "q4_k_m", (12288,), None),
    ("ctx: explicit -c 0 keeps the full context", "llama-3.1-8b", "q4_k_m", (12288,), 0),
    ("ctx: even 4096 is over, dense", "llama-3.1-70b", "q4_k_m", (24576,), None),
    ("ctx: even 4096 is over, MoE", "qwen3-30b-a3b", "q4_k_m", (16384,), None),
    ("2 devices: dense", "qwen3-14b", "q4_k_m", (4096, 6144), 4096),
    ("2 devices: MoE", "qwen3-30b-a3b", "q4_k_m", (10240, 8192), 4096),
    ("2 devices: dense, automatic context", "llama-3.1-8b", "q4_k_m", (6144, 8192), None),
    ("2 devices: MoE, automatic context", "qwen3-30b-a3b", "q4_k_m", (12288, 10240), None),
    ("2 devices: MoE, automatic context, room in total", "qwen3-30b-a3b", "q4_k_m", (16384, 8192), None),
    ("3 devices: MoE", "gpt-oss-120b", "mxfp4_moe", (24576, 16384, 12288), 4096),
    ("ctx with 2 sequences (-np 2, KV not unified)", "llama-3.1-8b", "q4_k_m", (12288,), None, 2),
    ("2 devices: MoE, automatic context, 2 sequences", "qwen3-30b-a3b", "q4_k_m", (12288, 10240), None, 2),
    # the user's -ts: fit.cpp keeps it where the request fits as it is, and gives up otherwise (it changes no -ts a
    # user set, even where a lowered context would fit)
    ("2 devices: a user -ts that fits as it is", "qwen3-14b", "q4_k_m", (6144, 8192), 4096, 1, (3, 4)),
    ("2 devices: a user -ts over a device", "qwen3-14b", "q4_k_m", (4096, 6144), 4096, 1, (1, 1)),
    ("2 devices: a user -ts, automatic context", "llama-3.1-8b", "q4_k_m", (6144, 8192), None, 1, (1, 1)),
    ("2 devices: a fractional user -ts that fits", "qwen3-14b", "q4_k_m", (6144, 8192), 4096, 1, (0.4, 0.6)),
)


def skeleton(preset: str, qtype: str | None, folder: str) -> str:
    from benchmarks.moe_fit_vs_llamacpp import skeleton as make

    return make(preset, qtype, folder)


def tool_args(model: str, eps, ctx: int | None, n_seq: int = 1, ts=()) -> list[str]:
    """llama-fit-params' flags: llama.cpp's defaults but the devices, the context, -np, a -ts and a 1 GiB margin."""
    return ["-m", model, "--rpc", ",".join(eps), *(["-c", str(ctx)] if ctx is not None else []),
            *(["-np", str(n_seq)] if n_seq > 1 else []), *(["-ts", ",".join(map(str, ts))] if ts else []),
            "-fitt", str((1 << 30) // MiB)]


def parse_line(stdout: str) -> str:
    """The tool's answer line."""
    return [x for x in stdout.splitlines() if x.startswith("-c ")][-1].strip()


def line_flags(line: str) -> tuple[int, int, tuple[int, ...], tuple[tuple[str, str], ...]]:
    """-c, -ngl, -ts and -ot of an answer line."""
    c = int(re.search(r"-c (\d+)", line).group(1))
    ngl = int(re.search(r"-ngl (-?\d+)", line).group(1))
    m = re.search(r"-ts ([\d,]+)", line)
    ts = tuple(int(x) for x in m.group(1).split(",")) if m else ()
    m = re.search(r'-ot "([^"]*)"', line)
    ot = tuple(tuple(e.rsplit("=", 1)) for e in m.group(1).split(",")) if m else ()
    return c, ngl, ts, ot


def fit_print(tool: str, model: str, eps, line: str, n_seq: int = 1, user_ts=()) -> dict[str, tuple[int, int, int]]:
    """The tool's ``--fit-print`` of the flags of ``line`` (``user_ts``: the user's -ts, which the line prints cast to
    integers): MiB of model, context, compute per device and the host."""
    from benchmarks.moe_fit_params_rpc import fit_print_rows

    c, ngl, ts, ot = line_flags(line)
    ts = tuple(user_ts) or ts
    extra = ["-ngl", str(ngl)] + (["-ts", ",".join(map(str, ts))] if ts else []) + \
        (["-ot", ",".join(f"{p}={b}" for p, b in ot)] if ot else [])
    proc = subprocess.run([tool, *tool_args(model, eps, c, n_seq), *extra, "--fit-print", "on"], capture_output=True,
                          text=True, timeout=TOOL_TIMEOUT, check=False)
    return fit_print_rows(proc.stdout)


def check_case(tool: str, path: str, label: str, mems, ctx, n_seq: int = 1, ts=()) -> tuple[list[str], bool]:
    from localinfer.backends.llamacpp.rpc_probe import probe
    from localinfer.backends.llamacpp.split import split_breakdown
    from localinfer.backends.memory import FitRequest
    from localinfer.model.spec import ModelSpec
    from localinfer.plan.fit_cpp import FULL_CTX, MARGIN, N_CTX_MIN, ctx_request, fit_cpp_split, parse_override
    from localinfer.plan.split_devices import from_workers
    from tests.support.rpc_workers import start_worker, stop

    spec = ModelSpec.from_gguf(path)
    started = []
    try:
        for mem in mems:
            started.append(start_worker(threads=1, mem=mem * MiB))
        eps = [ep for _, ep in started]
        setup = from_workers([probe(ep) for ep in eps])
        devs, feats = setup.devices, setup.host.cpu_features

        def on_workers(r, shares=None):
            return split_breakdown(spec, devs, replace(r, mmap=False), shares, cpu_features=feats, dry_run=True)

        t0 = time.monotonic()
        proc = subprocess.run([tool, *tool_args(path, eps, ctx, n_seq, ts), "-lv", "4"], capture_output=True,
                              text=True, timeout=TOOL_TIMEOUT, check=False)
        secs = time.monotonic() - t0
        # exit 1 and "failed to fit": fit.cpp gave up (the port's None)
        gave_up = proc.returncode == 1 and "failed to fit" in proc.stderr
        real = parse_line(proc.stdout) if proc.returncode == 0 else "(gives up)" if gave_up else \
            f"(exit {proc.returncode})"
        why = re.search(r"failed to fit params to free device memory: (.*)", proc.stderr) if gave_up else None
        layouts = proc.stderr.count("memory for test allocation by device")
        req = FitRequest(n_ctx=ctx or N_CTX_MIN, n_seq=n_seq)
        port = fit_cpp_split(spec, devs, req, ctx_auto=not ctx, n_ctx_min=FULL_CTX if ctx == 0 else N_CTX_MIN,
                             cpu_features=feats, shares=ts or None)
        mine_line = port.line() if port else "(gives up)"
        printed = fit_print(tool, path, eps, real, n_seq, ts) if proc.returncode == 0 else {}
    finally:
        for p, _ in started:
            stop(p)
    lines = [f"{label}: {os.path.basename(path)} ({spec.n_layers} layers, train context {spec.n_ctx_train}), "
             f"workers {' + '.join(f'{m} MiB' for m in mems)}, "
             + ("no -c" if ctx is None else f"-c {ctx}") + (f", -np {n_seq}" if n_seq > 1 else "")
             + (f", -ts {','.join(map(str, ts))}" if ts else ""),
             f"  llama-fit-params (real, {layouts} layouts measured, {secs:.0f} s): {_short(real, eps)}"
             + (f": {why.group(1).strip()}" if why else ""),
             f"  port:                                  {_short(mine_line, eps)}  "
             f"{'same line' if mine_line == real else 'DIFFERENT'}"]
    same = mine_line == real
    agree = True
    if printed:
        c, ngl, line_ts, ot = line_flags(real)
        ts = tuple(ts) or line_ts              # a user's -ts as given (the line casts it to integers)
        r = replace(ctx_request(FitRequest(n_seq=n_seq), c), n_gpu_layers=ngl, override_tensor=tuple(
            (p, b) for p, b in ot if parse_override(p) is None or parse_override(p)[0] < spec.n_layers))
        ours = on_workers(r, ts or None)
        mine = {f"RPC{i}": (d.weights, d.kv, d.compute) for i, d in enumerate(ours.devices)}
        mine["Host"] = (sum(v for k, v in ours.host_weights.items() if not k.startswith("CPU_REPACK")), ours.host_kv,
                        ours.host_compute)
        agree = all(tuple(v // MiB for v in mine[k]) == printed.get(k) for k in mine)
        lines.append("  its plan, model/context/compute: --fit-print (MiB) "
                     + "; ".join(f"{k} {v[0]}/{v[1]}/{v[2]}" for k, v in printed.items())
                     + "; localinfer (MiB) " + "; ".join(f"{k} {v[0] // MiB}/{v[1] // MiB}/{v[2] // MiB}"
                                                         for k, v in mine.items())
                     + f" ({'the same MiB' if agree else 'DIFFERENT MiB'})")
        lines.append("  device totals / targets (GiB, localinfer): " + ", ".join(
            f"{d.total / 2**30:.2f}/{(dv.free - MARGIN) / 2**30:.2f}" for d, dv in zip(ours.devices, devs)))
    if port is not None and port.steps:
        lines.append(_short("  port's steps: " + "; ".join(port.steps), eps))
    return lines, same and agree


def _short(line: str, eps) -> str:
    """The answer line with the loopback endpoints as EP1, EP2, ..."""
    for i, ep in enumerate(eps):
        line = line.replace(ep, f"EP{i + 1}")
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tool", help="llama-fit-params (scripts/build_llama_server.sh llama-fit-params)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "localinfer-moe-skeletons"))
    ap.add_argument("--out", default=None, help="also write the results here")
    ap.add_argument("--only", default=None, help="run the cases whose label contains this")
    args = ap.parse_args(argv)
    if not os.access(args.tool, os.X_OK):
        print(f"error: {args.tool} is not an executable llama-fit-params", file=sys.stderr)
        return 2
    os.makedirs(args.dir, exist_ok=True)
    lines = ["# llama.cpp's llama-fit-params (real) against localinfer's port of common/fit.cpp "
             "(fit_cpp_split): the automatic context and several `localinfer worker --mem` devices over loopback RPC",
             f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, no GPU; "
             f"tool: {args.tool}; header-only skeleton GGUFs ({time.strftime('%Y-%m-%d', time.gmtime())})",
             "# command: python -m benchmarks.fit_params_devices TOOL --out benchmarks/results/fit_params_devices.txt",
             "# tool flags: -m MODEL --rpc EP1[,EP2,...] [-c N] [-np N] [-ts A,B] -fitt 1024 (llama.cpp's defaults "
             "otherwise); "
             "target = free - 1024 MiB per device; EPn: the n-th worker's loopback endpoint",
             "# no -c: llama.cpp's automatic context, which fit.cpp's step 2 may lower (to -fitc 4096 at least); "
             "an explicit -c 0 sets -fitc to UINT32_MAX: the full context, no lowering",
             "# localinfer's bytes: split_breakdown(dry_run=True): the compute buffers as llama.cpp's no_alloc dry run "
             "sizes them (prompt graph only, no norm pinned to its layer's device: ggml_backend_sched_reserve_size "
             "resets the scheduler after the graph callback pinned them)", ""]
    bad = 0
    for label, preset, qtype, mems, ctx, *np in CASES:
        if args.only and args.only not in label:
            continue
        try:
            block, ok = check_case(args.tool, skeleton(preset, qtype, args.dir), label, mems, ctx, *np)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            block, ok = [label, f"  could not run: {exc}"], False
        bad += not ok
        lines += block + [""]
        print("\n".join(block), flush=True)
    n = sum(1 for x in lines if x.startswith("  port:"))
    rows = sum(1 for x in lines if x.startswith("  its plan, model/context/compute"))
    lines.append(f"# {sum(1 for x in lines if x.endswith('same line'))} of {n} answer lines the same; "
                 f"{sum(1 for x in lines if '(the same MiB)' in x)} of {rows} --fit-print rows the same in MiB "
                 f"(the {n - rows} where the tool gives up print none)")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines).rstrip() + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
