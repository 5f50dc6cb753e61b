"""localinfer's llama.cpp speed model against published llama-bench results.

    python -m benchmarks.speed_published                 # every row: predicted / published, errors by group
    python -m benchmarks.speed_published --fit           # refit the per-kind coefficients, print them
    python -m benchmarks.speed_published --fit --write   # ... and write them to profiles/kinds/*.toml
    python -m benchmarks.speed_published --json out.json

The table: ``benchmarks/data/published_cuda.csv`` and ``published_unified.csv`` (device, model, quant,
test, t/s, flags, build, URL and the row as printed, collected with the search tool).  Each row's model
is a header-only skeleton of its preset and quant (``gguf_tools.skeleton``); its device is the built-in
profile of that name, else a datasheet-only profile from ``benchmarks/data/published_devices.toml``.
Devices of the second kind are **held out**: no coefficient is fitted on them, they run on their kind's
defaults only; so are built-in profiles that borrow a sibling's scales (``SIBLINGS``: H100 SXM, H200, GH200).
Left out (and counted): rows marked multi-GPU, partial offload, doubtful or superseded, CPU-only
runs, models without a preset, quants the skeleton writer does not make.

A test ``ppN[@dD]`` is a prefill of N tokens after D cached ones (tok/s = N / time); ``tgN[@dD]`` is
N decode steps after D tokens, timed at the mean context D + N/2.  "before" is the previous model: a
roofline with the profiles' efficiencies (every CUDA profile borrowing the RTX PRO 6000's vLLM
figures, 33% bandwidth / 62% of BF16 peak; Metal 75% / 75%).
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
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf_tools.skeleton import write_skeleton                       # noqa: E402
from localinfer.devices.kernels import BACKENDS, MAX_FRACTION, size_class         # noqa: E402
from localinfer.devices.profiles import load_profiles, profile_from_dict   # noqa: E402
from localinfer.model.cost import model_cost                        # noqa: E402
from localinfer.model.spec import ModelSpec                         # noqa: E402
from localinfer.plan.kernel_speed import KernelSpeed, kernel_speed  # noqa: E402
from localinfer.plan.speed import SpeedModel                        # noqa: E402

DATA = ROOT / "benchmarks" / "data"
TABLES = ("published_cuda.csv", "published_unified.csv")
KINDS = ROOT / "profiles" / "kinds"

MODELS = {
    "llama2-7b": "llama-2-7b", "llama3-8b": "llama-3.1-8b", "llama3-70b": "llama-3.1-70b",
    "llama3-405b": "llama-3.1-405b", "llama3.2-1b": "llama-3.2-1b", "llama3.2-3b": "llama-3.2-3b",
    "mistral-7b": "mistral-7b", "qwen3-30b-a3b": "qwen3-30b-a3b", "qwen3-235b-a22b": "qwen3-235b-a22b",
    "gpt-oss-20b": "gpt-oss-20b", "gpt-oss-120b": "gpt-oss-120b", "qwen3-8b": "qwen3-8b",
    **{f"qwen2.5-{s}": f"qwen2.5-{s}" for s in ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")},
    **{f"qwen3-{s}": f"qwen3-{s}" for s in ("0.6b", "1.7b", "4b", "14b", "32b")},
}
QUANTS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q8_0": "q8_0", "F16": "f16", "BF16": "bf16",
          "Q4_K_M": "q4_k_m", "Q4_K_S": "q4_k_s", "Q5_K_M": "q5_k_m", "Q6_K": "q6_k", "Q2_K": "q2_k",
          "Q3_K_M": "q3_k_m", "UD-Q4_K_XL": "q4_k_m", "MXFP4": "mxfp4_moe"}
BACKEND_OF = {"CUDA": "cuda", "Metal": "metal", "Vulkan": "vulkan", "ROCm": "rocm"}
# left out, each with its reason in the row: several GPUs, partial offload, a doubtful setup, or a kernel path
# the current build no longer takes for that case ("superseded", with the llama.cpp PR that replaced it)
SKIP_MARKS = ("multi-gpu", "partial", "doubtful", "superseded")
TEST_RE = re.compile(r"^(pp|tg)(\d+)(?:@d(\d+))?$")
# the decode_bw coefficients the fit sets: each group of types shares one
DECODE_GROUPS = {"default": ("default", "q4_0", "q4_1", "q5_0", "q5_1"), "q8_0": ("q8_0",),
                 "f16": ("f16", "bf16", "f32"), "mxfp4": ("mxfp4",)}
OLD = {"cuda": ({1: 0.33}, {1: 0.62}), "metal": ({1: 0.75}, {1: 0.75})}


@dataclasses.dataclass
class Row:
    raw: dict
    device: object
    backend: str
    held_out: bool
    spec: ModelSpec
    kind: str            # "pp" | "tg"
    tokens: int
    depth: int
    ubatch: int
    published: float

    @property
    def n_params(self) -> float:
        return sum(t.n_elements for t in self.spec.tensors)

    @property
    def label(self) -> str:
        r = self.raw
        return f"{r['device_key']:<18} {r['backend']:<6} {r['model_key']:<14} {r['quant']:<8} {r['test']:<14}"


def held_out_profiles() -> dict:
    data = tomllib.loads((DATA / "published_devices.toml").read_text(encoding="utf-8"))
    out = {}
    for d in data["device"]:
        d = dict(d)
        out[d["name"]] = profile_from_dict(d, f"benchmarks/data/published_devices.toml:{d['name']}")
    return out


def load_rows(workdir: Path) -> tuple[list[Row], dict[str, int]]:
    builtin = load_profiles()
    held = held_out_profiles()
    specs: dict[tuple[str, str], ModelSpec] = {}
    rows, skipped = [], defaultdict(int)
    for table in TABLES:
        with open(DATA / table, newline="", encoding="utf-8") as fh:
            for r in csv.DictReader(fh):
                why = _skip(r, builtin, held)
                if why:
                    skipped[why] += 1
                    continue
                key = (MODELS[r["model_key"]], QUANTS[r["quant"]])
                if key not in specs:
                    path = write_skeleton(key[0], workdir / f"{key[0]}-{key[1]}.gguf", type=key[1])
                    specs[key] = ModelSpec.from_gguf(path)
                backend = BACKEND_OF[r["backend"]]
                dev = builtin.get(r["device_key"]) or held[r["device_key"]]
                if backend != dev.kind or dev.llamacpp.get("backend", dev.kind) != backend:
                    dev = dataclasses.replace(dev, llamacpp={**dev.llamacpp, "backend": backend})
                m = TEST_RE.match(r["test"])
                held_out = r["device_key"] not in builtin or r["device_key"] in SIBLINGS
                rows.append(Row(r, dev, backend, held_out, specs[key], m.group(1),
                                int(m.group(2)), int(m.group(3) or 0), int(r["n_ubatch"] or 512),
                                float(r["tok_s"])))
    return rows, dict(skipped)


def _skip(r: dict, builtin, held) -> str | None:
    text = r["row_text"].lower()
    if any(mark in text for mark in SKIP_MARKS):
        return "marked multi-gpu, partial, doubtful or superseded"
    if r["backend"] not in BACKEND_OF:
        return f"backend {r['backend']} (CPU-only runs: the CPU path is calibrated by `localinfer bench`)"
    if r["model_key"] not in MODELS:
        return "model without a preset"
    if r["quant"] not in QUANTS:
        return f"quant {r['quant']}"
    if r["device_key"] not in builtin and r["device_key"] not in held:
        return "device without a profile or datasheet"
    if not TEST_RE.match(r["test"]):
        return "test name"
    return None


# ---- predictions -----------------------------------------------------------------------------------------

def predict(row: Row, coeff=None) -> float | None:
    """The model's tok/s for ``row``: with ``coeff``, else the shipped coefficients of the row's build era."""
    ks = kernel_speed(row.spec, row.device, ubatch=row.ubatch, era=era(row.raw))
    if ks is None:
        return None
    if coeff is not None:
        ks = KernelSpeed(row.spec, row.device, coeff, row.ubatch)
    if row.kind == "pp":
        return row.tokens / ks.prefill(1, row.tokens, row.depth).seconds
    return 1.0 / ks.decode(1, row.depth + row.tokens // 2).seconds


def predict_before(row: Row) -> float | None:
    dev = row.device
    if not dev.bandwidth_bytes_per_s or not dev.bf16_flops:
        return None
    mbu, mfu = OLD.get(dev.kind, ({1: 0.6}, {1: 0.5}))
    dev = dataclasses.replace(dev, decode_mbu=tuple(mbu.items()), prefill_mfu=tuple(mfu.items()))
    sm = SpeedModel(model_cost(row.spec), dev, ubatch=row.ubatch)
    if row.kind == "pp":
        return row.tokens / sm.prefill(1, row.tokens, row.depth).seconds
    return 1.0 / sm.decode_step(1, row.depth + row.tokens // 2).seconds


# ---- the fit ---------------------------------------------------------------------------------------------
#
# Per backend, one least-squares fit on log(predicted / published) over the calibration devices' rows:
# shared by every build: the mat-vec bandwidth fractions per type, the F16 GEMM and attention fractions and
# the MoE factor; per build era (llama.cpp before b4000, mid-2024, dequantized quantized weights to FP16 for
# cuBLAS and had no CUDA graphs; later builds run MMQ on INT8 tensor cores): the fixed times and the quantized
# path's fraction; per memory class that two or more calibration devices share, other than the commonest: a
# factor on the decode fractions (HBM parts reach a smaller share of their datasheet bandwidth than GDDR ones);
# per device: a decode and a prefill scale (its departure from the kind, e.g. Hopper's MMQ runs Ampere's mma),
# pulled towards 1.
# The product uses the current era's values.

ERAS = ("current", "2025", "2024")
SHARED = [*[(f"decode_bw.{g}", 0.05, MAX_FRACTION) for g in DECODE_GROUPS],
          ("decode_bw.moe", 0.2, 1.0),
          ("prefill.f16", 0.02, MAX_FRACTION), ("prefill.attn", 0.02, MAX_FRACTION), ("prefill.moe", 0.05, 1.0)]
PER_ERA = [("token_us", 0.0, 3000.0), ("layer_us", 0.0, 400.0), ("moe_layer_us", 0.0, 400.0),
           ("ubatch_layer_us", 0.0, 400.0),
           ("prefill.quant", 0.02, MAX_FRACTION), ("act_passes", 0.0, 40.0)]   # ≈ 10-30 F32 passes a layer
# an era that differs from the current one in these parameters only (the rest are the current era's)
ERA_OWN = {"2025": ("token_us", "layer_us", "moe_layer_us")}
# CUDA builds before the end of the October 2025 series of batch-1 decode fusions (gate+up+GLU in one mat-vec,
# PR 16630; top-k MoE routing for gpt-oss, PR 16649; ... PR 16884, 2025-10-31, whose master rows are in the table):
# more kernels per token.  b6918 (2025-11-02, benches/dgx-spark.md) is the first build in the table after it.
CUDA_FUSED = {"build": 6918, "date": "2025-11-01", "pr": 16884}
SCALE_PULL = 0.5          # residual weight of log(scale): a device departs from its kind only where its rows say so
# (and by a factor 2 at most: further than that is a kind of its own)


def era(r: dict) -> str:
    """The build era of a row: its build number, else its date, else the llama.cpp PR or issue it is from
    (numbers below 10000 are mid-2024 and earlier, before b4000); CUDA rows of the current era measured before
    the October 2025 decode fusions (:data:`CUDA_FUSED`) are "2025"."""
    m = re.search(r"\((\d+)\)|\bb?(\d{4,5})\b", r["build"])
    build = int(m.group(1) or m.group(2)) if m else None
    pr = re.search(r"ggml-org/llama\.cpp/(?:pull|issues)/(\d+)", r["url"])
    pr = int(pr.group(1)) if pr else None
    if build is not None:
        old, before_fused = build < 4000, build < CUDA_FUSED["build"]
    elif r["date"]:
        old, before_fused = r["date"][:4] in ("2023", "2024"), r["date"] < CUDA_FUSED["date"]
    else:
        old, before_fused = pr is not None and pr < 10000, pr is not None and pr <= CUDA_FUSED["pr"]
    if old:
        return "2024"
    return "2025" if r["backend"] == "CUDA" and before_fused else "current"


class Fit:
    """The parameter vector of one backend's fit and the coefficients it stands for."""

    def __init__(self, base, eras: list[str], devices: list[str], memory: list[str] = ()):
        self.base, self.eras, self.devices, self.memory = base, eras, devices, list(memory)
        mem = [(f"memory.{c}", 0.3, 1.5) for c in self.memory]
        if any(e in ERA_OWN for e in eras) and "current" not in eras:
            self.eras = eras = ["current", *eras]          # an era with a few own parameters takes the rest from here
        own = [(f"{e}:{n}", lo, hi) for e in eras for n, lo, hi in PER_ERA if n in ERA_OWN.get(e, (n,))]
        self.names = [n for n, _, _ in SHARED + mem + own] + [f"{d}:{k}" for d in devices for k in ("decode", "prefill")]
        self.lo = [lo for _, lo, _ in SHARED + mem + own] + [-0.7] * 2 * len(devices)
        self.hi = [hi for _, _, hi in SHARED + mem + own] + [0.7] * 2 * len(devices)

    def x0(self) -> list[float]:
        """Fixed starting values (not the shipped coefficients: a refit on the same rows gives the same answer)."""
        v = [0.7] * len(DECODE_GROUPS) + [0.8, 0.5, 0.3, 0.5] + [0.8] * len(self.memory)
        start = dict(zip((n for n, _, _ in PER_ERA), (300.0, 30.0, 20.0, 100.0, 0.3, 20.0)))
        for e in self.eras:
            v += [start[n] for n, _, _ in PER_ERA if n in ERA_OWN.get(e, (n,))]
        v += [0.0] * 2 * len(self.devices)
        return v

    def coeff(self, x, era_name: str, device: str | None = None, memory_class: str | None = None):
        from types import MappingProxyType
        val = dict(zip(self.names, x))
        for n, _, _ in PER_ERA:                            # an era's own value, else the current era's
            val.setdefault(f"{era_name}:{n}", val.get(f"current:{n}"))
        ds = math.exp(val.get(f"{device}:decode", 0.0)) * val.get(f"memory.{memory_class}", 1.0)
        ps = math.exp(val.get(f"{device}:prefill", 0.0))
        bw = dict(self.base.decode_bw)
        for g, types in DECODE_GROUPS.items():
            for t in types:
                bw[t] = min(MAX_FRACTION, val[f"decode_bw.{g}"] * ds)
        bw["moe"] = val["decode_bw.moe"]
        q = val[f"{era_name}:prefill.quant"]
        pre = {"quant": q, "f16": val["prefill.f16"], "bf16": val["prefill.f16"], "f32": val["prefill.f16"],
               "attn": val["prefill.attn"]}
        pre = {k: min(MAX_FRACTION, v * ps) for k, v in pre.items()}
        pre["moe"] = val["prefill.moe"]
        peaks = dict(self.base.peaks)
        if era_name == "2024" and self.base.backend == "cuda":
            peaks["quant"] = "fp16_flops"          # dequantize to FP16, cuBLAS
        return dataclasses.replace(self.base, token_s=val[f"{era_name}:token_us"] * 1e-6,
                                   layer_s=val[f"{era_name}:layer_us"] * 1e-6,
                                   ubatch_layer_s=val[f"{era_name}:ubatch_layer_us"] * 1e-6,
                                   act_passes=val[f"{era_name}:act_passes"],
                                   moe_layer_s=val[f"{era_name}:moe_layer_us"] * 1e-6,
                                   decode_bw=MappingProxyType(bw), prefill=MappingProxyType(pre),
                                   peaks=MappingProxyType(peaks))

    def memory_scale(self, x) -> dict[str, float]:
        val = dict(zip(self.names, x))
        return {c: val[f"memory.{c}"] for c in self.memory}

    def scales(self, x) -> dict[str, dict[str, float]]:
        val = dict(zip(self.names, x))
        return {d: {"decode_scale": math.exp(val[f"{d}:decode"]), "prefill_scale": math.exp(val[f"{d}:prefill"])}
                for d in self.devices}


