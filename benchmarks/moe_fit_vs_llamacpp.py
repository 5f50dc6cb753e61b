"""localinfer's MoE placement against llama.cpp's ``--fit`` on one GPU plus host RAM (predictions only).

For each of issue 41's cases (a header-only skeleton of the model, one RTX 4090 profile, its default host
``ddr5-5600-2ch``), prints llama.cpp ``--fit``'s choice (:func:`localinfer.plan.moe_fit.llamacpp_fit`, a port
of ``common/fit.cpp``'s decision over localinfer's byte-exact llama.cpp memory model), localinfer's choice
(:func:`localinfer.plan.moe_fit.moe_plan`) and both predicted speeds (:mod:`localinfer.plan.host_speed`),
and checks that localinfer's plan fits wherever ``--fit``'s does and is never predicted slower.

    python -m benchmarks.moe_fit_vs_llamacpp
    python -m benchmarks.moe_fit_vs_llamacpp --out benchmarks/results/moe_fit_cpu.txt --device rtx-4090

With ``--llama-fit-params PATH`` (``scripts/build_llama_server.sh llama-fit-params`` builds it) the real tool
decides instead, over a ``localinfer worker --mem`` device the size of the profile's memory, beside the port
over the same device (:mod:`benchmarks.moe_fit_params_rpc`):

    python -m benchmarks.moe_fit_vs_llamacpp --llama-fit-params "$(scripts/build_llama_server.sh llama-fit-params)" \
        --out benchmarks/results/moe_fit_params_rpc.txt
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

CASES = (("qwen3-235b-a22b", "q2_k", 8192, "Qwen3-235B-A22B Q2_K"),
         ("qwen3-30b-a3b", "f16", 4096, "Qwen3-30B-A3B F16"),
         ("gpt-oss-120b", None, 8192, "gpt-oss-120b"))


def skeleton(preset: str, qtype: str | None, folder: str) -> str:
    path = os.path.join(folder, f"{preset}-{qtype or 'preset'}.gguf")
    if not os.path.exists(path):
        cmd = [sys.executable, "-m", "localinfer", "skeleton", preset, "-o", path]
        subprocess.run(cmd + (["--type", qtype] if qtype else []), check=True, capture_output=True)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="rtx-4090")
    ap.add_argument("--host", default=None, help="host profile (default: the device profile's)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "localinfer-moe-skeletons"))
    ap.add_argument("--out", default=None, help="also write the table here")
    ap.add_argument("--objective", default="decode", choices=("decode", "ttft"), help="localinfer's objective")
    ap.add_argument("--llama-fit-params", default=None, metavar="PATH",
                    help="run llama.cpp's own llama-fit-params over a worker --mem device and check the port")
    args = ap.parse_args(argv)

    from localinfer.backends.memory import FitRequest
    from localinfer.devices.hosts import host_for
    from localinfer.devices.profiles import get_device
    from localinfer.generation.load import open_model
    from localinfer.plan.moe_fit import llamacpp_fit, moe_plan

    os.makedirs(args.dir, exist_ok=True)
    device = get_device(args.device)
    host = host_for(device, args.host)
    if args.llama_fit_params:
        from benchmarks.moe_fit_params_rpc import main as real_tool

        return real_tool(args.llama_fit_params, CASES, args.dir, device, host, args.out, skeleton)
    lines = [f"# MoE placement on {device.display_name} + host {host.name} ({host.display_name}): predictions",
             f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python "
             f"{platform.python_version()}; no GPU used: skeleton GGUFs, localinfer's llama.cpp memory model, "
             f"the profiles' speed model ({time.strftime('%Y-%m-%d', time.gmtime())})",
             "# --fit: a port of llama.cpp common/fit.cpp's decision (localinfer/plan/fit_cpp.py; target = usable = "
             f"memory - 1 GiB margin); localinfer's objective: {args.objective}",
             "",
             f"{'model, ctx':<28}{'llama.cpp --fit':<44}{'tok/s':>7}  {'localinfer':<58}{'tok/s':>7}  ok"]
    bad = 0
    for preset, qtype, ctx, label in CASES:
        spec = open_model(skeleton(preset, qtype, args.dir)).spec
        req = FitRequest(n_ctx=ctx)
        ref = llamacpp_fit(spec, device, host, req)
        ours = moe_plan(spec, device, host, req, args.objective)
        ref_txt = ref.summary() if ref else "(no MoE plan)"
        ours_txt = ours.flags() if ours else "(nothing fits)"
        ok = ours is not None and (ref is None or not ref.fits or
                                   (ours.decode_tok_s >= ref.decode_tok_s - 1e-9 if args.objective == "decode" else
                                    ours.speed["ttft_s"] <= ref.speed["ttft_s"] + 1e-9))
        bad += not ok
        lines.append(f"{label + ', ' + str(ctx // 1024) + 'K':<28}{ref_txt:<44}{ref.decode_tok_s if ref else 0:>7.1f}  "
                     f"{ours_txt:<58}{ours.decode_tok_s if ours else 0:>7.1f}  {'yes' if ok else 'NO'}")
        if ours is not None:
            lines.append(f"{'':<28}why: {ours.why}")
            lines.append(f"{'':<28}bytes: GPU {ours.device_bytes / 2**30:.2f} GiB, host {ours.host_bytes / 2**30:.2f} "
                         f"GiB; --fit GPU {ref.device_bytes / 2**30:.2f} GiB, host {ref.host_bytes / 2**30:.2f} GiB; "
                         f"prefill {ours.speed['prefill_tok_s']:.0f} vs {ref.speed['prefill_tok_s']:.0f} tok/s, TTFT "
                         f"{ours.speed['ttft_s']:.2f} vs {ref.speed['ttft_s']:.2f} s")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
