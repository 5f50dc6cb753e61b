"""localinfer's decode speed of a MoE with experts in host RAM, against published runs.

    python -m benchmarks.offload_published [--json out.json]

The runs: ``benchmarks/data/published_offload.csv`` (GPU, host CPU and RAM, model, quant, placement flags,
test, t/s, tool, URL, the row as printed; collected with the search tool).  A row is compared where the
GPU has a profile (built-in, or datasheet-only in ``benchmarks/data/published_devices.toml``), the host
RAM's speed and channel count are given (its bandwidth: MT/s × 8 bytes × channels, JEDEC), the model has a
preset and its quant a skeleton type, the placement is ``--n-cpu-moe N``, ``--cpu-moe`` or
``-ot exps=CPU`` (every routed expert on the host), and the test is a decode.  The prediction is
``fit``'s speed of that plan (``plan/host_speed.py``: the GPU part on llama.cpp's kernel model, the host
part at the host's bandwidth × its decode MBU); the script also prints the host MBU that would make
each prediction exact.  Rows run with ik_llama.cpp are shown apart (its CPU kernels differ from
mainline's); rows the collector marked doubtful (RAM about the model's size: paging) are left out.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.speed_published import QUANTS, held_out_profiles  # noqa: E402
from gguf_tools.skeleton import write_skeleton                     # noqa: E402
from localinfer.backends.memory import FitRequest                  # noqa: E402
from localinfer.devices.hosts import HostProfile                   # noqa: E402
from localinfer.devices.profiles import load_profiles              # noqa: E402
from localinfer.model.spec import ModelSpec                        # noqa: E402
from localinfer.plan.host_speed import plan_speed                  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "published_offload.csv"
HOST_MBU = 0.6          # the share the host profiles assumed before these runs (desktop DDR profiles still do)
GPUS = {"RTX 2080 8GB": "rtx-2080", "RTX 3090 24GB": "rtx-3090", "RTX 3090 Ti 24GB": "rtx-3090-ti",
        "RTX 4090 24GB": "rtx-4090", "RTX 5090 32GB": "rtx-5090", "RTX A6000 48GB": "rtx-a6000",
        "RTX 4080 16GB": "rtx-4080", "RTX 4060 Ti 8GB": "rtx-4060-ti-8gb"}
MODELS = {"qwen3-30b-a3b": "qwen3-30b-a3b", "qwen3-235b-a22b": "qwen3-235b-a22b", "gpt-oss-20b": "gpt-oss-20b",
          "gpt-oss-120b": "gpt-oss-120b", "deepseek-r1": "deepseek-r1", "deepseek-v3": "deepseek-v3",
          "kimi-k2": "kimi-k2"}
EXTRA_QUANTS = {"UD-Q2_K_XL": "q2_k"}
DDR_RE = re.compile(r"DDR([45])-(\d{4})")


def placement(text: str, spec) -> FitRequest | None:
    """The FitRequest of a placement as published, or None where it is not one of the three forms."""
    m = re.search(r"--n-cpu-moe (\d+)", text)
    if m:
        return FitRequest(n_ctx=4096, n_cpu_moe=int(m.group(1)))
    if "--cpu-moe" in text or "-cmoe" in text:
        return FitRequest(n_ctx=4096, cpu_moe=True)
    if re.search(r"(-ot|--override-tensor) \"?exps=CPU\"?", text):
        return FitRequest(n_ctx=4096, override_tensor=(("exps", "CPU"),))
    return None


def host_of(r: dict) -> HostProfile | None:
    m = DDR_RE.search(r["host_ram"])
    if not m or not r["ram_channels"]:
        return None
    rate, ch = int(m.group(2)), int(r["ram_channels"])
    # host compute: the cores the row names (16 where it names none) × 3 GHz × 32 FP32 FLOP a cycle (two
    # 256-bit FMA pipes): an estimate, as the host profiles' fp32_flops
    c = re.search(r"(\d+)\s*(?:cores|-core|C\b)", r["host_cpu"])
    cores = int(c.group(1)) * (2 if r["host_cpu"].lstrip().startswith("2x") else 1) if c else 16
    return HostProfile(name=f"ddr{m.group(1)}-{rate}-{ch}ch", display_name=r["host_ram"], memory_bytes=1 << 40,
                       reserve="0", bandwidth_bytes_per_s=rate * 1e6 * 8 * ch, cores=cores,
                       fp32_flops=cores * 3e9 * 32, decode_mbu=HOST_MBU)


def rows(workdir: Path):
    profiles = {**held_out_profiles(), **load_profiles()}
    specs, out, skipped = {}, [], {}
    with open(DATA, newline="", encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            why = None
            gpu = profiles.get(GPUS.get(r["gpu"], ""))
            host = host_of(r)
            quant = QUANTS.get(r["quant"]) or EXTRA_QUANTS.get(r["quant"])
            if "doubtful" in r["row_text"].lower() or "paging" in r["row_text"].lower():
                why = "marked doubtful (paging)"
            elif not r["test"].startswith("tg"):
                why = "not a decode"
            elif gpu is None:
                why = "GPU without a profile"
            elif host is None:
                why = "host RAM speed or channels not given"
            elif r["model_key"] not in MODELS or quant is None:
                why = "model or quant without a skeleton"
            if why is None:
                key = (MODELS[r["model_key"]], quant)
                if key not in specs:
                    specs[key] = ModelSpec.from_gguf(write_skeleton(key[0], workdir / f"{key[0]}-{key[1]}.gguf",
                                                                    type=key[1]))
                req = placement(r["placement"], specs[key])
                if req is None:
                    why = "placement not --n-cpu-moe / --cpu-moe / -ot exps=CPU"
            if why:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            out.append((r, gpu, host, specs[key], req))
    return out, skipped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        found, skipped = rows(Path(tmp))
    print(f"{len(found)} published expert-offload decode runs compared; left out: "
          + "; ".join(f"{n} {why}" for why, n in sorted(skipped.items())))
    print(f"{'GPU':<16} {'host RAM':<26} {'model':<15} {'quant':<11} {'placement':<26} {'tool':<12} "
          f"{'published':>9} {'predicted':>9} {'ratio':>6} {'host MBU that fits':>18}")
    doc, ratios = [], {"mainline": [], "ik_llama.cpp": []}
    for r, gpu, host, spec, req in found:
        sp = plan_speed(spec, gpu, host, dataclasses.replace(req, n_ctx=4096))
        if sp is None:
            print(f"{r['gpu'][:16]:<16} no prediction (the profile lacks a figure the speed model needs)")
            continue
        pub = float(r["tok_s"])
        pred = sp["decode_tok_s"]
        # the host MBU that makes it exact: host time = 1/pub − gpu time
        host_s = 1 / pub - sp.get("gpu_s", 0.0)
        need = (sp.get("host_read_bytes", 0) / host.bandwidth_bytes_per_s / host_s) if host_s > 0 else math.inf
        tool = "ik_llama.cpp" if "ik_llama" in r["tool"] else "mainline"
        ratios[tool].append(pred / pub)
        print(f"{r['gpu'][:16]:<16} {r['host_ram'][:26]:<26} {r['model_key']:<15} {r['quant'][:11]:<11} "
              f"{r['placement'][:26]:<26} {tool:<12} {pub:9.2f} {pred:9.2f} {pred / pub:6.2f} "
              f"{need:18.2f}")
        doc.append({"gpu": gpu.name, "host_bandwidth_bytes_per_s": host.bandwidth_bytes_per_s, "model": spec.name,
                    "quant": r["quant"], "placement": r["placement"], "tool": tool, "published": pub,
                    "predicted": pred, "host_mbu_that_fits": need, "url": r["url"]})
    for tool, v in ratios.items():
        if v:
            errs = sorted(abs(x - 1) for x in v)
            print(f"{tool}: n={len(v)}, median |predicted/published − 1| {errs[len(errs) // 2]:.0%}, "
                  f"within 25%: {sum(e <= 0.25 for e in errs)}/{len(v)}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