def fit_backend(rows: list[Row]):
    """One backend's fit over ``rows`` (its calibration devices); returns (Fit, x)."""
    from scipy.optimize import least_squares

    from localinfer.devices.kernels import coefficients

    base = coefficients(dataclasses.replace(rows[0].device, llamacpp={"backend": rows[0].backend}))
    eras = sorted({era(r.raw) for r in rows}, key=ERAS.index)
    devices = sorted({r.raw["device_key"] for r in rows})
    # a memory class two or more calibration devices share gets its factor (one device's is its own scale); the
    # commonest class is the reference the kind's fractions describe
    classes = defaultdict(set)
    for r in rows:
        classes[r.device.memory_class].add(r.raw["device_key"])
    ref = max(classes, key=lambda c: len(classes[c]))
    fit = Fit(base, eras, devices, sorted(c for c in classes if c and c != ref and len(classes[c]) >= 2))
    n_dev = 2 * len(devices)

    def residuals(x):
        out = [math.log(predict(r, fit.coeff(x, era(r.raw), r.raw["device_key"], r.device.memory_class)) / r.published)
               for r in rows]
        return out + [SCALE_PULL * v for v in x[-n_dev:]]

    # soft-L1: a few rows far off (a driver 4× slower than its sibling on the same chip) do not steer the fit
    res = least_squares(residuals, fit.x0(), bounds=(fit.lo, fit.hi), max_nfev=3000, loss="soft_l1", f_scale=0.15)
    return fit, res.x


