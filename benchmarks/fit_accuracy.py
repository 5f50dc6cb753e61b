"""How exact is `localinfer fit`?  Compare its terms with llama.cpp's own accounting.

For each case llama.cpp (llama-cpp-python, in a subprocess) loads the model as a
dry run — ``no_alloc=True``, ``load_mode=LLAMA_LOAD_MODE_NONE``, extra buffer
types on, so the CPU repack buffer is planned too — creates the context, and
reports its memory per buffer type through ``llama_get_memory_breakdown``
(model / context / compute bytes, the numbers llama.cpp's ``--fit`` uses); the
output buffer comes from its log.  ``--mmap`` cases do a real mmap load of
small models to check the mapped-range accounting.  fit computes the same
terms from the GGUF header alone (this machine's profile, no mmap for the dry
runs) and the table prints both with the residual.  Beside them, for the same
request loaded as users load it (mmap), fit's two CPU figures: *resident*
(what the verdict uses: mapped pages of repacked tensors and token embeddings
left out) and *mapped* (llama.cpp's buffers with the mapping whole, what RSS
shows before memory pressure); benchmarks/fit_resident.py measures the first.

    python benchmarks/fit_accuracy.py            # the issue's cases (skeletons go to /tmp)
    python benchmarks/fit_accuracy.py --quick    # the embedded model only
    python benchmarks/fit_accuracy.py --json results.json

Targets: weights and KV exact to the byte, compute within 5 %, total within 2 %.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

@dataclass
class Case:
    name: str
    model: str                    # "default" or a skeleton preset[:type]
    n_ctx: int
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    n_seq: int = 1
    n_ubatch: int = 512
    mmap: bool = False            # a real mmap load instead of the dry run
    swa_full: bool = False        # llama.cpp's CLI default (its C API defaults to True)
    extra: dict = field(default_factory=dict)


def issue_cases(quick: bool = False) -> list[Case]:
    """The cases the issue lists: the embedded model over ctx × KV × FA, and four skeletons at 2K and 8K."""
    cases = []
    for ctx in (512, 2048, 8192):
        for kv in ("f16", "q8_0", "q4_0"):
            for fa in (True, False):
                tv = kv if fa else "f16"   # llama.cpp needs flash attention for a quantized V cache
                cases.append(Case(f"smollm2 {ctx} {kv}/{tv} fa={'on' if fa else 'off'}", "default", ctx, kv, tv, fa))
    cases.append(Case("smollm2 4096 np=4", "default", 4096, n_seq=4))
    cases.append(Case("smollm2 2048 mmap", "default", 2048, mmap=True))
    if quick:
        return cases
    for preset, ctxs in (("qwen3-8b:bf16", (2048, 8192)), ("qwen3-8b:q4_0", (2048, 8192)),
                         ("llama-3.1-8b:q8_0", (2048, 8192)), ("qwen3-235b-a22b:q2_k", (2048, 8192))):
        for ctx in ctxs:
            cases.append(Case(f"{preset} {ctx}", preset, ctx))
    cases.append(Case("qwen3-8b:q4_0 8192 fa=off", "qwen3-8b:q4_0", 8192, flash_attn=False))
    return cases


def model_path(model: str, workdir: Path) -> str:
    """The embedded model, a GGUF path, or a skeleton written (once) into workdir."""
    if model == "default":
        from localinfer.model.sources import default_model_path

        return str(default_model_path())
    if model.endswith(".gguf"):
        return model
    from gguf_tools.skeleton import write_skeleton

    preset, _, qtype = model.partition(":")
    path = workdir / f"{preset}-{qtype or 'default'}.gguf"
    if not path.exists():
        write_skeleton(preset, path, type=qtype or None)
    return str(path)


# ---- the llama.cpp side: localinfer.backends.llamacpp.dryrun, in one subprocess ----------

def _request(case: Case):
    from localinfer.backends.llamacpp.dryrun import DryRunRequest

    return DryRunRequest(n_ctx=case.n_ctx, n_seq=case.n_seq, type_k=case.type_k, type_v=case.type_v,
                         flash_attn=case.flash_attn, n_ubatch=case.n_ubatch, swa_full=case.swa_full)


def probe(jobs: list[tuple[str, list[Case]]], timeout: float = 900) -> list[list]:
    """llama.cpp's accounting (DryRunResult, or DryRunError) for each (model path, cases) job, in one subprocess:
    the dry-run cases of a model share one load, its mmap cases another (a real mmap load)."""
    from localinfer.backends.llamacpp.dryrun import DryRunJob, run_jobs

    runs, where = [], []
    for gi, (path, cases) in enumerate(jobs):
        for mmap in (False, True):
            picked = [ci for ci, c in enumerate(cases) if c.mmap == mmap]
            if picked:
                runs.append(DryRunJob(path, tuple(_request(cases[ci]) for ci in picked), mmap=mmap))
                where.append((gi, picked))
    out = [[None] * len(cases) for _, cases in jobs]
    for (gi, picked), results in zip(where, run_jobs(runs, timeout)):
        for ci, res in zip(picked, results):
            out[gi][ci] = res
    return out


# ---- the comparison ---------------------------------------------------------------

MIB = 1 << 20


def predict(path: str, case: Case) -> dict:
    """fit's terms for this machine with the case's settings (dry runs: no mmap)."""
    from localinfer.backends.llamacpp.memory import breakdown
    from localinfer.backends.memory import FitRequest
    from localinfer.devices.profiles import local_device
    from localinfer.model.spec import ModelSpec

    spec = ModelSpec.from_gguf(path)
    req = FitRequest(n_ctx=case.n_ctx, n_seq=case.n_seq, type_k=case.type_k, type_v=case.type_v,
                     flash_attn=case.flash_attn, n_ubatch=case.n_ubatch, mmap=case.mmap, swa_full=case.swa_full)
    bd, cells = breakdown(spec, local_device(), req)
    mapped, _ = breakdown(spec, local_device(), replace(req, mmap=True))
    return {"weights": bd.weights, "kv": bd.kv, "output": bd.output, "compute": bd.compute, "total": bd.total,
            "buffers": {t.buffer: t.bytes for t in bd.terms if t.buffer}, "n_ctx": cells.n_ctx,
            "resident_mmap": mapped.resident_bytes, "mapped_mmap": mapped.mapped_bytes}


def measured(result) -> dict | None:
    """llama.cpp's terms from a DryRunResult (the context column is KV and recurrent state together)."""
    if isinstance(result, Exception) or result is None or not result.buffers:
        return None
    b = {x.name: [x.weights, x.kv + x.state, x.compute] for x in result.buffers}
    return {"weights": result.weights, "kv": result.kv + result.state, "output": result.output,
            "compute": result.compute, "total": result.total, "output_exact": result.output_exact, "buffers": b}


