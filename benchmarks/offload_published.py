"""localinfer's decode speed of a MoE with experts in host RAM, against published runs.

    python -m benchmarks.offload_published [--fit] [--what-if MBU GFLOPS] [--json out.json]

The runs: ``benchmarks/data/published_offload.csv`` (GPU, host CPU and RAM, model, quant, placement flags,
test, t/s, tool, URL, the row as printed; collected with the search tool).  A row is compared where the
GPU has a profile (built-in, or datasheet-only in ``benchmarks/data/published_devices.toml``), the host
RAM's rate and channel count are given (``ram_mts``, the rate the row says the DIMMs run at, and
``ram_channels``, each with its reason in ``ram_note``: bandwidth = MT/s × 8 bytes × channels, JEDEC), the
model has a preset and its quant a skeleton type, the placement is llama.cpp's (every ``-ot REGEX=BUFFER`` in
order, ``--cpu-moe``, ``--n-cpu-moe N``; ``-ngl`` covering every layer; ik_llama.cpp's ``-ser K,1`` as K experts
a token) and the test is a decode.  The host runs the threads the row gives (``-t``), else its cores.  The
prediction is ``fit``'s speed of that plan (``plan/host_speed.py``: the GPU part on llama.cpp's kernel model,
the host part the slower of its RAM, bandwidth × MBU, and its cores, threads × the per-core rate); the script
prints the MBU and the per-core rate that would each make a prediction exact.  Rows run with ik_llama.cpp are
summarised apart (its CPU kernels differ from mainline's), and so are the rows of ik_llama.cpp's K-quants without
``-rtr`` (out of scope: held out of every fit), a slower kernel path than the repacked one the per-core rate is fitted
on: where ikawrakow published the TG speedup of the quant's repacked type (``NO_RTR_SPEEDUP``, independent of these
rows) such a row's per-core rate is the fitted one over it.  A two-socket host reads at ``NUMA_SHARE`` of one
socket's bandwidth (``devices/hosts.py``: measured on another host, a Xeon 8480+ with one socket and with two, so
the two-socket rows here are held out of it); rows the collector marked
doubtful (RAM about the model's size: paging) are left out.  ``--fit`` fits the MBU and the per-core rate on the
in-scope ik_llama.cpp rows and holds every mainline row out.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.speed_published import QUANTS, held_out_profiles  # noqa: E402
from gguf_tools.skeleton import write_skeleton                     # noqa: E402
from localinfer.backends.llamacpp.overrides import parse_override_tensor  # noqa: E402
from localinfer.backends.memory import FitRequest                  # noqa: E402
from localinfer.devices.hosts import DECODE_FLOPS_PER_CORE, FALLBACK_MBU, HostProfile  # noqa: E402
from localinfer.devices.profiles import load_profiles              # noqa: E402
from localinfer.model.spec import ModelSpec                        # noqa: E402
from localinfer.plan.host_speed import plan_speed                  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "published_offload.csv"
HOST_MBU = FALLBACK_MBU  # the product's host MBU where a profile measures none (fitted here: fit(), leave one host out)
GPUS = {"RTX 2080 8GB": "rtx-2080", "RTX 3090 24GB": "rtx-3090", "RTX 3090 Ti 24GB": "rtx-3090-ti",
        "RTX 4090 24GB": "rtx-4090", "RTX 5090 32GB": "rtx-5090", "RTX A6000 48GB": "rtx-a6000",
        "RTX 4080 16GB": "rtx-4080", "RTX 4060 Ti 8GB": "rtx-4060-ti-8gb",
        "RTX PRO 6000 Blackwell 96GB": "rtx-pro-6000", "RTX PRO 6000 Blackwell Max-Q 96GB": "rtx-pro-6000-max-q",
        "Radeon RX 7900 XT 20GB (ROCm 6.4.1)": "rx-7900-xt", "Radeon RX 6900 XT 16GB (ROCm 6.2.4)": "rx-6900-xt"}
MODELS = {"qwen3-30b-a3b": "qwen3-30b-a3b", "qwen3-235b-a22b": "qwen3-235b-a22b", "gpt-oss-20b": "gpt-oss-20b",
          "gpt-oss-120b": "gpt-oss-120b", "deepseek-r1": "deepseek-r1", "deepseek-v3": "deepseek-v3",
          "kimi-k2": "kimi-k2", "glm-4.5-air": "glm-4.5-air", "qwen3.5-35b-a3b": "qwen3.5-35b-a3b",
          "llama-4-scout": "llama-4-scout"}
EXTRA_QUANTS = {"UD-Q2_K_XL": "q2_k"}
# ik_llama.cpp without -rtr: its K-quants' matrix-vector kernels before run-time repacking, slower per core by the
# TG-128 speedup of the repacked type ikawrakow published when adding it (LLaMA-3.1-8B, one thread, so compute-bound,
# on a Ryzen-7950X, Zen 4), keyed by the K type the row's quant is built on (Q4_K_M and UD-Q4_K_XL are Q4_K's)
NO_RTR_SPEEDUP = {"Q2_K": (1.376, "https://github.com/ikawrakow/ik_llama.cpp/pull/136 (Q2_K_S 6.60 -> Q2_K_R4 9.08)"),
                  "Q4_K": (1.562, "https://github.com/ikawrakow/ik_llama.cpp/pull/129 (Q4_K_S 5.73 -> Q4_K_R4 8.95)"),
                  "Q6_K": (1.476, "https://github.com/ikawrakow/ik_llama.cpp/pull/130 (Q6_K 5.38 -> Q6_K_R4 7.94)")}
K_TYPE_RE = re.compile(r"(?<![A-Z])(Q\d_K)(?!_R\d)")     # not IQ*_K, not an already repacked *_R4
# cores of the CPUs rows name without a count (llama.cpp's default threads: one a physical core): AMD's Ryzen 9 5900X
# and Ryzen 9 7900 are 12-core parts (the RX 6900 XT post: "AMD Ryzen 9 7900 (12-core/24-thread)")
CORES = {"Ryzen 9 5900X": 12, "Ryzen 9 7900": 12}
DDR_RE = re.compile(r"DDR([45])-(\d{4})")
OT_RE = re.compile(r"(?:-ot|--override-tensor)\s+(\"[^\"]+\"|'[^']+'|\S+)")


def placement(text: str, spec) -> tuple[FitRequest | None, str]:
    """(the FitRequest of a placement as published, the reason when it is not one localinfer models): every
    ``-ot REGEX=BUFFER`` in order, then ``--cpu-moe``, then ``--n-cpu-moe N`` (llama.cpp's order); ``-ngl`` must
    cover every layer (a layer split is another plan)."""
    m = re.search(r"(?:-ngl|--n-gpu-layers)\s+(\d+)", text)
    if m and int(m.group(1)) < spec.n_layers:
        return None, "partial -ngl"
    ot = tuple(pair for raw in OT_RE.findall(text) for pair in parse_override_tensor(raw.strip("\"'")))
    n = re.search(r"--n-cpu-moe (\d+)", text)
    req = FitRequest(n_ctx=4096, override_tensor=ot, cpu_moe="--cpu-moe" in text or "-cmoe" in text,
                     n_cpu_moe=int(n.group(1)) if n else 0)
    if not req.overridden:
        return None, "no expert placement"
    return req, ""


def threads_of(r: dict) -> int:
    """The CPU threads the run used: ``-t``/``--threads`` as published, else the cores the row names (2 sockets:
    twice), else 16."""
    t = re.search(r"(?:\s-t|--threads)\s+(\d+)", " " + r["placement"])
    if t:
        return int(t.group(1))
    c = re.search(r"(\d+)\s*(?:cores|-core|C\b)", r["host_cpu"])
    if c:
        return int(c.group(1)) * sockets_of(r)
    return next((n for cpu, n in CORES.items() if cpu in r["host_cpu"]), 16)


def sockets_of(r: dict) -> int:
    return 2 if r["host_cpu"].lstrip().startswith("2x") else 1


def no_rtr(r: dict) -> bool:
    """Whether the row ran ik_llama.cpp's K-quants without run-time repacking (``-rtr 0``, or no ``-rtr``)."""
    return "ik_llama" in r["tool"] and ("-rtr 0" in r["placement"] or " -rtr" not in " " + r["placement"]) \
        and "_K" in r["quant"]


def core_share(r: dict) -> float:
    """The row's per-core rate as a share of the fitted one: 1 / the published speedup of the repacked type where the
    row runs ik_llama.cpp's K-quants without ``-rtr`` (``NO_RTR_SPEEDUP``), else 1."""
    k = K_TYPE_RE.search(r["quant"].upper())
    return 1 / NO_RTR_SPEEDUP[k.group(1)][0] if no_rtr(r) and k and k.group(1) in NO_RTR_SPEEDUP else 1.0


def host_of(r: dict) -> HostProfile | None:
    """The row's host: its RAM at the rate the row says the DIMMs run at (``ram_mts``; else the DDR-NNNN it names)
    × 8 bytes × the channels (``ram_channels``, each with its reason in ``ram_note``), JEDEC theoretical; its cores at
    the fitted per-core rate × :func:`core_share`."""
    m = DDR_RE.search(r["host_ram"])
    rate = int(r["ram_mts"]) if r.get("ram_mts") else int(m.group(2)) if m else 0
    if not rate or not r["ram_channels"]:
        return None
    ch, threads = int(r["ram_channels"]), threads_of(r)
    # host compute: the threads × 3 GHz × 32 FP32 FLOP a cycle (two 256-bit FMA pipes): an estimate, as the
    # host profiles' fp32_flops
    return HostProfile(name=f"ddr-{rate}-{ch}ch", display_name=r["host_ram"], memory_bytes=1 << 40,
                       reserve="0", bandwidth_bytes_per_s=rate * 1e6 * 8 * ch, cores=threads,
                       fp32_flops=threads * 3e9 * 32, decode_mbu=HOST_MBU, sockets=sockets_of(r),
                       decode_flops_per_core=DECODE_FLOPS_PER_CORE * core_share(r))


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
                spec = specs[key]
                ser = re.search(r"-ser (\d+),1\b", r["placement"])
                if ser:             # ik_llama.cpp's -ser K,1: K experts a token instead of the model's
                    spec = dataclasses.replace(spec, n_expert_used=int(ser.group(1)))
                req, why = placement(r["placement"], spec)
                if req is None:
                    why = f"placement not modelled ({why})"
            if why:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            out.append((r, gpu, host, spec, req))
    return out, skipped


def out_of_scope(r: dict) -> str:
    """Why the row is held out of the fits, or "": ik_llama.cpp's K-quant kernels without run-time repacking, a
    slower path than the one the per-core rate is fitted on (predicted at the fitted rate over the published speedup
    of the quant's repacked type, :func:`core_share`, where one is published).  Two sockets are in scope: the host's
    NUMA share (devices/hosts.py NUMA_SHARE) describes them."""
    if not no_rtr(r):
        return ""
    return "ik_llama.cpp without -rtr" + (f" (r/{1 / core_share(r):.3f})" if core_share(r) != 1.0 else "")


def measure(found) -> list[dict]:
    """Each row's prediction and the pieces the fit needs (device time, host bytes and FLOPs, threads, bandwidth)."""
    out = []
    for r, gpu, host, spec, req in found:
        sp = plan_speed(spec, gpu, host, req)
        if sp is None:
            continue
        pub = float(r["tok_s"])
        host_s = 1 / pub - sp["gpu_s"]              # the host time that makes the prediction exact
        bw = host.effective_bandwidth / host.decode_mbu     # what MBU multiplies (two sockets: NUMA_SHARE of one)
        out.append({"row": r, "gpu": gpu.name, "model": spec.name, "published": pub, "predicted": sp["decode_tok_s"],
                    "bound": sp["decode_bound"], "gpu_s": sp["gpu_s"], "bytes": sp["host_read_bytes"],
                    "flops": sp["host_flops"], "threads": host.cores, "bandwidth": bw,
                    "tool": "ik_llama.cpp" if "ik_llama" in r["tool"] else "mainline", "scope": out_of_scope(r),
                    "core_share": core_share(r),
                    "mbu_that_fits": sp["host_read_bytes"] / bw / host_s if host_s > 0
                    else math.inf,
                    "core_flops_that_fit": sp["host_flops"] / host.cores / host_s if host_s > 0 else math.inf})
    return out


def predicted(m: dict, mbu: float, per_core: float) -> float:
    """The row's decode speed at host MBU ``mbu`` and ``per_core`` FLOP/s a thread (the model's host term; the rate ×
    the row's kernel path's share, :func:`core_share`)."""
    return 1 / (m["gpu_s"] + max(m["bytes"] / (m["bandwidth"] * mbu),
                                 m["flops"] / (m["threads"] * per_core * m["core_share"])))


def summary(label: str, ratios: list[float]) -> str:
    if not ratios:
        return f"{label}: n=0"
    errs = sorted(abs(x - 1) for x in ratios)
    p90 = errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)]     # nearest rank
    return (f"{label}: n={len(errs)}, median |predicted/published − 1| {statistics.median(errs):.0%}, "
            f"90th pct {p90:.0%},"
            f" within 25%: {sum(e <= 0.25 for e in errs)}/{len(errs)}")