# devices without published rows that take a calibrated sibling's scales (same SM and memory technology)
SIBLINGS = {"h100-sxm": "h100-pcie", "h200": "h100-pcie", "gh200": "h100-pcie"}


def write_profile_scales(name: str, scales: dict[str, float], n_rows: int, sibling: str | None = None) -> Path | None:
    """Set the device's ``[llamacpp]`` scales in its built-in profile (replacing an earlier table)."""
    path = ROOT / "profiles" / f"{name}.toml"
    if not path.is_file():
        return None
    lines = path.read_text(encoding="utf-8").splitlines()
    out, skip = [], False
    for line in lines:
        if line.startswith("["):
            skip = line.strip() == "[llamacpp]"
        if skip or line.startswith("llamacpp = "):
            continue
        out.append(line)
    block = ["[llamacpp]"] + [f"{k} = {v:.3f}" for k, v in sorted(scales.items())] + [""]
    at = out.index("[sources]") if "[sources]" in out else len(out)
    src = (f'llamacpp = "fitted by benchmarks/speed_published.py --fit on this device\'s {n_rows} published '
           f'llama-bench rows (benchmarks/data/published_*.csv): its departure from profiles/kinds/"')
    if sibling:
        src = (f'llamacpp = "the {sibling} profile\'s fitted scales (benchmarks/speed_published.py --fit, from its '
               f'{n_rows} published llama-bench rows): the same SM and memory technology; no published rows of '
               f'this device"')
    out = out[:at] + block + out[at:]
    at = out.index("[sources]")
    out.insert(at + 1, src)
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


