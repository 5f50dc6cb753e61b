"""llama.cpp's real ``llama-fit-params`` against localinfer's port of it, on a ``worker --mem`` device over RPC.

For each of issue 41's cases: write the header-only skeleton, start ``localinfer worker --mem SIZE`` on a
loopback port (the device: an RPC worker advertising SIZE, the RTX 4090 profile's memory by default), run the
real tool (``scripts/build_llama_server.sh llama-fit-params``) with ``--rpc`` and the case's context, parse its
``-ngl``/``-ot``, and print it beside

* localinfer's port (:func:`localinfer.plan.fit_cpp.fit_cpp`) over localinfer's memory model of the same
  worker device (:func:`localinfer.backends.llamacpp.split.split_breakdown`): the same flags or not;
* llama.cpp's own bytes for the tool's plan (its ``--fit-print``: model, context and compute per device and
  for the host, MiB rounded down) against localinfer's split breakdown of the same flags on the same worker;
* the port and localinfer's own plan on the RTX 4090 profile (a CUDA device: host experts are copied up
  for batches of 32 or more, so its compute buffer is larger than an RPC CPU worker's).

    python -m benchmarks.moe_fit_vs_llamacpp --llama-fit-params "$(scripts/build_llama_server.sh llama-fit-params)"
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import replace

from localinfer.plan.fit_cpp import MARGIN, parse_override
from tests.support.rpc_workers import start_worker as start_rpc_worker
from tests.support.rpc_workers import stop as stop_worker

MiB = 1 << 20
TOOL_TIMEOUT = 1800


def start_worker(mem: int) -> tuple[subprocess.Popen, str]:
    """A worker advertising ``mem`` bytes (exactly) on a free loopback port, one thread (the tests' helper)."""
    return start_rpc_worker(threads=1, mem=mem)


def peak_rss(proc: subprocess.Popen) -> int | None:
    """Peak resident memory of the worker and its child (the RPC server), bytes (Linux)."""
    pids = [proc.pid]
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as fh:
            pids += [int(x) for x in fh.read().split()]
    except OSError:
        pass
    best = None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        kb = int(line.split()[1]) * 1024
                        best = kb if best is None else max(best, kb)
        except OSError:
            pass
    return best


def tool_args(model: str, ep: str, req) -> list[str]:
    """The request as llama-fit-params flags (llama.cpp's defaults otherwise)."""
    args = ["-m", model, "--rpc", ep, "-c", str(req.n_ctx * req.n_seq), "-np", str(req.n_seq),
            "-b", str(req.n_batch), "-ub", str(req.n_ubatch), "-ctk", req.type_k, "-ctv", req.type_v,
            "-fitt", str(MARGIN // MiB)]
    if req.flash_attn is not None:
        args += ["-fa", "on" if req.flash_attn else "off"]
    return args


def parse_fit(stdout: str) -> tuple[int, tuple[tuple[str, str], ...]]:
    """-ngl and the -ot list of the tool's answer line (``-c N -ngl N [-ot "P=B,..."]``)."""
    line = [x for x in stdout.splitlines() if x.startswith("-c ")][-1]
    ngl = int(re.search(r"-ngl (-?\d+)", line).group(1))
    m = re.search(r'-ot "([^"]*)"', line)
    ot = tuple(tuple(e.rsplit("=", 1)) for e in m.group(1).split(",")) if m else ()
    return ngl, ot


def run_tool(tool: str, model: str, ep: str, req) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run([tool, *tool_args(model, ep, req), "-lv", "4"], capture_output=True, text=True,
                          timeout=TOOL_TIMEOUT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-fit-params exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
    ngl, ot = parse_fit(proc.stdout)
    return {"ngl": ngl, "ot": ot, "seconds": time.monotonic() - t0, "log": proc.stderr,
            "layouts": proc.stderr.count("memory for test allocation by device")}


def fit_print(tool: str, model: str, ep: str, req, ngl: int, ot) -> dict[str, tuple[int, int, int]]:
    """The tool's ``--fit-print`` of a plan: MiB of model, context, compute per device and the host."""
    extra = ["-ngl", str(ngl)] + (["-ot", ",".join(f"{p}={b}" for p, b in ot)] if ot else [])
    proc = subprocess.run([tool, *tool_args(model, ep, req), *extra, "--fit-print", "on"], capture_output=True,
                          text=True, timeout=TOOL_TIMEOUT, check=False)
    return fit_print_rows(proc.stdout)


def fit_print_rows(stdout: str) -> dict[str, tuple[int, int, int]]:
    """``--fit-print``'s rows: device (or Host) -> MiB of model, context, compute."""
    out = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
            out[parts[0]] = tuple(int(p) for p in parts[1:])
    return out


def describe(n_layers: int, ngl: int, ot) -> str:
    """-ngl and the -ot list in words: layers whose experts stay, the partial layer, layers on the host."""
    ents = [parse_override(p) for p, _ in ot]
    if not ot:
        return f"-ngl {ngl}" if ngl >= 0 else "no change"
    if any(e is None for e in ents):
        return f"-ngl {ngl} -ot {len(ot)} entries (not fit.cpp's patterns)"
    real = [(il, f) for il, f in ents if il < n_layers]
    host = sorted(il for il, f in real if f in ("moe", "attn"))
    part = [(il, f) for il, f in real if f != "moe"]
    txt = f"-ngl {ngl}, {len(host)} layers' experts on the host"
    if host:
        txt += f" ({host[0]}-{host[-1]})"
    if part:
        il, f = part[0]
        txt += f", layer {il} {f.upper()}"
    if len(real) < len(ents):
        txt += f" (+{len(ents) - len(real)} entry past the last layer)"
    return txt


def check_case(tool: str, path: str, label: str, req, mem: int, device, host) -> tuple[list[str], bool]:
    """One case: the real tool, the port over the worker, the bytes, the CUDA-profile plans; (lines, agree)."""
    from localinfer.backends.llamacpp.rpc_probe import probe
    from localinfer.backends.llamacpp.split import split_breakdown
    from localinfer.model.spec import ModelSpec
    from localinfer.plan.fit_cpp import fit_cpp
    from localinfer.plan.moe_fit import llamacpp_fit, moe_plan
    from localinfer.plan.split_devices import from_workers

    spec = ModelSpec.from_gguf(path)
    proc, ep = start_worker(mem)
    try:
        setup = from_workers([probe(ep)])
        dev = setup.devices[0]
        feats = setup.host.cpu_features

        def on_worker(r):
            return split_breakdown(spec, setup.devices, replace(r, mmap=False), cpu_features=feats, dry_run=True)

        def worker_bytes(r) -> int:
            d = on_worker(r).devices[0]
            return d.weights + d.kv + d.compute

        real = run_tool(tool, path, ep, req)
        port = fit_cpp(spec, req, worker_bytes, dev.free - MARGIN)
        same = port is not None and (port.n_gpu_layers, port.overrides) == (real["ngl"], real["ot"])
        tool_req = replace(req, n_gpu_layers=real["ngl"], override_tensor=tuple(
            (p, b) for p, b in real["ot"] if parse_override(p) is None or parse_override(p)[0] < spec.n_layers))
        printed = fit_print(tool, path, ep, req, real["ngl"], real["ot"])
        rss = peak_rss(proc)
    finally:
        stop_worker(proc)
    ours = on_worker(tool_req)
    d = ours.devices[0]
    mine = {"RPC0": (d.weights, d.kv, d.compute),
            # the tool's Host row is the host buffer types: CPU_REPACK is not one (ggml_backend_buft_is_host)
            "Host": (sum(v for k, v in ours.host_weights.items() if not k.startswith("CPU_REPACK")), ours.host_kv,
                     ours.host_compute)}
    agree = all(tuple(v // MiB for v in mine[k]) == printed.get(k) for k in mine)
    cuda_ref = llamacpp_fit(spec, device, host, req)
    plan = moe_plan(spec, device, host, req)
    n = spec.n_layers
    lines = [f"{label}",
             f"  llama-fit-params (real, {real['layouts']} layouts measured, {real['seconds']:.0f} s): "
             f"{describe(n, real['ngl'], real['ot'])}",
             f"  port over the worker device:          "
             f"{describe(n, port.n_gpu_layers, port.overrides) if port else '(gives up)'}  "
             f"{'same flags' if same else 'DIFFERENT'}",
             "  its plan, model/context/compute: llama-fit-params --fit-print (MiB) "
             + "; ".join(f"{k} {v[0]}/{v[1]}/{v[2]}" for k, v in printed.items())
             + "; localinfer (bytes) " + "; ".join(f"{k} {v[0]:,}/{v[1]:,}/{v[2]:,}" for k, v in mine.items())
             + f" ({'the same MiB' if agree else 'DIFFERENT MiB'}); device total {sum(mine['RPC0']) / 2**30:.2f} "
             f"GiB of target {(dev.free - MARGIN) / 2**30:.2f} GiB",
             f"  worker peak RSS {rss / MiB:.0f} MiB while advertising {mem / MiB:.0f} MiB" if rss else
             "  worker peak RSS: not read",
             f"  port on the {device.name} profile (CUDA): "
             + (f"{cuda_ref.summary()}, GPU {cuda_ref.device_bytes / 2**30:.2f} GiB, host "
                f"{cuda_ref.host_bytes / 2**30:.2f} GiB, {cuda_ref.decode_tok_s:.1f} tok/s" if cuda_ref else "(none)"),
             f"  localinfer's plan on {device.name}:      "
             + (f"{plan.flags()}, GPU {plan.device_bytes / 2**30:.2f} GiB, host {plan.host_bytes / 2**30:.2f} GiB, "
                f"{plan.decode_tok_s:.1f} tok/s" if plan else "(nothing fits)")]
    return lines, same and agree


def main(tool: str, cases, folder: str, device, host, out: str | None, skeleton) -> int:
    import platform

    from localinfer.backends.memory import FitRequest

    if not os.access(tool, os.X_OK):
        print(f"error: {tool} is not an executable llama-fit-params", file=sys.stderr)
        return 2
    mem = device.memory_bytes
    lines = [f"# llama.cpp's llama-fit-params (real) against localinfer's port of common/fit.cpp, one "
             f"`localinfer worker --mem {mem // MiB}MiB` device over loopback RPC ({device.display_name}'s memory)",
             f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, no GPU; "
             f"tool: {tool}; header-only skeleton GGUFs ({time.strftime('%Y-%m-%d', time.gmtime())})",
             f"# target = free - {MARGIN // MiB} MiB (-fitt); the worker's device is a CPU behind RPC: no offload_op, "
             "so unlike CUDA its compute buffer does not grow with host experts", ""]
    bad = 0
    for preset, qtype, ctx, label in cases:
        req = FitRequest(n_ctx=ctx)
        try:
            block, same = check_case(tool, skeleton(preset, qtype, folder), f"{label}, {ctx // 1024}K", req, mem,
                                     device, host)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            block, same = [f"{label}, {ctx // 1024}K", f"  could not run: {exc}"], False
        bad += not same
        lines += block + [""]
        print("\n".join(block), flush=True)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines).rstrip() + "\n")
    return 1 if bad else 0