def fit(ms: list[dict]) -> None:
    """(MBU, per-core rate) by least squares in log(predicted/published) on the in-scope ik_llama.cpp rows; every
    mainline row held out; then the per-core rate from each single-socket host's compute-bound rows on its own."""
    grid = [(u / 100, c * 1e9) for u in range(30, 81) for c in [x / 2 for x in range(10, 161)]]

    def best(rows):
        return min(grid, key=lambda g: sum(math.log(predicted(m, *g) / m["published"]) ** 2 for m in rows))

    fit_rows = [m for m in ms if m["tool"] == "ik_llama.cpp" and not m["scope"]]
    held = [m for m in ms if m["tool"] == "mainline"]
    mbu, per_core = best(fit_rows)
    print(f"fit on {len(fit_rows)} in-scope ik_llama.cpp rows: host MBU {mbu:.2f}, {per_core / 1e9:.1f} GFLOP/s a core")
    for label, rows in (("fitted", fit_rows), ("held out (mainline)", held),
                        ("out of scope", [m for m in ms if m["scope"]])):
        print(summary(f"  {label}", [predicted(m, mbu, per_core) / m["published"] for m in rows]))
    for host in sorted({m["row"]["host_cpu"] for m in fit_rows}):
        own = [m for m in fit_rows if m["row"]["host_cpu"] == host
               and m["flops"] / m["threads"] / (per_core * m["core_share"]) > m["bytes"] / m["bandwidth"] / mbu]
        if own:
            c = min((c for _, c in grid), key=lambda c: sum(math.log(predicted(m, mbu, c) / m["published"]) ** 2
                                                             for m in own))
            print(f"  per-core rate from {host[:40]} alone ({len(own)} compute-bound rows): {c / 1e9:.1f} GFLOP/s")
    leave_one_host_out([m for m in ms if not m["scope"]], per_core)
    numa_share()