def error_bands(rows: list[Row], preds: list[float]) -> dict[str, dict[str, float]]:
    """90th percentile of |predicted/published − 1| per test and size class (a class needs 3 rows; ``all``
    stands in for the others)."""
    acc = defaultdict(list)
    for r, p in zip(rows, preds):
        test = "decode" if r.kind == "tg" else "prefill"
        acc[(test, size_class(r.n_params))].append(abs(p / r.published - 1))
        acc[(test, "all")].append(abs(p / r.published - 1))
    return {t: {c: round(float(_pct(v, 90)), 3) for (tt, c), v in acc.items() if tt == t and len(v) >= 3}
            for t in ("decode", "prefill")}


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return math.nan
    k = (len(v) - 1) * q / 100
    f = math.floor(k)
    return v[f] + (v[min(f + 1, len(v) - 1)] - v[f]) * (k - f)


def era_table(coeff, current) -> list[str]:
    """The TOML lines of an older era's coefficients: those that differ from the current era's."""
    out = [f"{k} = {getattr(coeff, a) * m:.{d}f}" for k, a, m, d in
           (("token_us", "token_s", 1e6, 1), ("layer_us", "layer_s", 1e6, 2), ("moe_layer_us", "moe_layer_s", 1e6, 2),
            ("ubatch_layer_us", "ubatch_layer_s", 1e6, 1), ("act_passes", "act_passes", 1, 1))
           if abs(getattr(coeff, a) - getattr(current, a)) > 1e-9]
    dequant = coeff.dequant_fallback and coeff.peaks["quant"] != "int8_ops"
    if not dequant and abs(coeff.prefill["quant"] - current.prefill["quant"]) > 1e-9:
        out.append(f"prefill = {{ quant = {coeff.prefill['quant']:.3f} }}")
    if coeff.peaks["quant"] != current.peaks["quant"]:
        out.append(f'peaks = {{ quant = "{coeff.peaks["quant"]}" }}')
    return out