def compare(case: Case, path: str, result) -> dict:
    row = {"case": case.name, "error": str(result) if isinstance(result, Exception) else None}
    meas = measured(result)
    if meas is None:
        row["error"] = row["error"] or "no breakdown"
        return row
    pred = predict(path, case)
    row["llama"], row["fit"] = meas, pred
    for key in ("weights", "kv", "compute", "total"):
        row[f"d_{key}"] = pred[key] - meas[key]
        row[f"r_{key}"] = (pred[key] - meas[key]) / meas[key] if meas[key] else 0.0
    # the output buffer is logged in MiB with two decimals: compare at that precision
    row["d_output"] = pred["output"] - meas["output"]
    row["output_ok"] = abs(row["d_output"]) <= 0.005 * MIB
    row["ok"] = (row["d_weights"] == 0 and row["d_kv"] == 0 and abs(row["r_compute"]) <= 0.05
                 and abs(row["r_total"] - row["d_output"] / meas["total"]) <= 0.02 and row["output_ok"])
    return row


def run(cases: list[Case], workdir: Path) -> list[dict]:
    by_model: dict[str, list[Case]] = {}
    for c in cases:
        by_model.setdefault(c.model, []).append(c)
    jobs = [(model_path(model, workdir), group) for model, group in by_model.items()]
    rows = []
    for (path, group), results in zip(jobs, probe(jobs)):
        rows.extend(compare(case, path, res) for case, res in zip(group, results))
    return rows


def render(rows: list[dict]) -> str:
    head = (f"{'case':<34}{'weights Δ B':>12}{'KV Δ B':>8}{'out Δ':>7}{'compute':>10}{'Δ B':>9}{'Δ %':>7}"
            f"{'total':>10}{'Δ %':>7}  ok{'resident':>10}{'mapped':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['case']:<34}  error: {r['error']}")
            continue
        m = r["llama"]
        lines.append(f"{r['case'][:33]:<34}{r['d_weights']:>12,}{r['d_kv']:>8,}{r['d_output'] / MIB:>6.2f}M"
                     f"{m['compute'] / MIB:>9.1f}M{r['d_compute']:>9,}{100 * r['r_compute']:>6.2f}%"
                     f"{m['total'] / MIB:>9.0f}M{100 * r['r_total']:>6.2f}%  {'yes' if r['ok'] else 'NO ':<3}"
                     f"{r['fit']['resident_mmap'] / MIB:>8.0f}M{r['fit']['mapped_mmap'] / MIB:>8.0f}M")
    n_ok = sum(1 for r in rows if r.get("ok"))
    lines.append(f"\n{n_ok}/{len(rows)} cases within target (weights and KV exact, compute ≤ 5 %, total ≤ 2 %)")
    lines.append("resident / mapped: fit's two figures for the same request loaded with mmap (the verdict uses "
                 "resident; mapped is llama.cpp's buffers with the file mapping whole, as RSS shows it)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the embedded model")
    ap.add_argument("--json", metavar="OUT", help="write the rows as JSON")
    ap.add_argument("--workdir", default=None, help="where skeletons are written (default: a temp dir)")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fit-accuracy-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = run(issue_cases(args.quick), workdir)
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