RIG_RE = re.compile(r"(7965WX|9355|6138|5900X|Ryzen 9 7900|[0-9]{4,5}[A-Z]{0,2})")


def rig_of(r: dict) -> str:
    """The machine a row ran on: its CPU model number (two rows of one rig name it differently)."""
    m = RIG_RE.search(r["host_cpu"])
    return m.group(1) if m else r["host_cpu"]


def leave_one_host_out(ms: list[dict], per_core: float) -> None:
    """The host MBU and per-core rate fitted on every in-scope row (either tool) and, for each machine, on the other
    machines' rows alone, that fit predicting the machine left out: how far one cross-platform pair carries to a host
    it never saw."""
    grid = [(u / 100, c * 1e9) for u in range(30, 81) for c in range(15, 49)]

    def best(rows):
        return min(grid, key=lambda g: sum(math.log(predicted(m, *g) / m["published"]) ** 2 for m in rows))

    rigs = sorted({rig_of(m["row"]) for m in ms})
    mbu, core = best(ms)
    print(f"host MBU and per-core rate on all {len(ms)} in-scope rows ({len(rigs)} machines): {mbu:.2f}, "
          f"{core / 1e9:.0f} GFLOP/s; each machine left out in turn, both refitted on the others:")
    out = []
    for rig in rigs:
        mbu, core = best([m for m in ms if rig_of(m["row"]) != rig])
        rs = [predicted(m, mbu, core) / m["published"] for m in ms if rig_of(m["row"]) == rig]
        out += rs
        print(f"  {rig:<14} the others' MBU {mbu:.2f}, {core / 1e9:.0f} GFLOP/s a core: predicted/published "
              + ", ".join(f"{r:.2f}" for r in rs))
    print(summary("  left out", out))