def write_kind(backend: str, coeff, bands, devices: list[str], n_rows: int, memory: dict[str, float],
               eras: dict | None = None) -> Path:
    path = KINDS / f"{backend}.toml"
    old = tomllib.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    src = (f"fitted by benchmarks/speed_published.py --fit on {n_rows} published llama-bench rows of "
           f"{', '.join(devices)} (benchmarks/data/published_*.csv, each row's URL there); the current build "
           f"era's fixed times and quantized-path fraction; [eras] those of older builds "
           f"(benchmarks/speed_published.py ERAS, era())")
    lines = [f"# llama.cpp's {backend} kernels: defaults for every profile of this kind (localinfer/devices/kernels.py).",
             "# Written by `python -m benchmarks.speed_published --fit --write`; change the fit, not this file.",
             f'backend = "{backend}"',
             f"token_us = {coeff.token_s * 1e6:.1f}",
             f"layer_us = {coeff.layer_s * 1e6:.2f}",
             f"moe_layer_us = {coeff.moe_layer_s * 1e6:.2f}",
             f"ubatch_layer_us = {coeff.ubatch_layer_s * 1e6:.1f}",
             f"act_passes = {coeff.act_passes:.1f}",
             *(["dequant_fallback = true"] if coeff.dequant_fallback else []),
             "calibrated_on = [" + ", ".join(f'"{d}"' for d in devices) + "]", "", "[decode_bw]"]
    lines += [f"{t} = {v:.3f}" for t, v in sorted(coeff.decode_bw.items())]
    lines += ["", "[prefill]"] + [f"{p} = {v:.3f}" for p, v in sorted(coeff.prefill.items())]
    lines += ["", "[peaks]"] + [f'{p} = "{v}"' for p, v in sorted((old.get("peaks") or coeff.peaks).items())]
    if memory:
        lines += ["", "[memory_scale]"] + [f"{c} = {v:.3f}" for c, v in sorted(memory.items())]
    lines += ["", "[error]"] + [f"{t} = {{ " + ", ".join(f"{c} = {v}" for c, v in sorted(b.items())) + " }"
                                for t, b in bands.items() if b]
    for name, c in (eras or {}).items():
        lines += ["", f'[eras."{name}"]'] + era_table(c, coeff)
    lines += ["", "[sources]", f'fit = "{src}"']
    for k, v in sorted((old.get("sources") or {}).items()):
        if k != "fit":
            lines.append(f'{k} = "{v}"')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---- the report ------------------------------------------------------------------------------------------