def numa_share() -> None:
    """NUMA_SHARE from ik_llama.cpp discussion 396 (a Xeon 8480+ and an RTX 3090 decoding Llama-4-Maverick UD-IQ4_XS,
    every routed expert in RAM): ~40 tok/s on one socket, ~27 on two (--numa distribute).  The host's share of a
    step is what is left after the GPU part g localinfer predicts for that plan (a Maverick skeleton, Scout's preset
    with 128 experts on every other layer, its q4_k_m bytes scaled to IQ4_XS's 4.25 bits): (1/40 - g)/(1/27 - g)."""
    import gguf_tools.presets as presets
    from localinfer.devices.hosts import NUMA_SHARE, get_host
    from localinfer.devices.profiles import get_device

    spec = {**presets._LLAMA4_SCOUT, "name": "Llama-4-Maverick-17B-128E", "n_expert": 128, "moe_every": 2,
            "type": "q4_k_m"}
    with tempfile.TemporaryDirectory() as tmp:
        mav = ModelSpec.from_gguf(str(write_skeleton(spec, Path(tmp) / "maverick.gguf")))
    sp = plan_speed(mav, get_device("rtx-3090"), get_host("ddr5-5600-2ch"),
                    FitRequest(n_ctx=4096, override_tensor=(("exps", "CPU"),)))
    g = sp["gpu_s"] * 4.25 / 4.85          # q4_k_m ~4.85 bits a weight, IQ4_XS 4.25
    share = (1 / 40 - g) / (1 / 27 - g)
    print(f"NUMA share (ik_llama.cpp discussion 396): GPU part g = {g * 1e3:.1f} ms of a step; host share "
          f"(1/40 - g)/(1/27 - g) = {share:.3f} (NUMA_SHARE = {NUMA_SHARE}; the tok/s ratio alone would say "
          f"{27 / 40:.3f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--fit", action="store_true", help="fit the host MBU and the per-core rate, with held-out rows")
    ap.add_argument("--what-if", nargs=2, type=float, metavar=("MBU", "GFLOPS"),
                    help="also the errors at another host MBU and per-core rate (48 GFLOP/s was the host model before "
                         "the core term: threads x 3 GHz x 32 FLOP x 0.5)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        found, skipped = rows(Path(tmp))
    ms = measure(found)
    print(f"{len(ms)} published expert-offload decode runs compared; left out: "
          + "; ".join(f"{n} {why}" for why, n in sorted(skipped.items())))
    print(f"host: bandwidth × MBU {HOST_MBU}, threads × {DECODE_FLOPS_PER_CORE / 1e9:g} GFLOP/s a core")
    print(f"{'GPU':<16} {'host CPU':<22} {'model':<15} {'quant':<11} {'tool':<12} {'published':>9} {'predicted':>9} "
          f"{'ratio':>6} {'bound':<12} {'MBU fits':>8} {'GF/s/core fits':>14} {'scope':<12}")
    for m in ms:
        r = m["row"]
        print(f"{r['gpu'][:16]:<16} {r['host_cpu'][:22]:<22} {r['model_key']:<15} {r['quant'][:11]:<11} "
              f"{m['tool']:<12} {m['published']:9.2f} {m['predicted']:9.2f} {m['predicted'] / m['published']:6.2f} "
              f"{m['bound']:<12} {m['mbu_that_fits']:8.2f} {m['core_flops_that_fit'] / 1e9:14.1f} {m['scope']:<12}")
    ratios = {t: [m["predicted"] / m["published"] for m in ms if t in ("all", m["tool"])]
              for t in ("all", "mainline", "ik_llama.cpp")}
    for tool, v in ratios.items():
        print(summary(tool, v))
    print(summary("in scope (ik_llama.cpp K-quants with -rtr; two sockets at the NUMA share)",
                  [m["predicted"] / m["published"] for m in ms if not m["scope"]]))
    if args.what_if:
        mbu, per_core = args.what_if[0], args.what_if[1] * 1e9
        print(f"what if: host MBU {mbu}, {per_core / 1e9:g} GFLOP/s a core")
        for tool in ("all", "mainline", "ik_llama.cpp"):
            print(summary(f"  {tool}", [predicted(m, mbu, per_core) / m["published"] for m in ms
                                         if tool in ("all", m["tool"])]))
        print(summary("  in scope", [predicted(m, mbu, per_core) / m["published"] for m in ms if not m["scope"]]))
    if args.fit:
        fit(ms)
    if args.json:
        doc = [{k: v for k, v in m.items() if k != "row"} | {"quant": m["row"]["quant"], "url": m["row"]["url"],
                                                            "placement": m["row"]["placement"]} for m in ms]
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