def summarise(rows: list[Row], preds: list[float | None], label: str) -> list[str]:
    groups = defaultdict(list)
    for r, p in zip(rows, preds):
        if p is None:
            continue
        ratio = p / r.published
        test = "decode" if r.kind == "tg" else "prefill"
        part = "held out" if r.held_out else "calibration"
        e = era(r.raw)
        if e != "2024":                     # every build since b4000, at its own era's coefficients
            groups[("b4000+", test, "all", "all")].append(ratio)
            groups[("b4000+", test, r.backend, "all")].append(ratio)
            groups[("b4000+", test, "all", part)].append(ratio)
        groups[(e, test, "all", "all")].append(ratio)
        groups[(e, test, r.backend, "all")].append(ratio)
        groups[(e, test, r.backend, size_class(r.n_params))].append(ratio)
        groups[(e, test, "all", size_class(r.n_params))].append(ratio)
        groups[(e, test, "all", part)].append(ratio)
    out = [f"{label}: |predicted/published - 1| by build era, test, backend, size class or part "
           "(n, median, 90th percentile, share within 35%, worst ratio)"]
    order = ("b4000+",) + ERAS
    for key in sorted(groups, key=lambda k: (order.index(k[0]), k[1:])):
        v = groups[key]
        errs = [abs(x - 1) for x in v]
        worst = max(v, key=lambda x: max(x, 1 / x))
        within = sum(e <= 0.35 for e in errs) / len(errs)
        out.append(f"  {key[0]:<8} {key[1]:<8} {key[2]:<7} {key[3]:<12} n={len(v):<4} median {_pct(errs, 50):6.1%}  "
                   f"90th {_pct(errs, 90):6.1%}  within 35% {within:5.0%}  worst x{worst:.2f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="refit the per-kind coefficients on the calibration rows")
    ap.add_argument("--write", action="store_true", help="with --fit: write them to profiles/kinds/*.toml")
    ap.add_argument("--json", help="write every row's figures here")
    ap.add_argument("--rows", action="store_true", help="print every row")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows, skipped = load_rows(Path(tmp))
    print(f"{len(rows)} published rows used ({sum(r.held_out for r in rows)} on held-out devices); left out: "
          + "; ".join(f"{n} {why}" for why, n in sorted(skipped.items())))
    eras_of = {}
    if args.fit:
        for backend in BACKENDS:
            cal = [r for r in rows if r.backend == backend and not r.held_out]
            if len(cal) < 4:
                continue
            fit, x = fit_backend(cal)
            coeff = fit.coeff(x, "current")
            eras_of[backend] = (fit, x)
            mine = [r for r in rows if r.backend == backend]
            preds = [predict(r, fit.coeff(x, era(r.raw), r.raw["device_key"], r.device.memory_class)) for r in mine]
            bands = error_bands(mine, preds)
            print(f"\n[{backend}] fitted on {len(cal)} rows of {', '.join(fit.devices)}")
            for e in fit.eras:
                c = fit.coeff(x, e)
                print(f"  era {e:<8} token {c.token_s * 1e6:6.0f} us  layer {c.layer_s * 1e6:6.1f} us  "
                      f"moe layer {c.moe_layer_s * 1e6:5.1f} us  "
                      f"ubatch layer {c.ubatch_layer_s * 1e6:6.0f} us  act passes {c.act_passes:5.1f}  " +
                      ("quant prefill: dequantize to F16, F16 GEMM" if c.dequant_fallback and c.peaks["quant"] != "int8_ops"
                       else f"quant prefill {c.prefill['quant']:.2f} of {c.peaks['quant']}"))
            print("  decode_bw " + ", ".join(f"{g} {coeff.decode_bw[t[0]]:.2f}" for g, t in DECODE_GROUPS.items())
                  + f"; prefill f16 {coeff.prefill['f16']:.2f} attn {coeff.prefill['attn']:.2f} "
                    f"moe {coeff.prefill['moe']:.2f}")
            if fit.memory:
                print("  memory class " + ", ".join(f"{c} {v:.2f}" for c, v in fit.memory_scale(x).items()))
            print("  device scales " + ", ".join(f"{d} {v['decode_scale']:.2f}/{v['prefill_scale']:.2f}"
                                                 for d, v in fit.scales(x).items()))
            print(f"  error bands (90th pct, every row of this backend) {bands}")
            if args.write:
                older = {e: fit.coeff(x, e) for e in fit.eras if e != "current"}
                print(f"  wrote {write_kind(backend, coeff, bands, fit.devices, len(cal), fit.memory_scale(x), older)}")
                for d, sc in fit.scales(x).items():
                    n = [r for r in cal if r.raw["device_key"] == d]
                    keep = {k: v for k, v in sc.items()
                            if any((r.kind == "tg") == (k == "decode_scale") for r in n)}
                    if keep and d != "ryzen-ai-max-395":
                        write_profile_scales(d, keep, len(n))
                        for sib in (k for k, v in SIBLINGS.items() if v == d):
                            write_profile_scales(sib, keep, len(n), sibling=d)
        if args.write:
            from localinfer.devices import kernels, profiles
            kernels.kind_defaults.cache_clear()
            profiles.builtin_profiles.cache_clear()
            with tempfile.TemporaryDirectory() as tmp:
                rows, skipped = load_rows(Path(tmp))
    before = [predict_before(r) for r in rows]
    after = [predict(r) for r in rows]
    if args.rows:
        print("\nrow                                                               published   before  after  ratio")
        for r, b, a in zip(rows, before, after):
            tag = " (held out)" if r.held_out else ""
            print(f"  {r.label} {r.published:9.1f} {b or math.nan:8.1f} {a or math.nan:8.1f}  "
                  f"x{(a or math.nan) / r.published:5.2f}{tag}")
    print()
    print("\n".join(summarise(rows, before, "before")))
    print()
    print("\n".join(summarise(rows, after, "after")))
    if args.json:
        doc = [{**{k: r.raw[k] for k in ("device_key", "backend", "model_key", "quant", "test", "url")},
                "published": r.published, "before": b, "after": a, "held_out": r.held_out,
                "size_class": size_class(r.n_params)} for r, b, a in zip(rows, before, after)]
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
