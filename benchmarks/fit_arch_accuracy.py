"""Is `localinfer fit` exact for every architecture family?  Each term beside llama.cpp's own dry run.

Two sets of files, both planned by llama.cpp itself (``localinfer.backends.llamacpp.dryrun``: ``no_alloc``, so
nothing is read and header-only files work, one context per case):

* a tiny random-weight model of every family (tests/support/tiny_archs.py: MLA with and without q_lora and in the
  legacy layout, NextN, chunked and sliding windows, gated delta-net, Mamba-2, short-conv, pure Mamba-2), at 1 and
  4 sequences, 512 to 16K tokens, flash attention on and off, f16 and q8_0 KV;
* a real-size skeleton of every architecture preset at 32K (1 sequence, f16 and q8_0; 4 × 8K with FA off).

For each case fit's weights, KV, recurrent state, compute and output are printed against llama.cpp's.  KV + state
is exact in llama.cpp's report (one buffer); the state alone is checked to the log's two decimals of MiB where
both share a buffer.  ``--before DIR`` also asks another checkout (e.g. the commit before a change) for its
prediction of the same cases, in a subprocess, and prints its KV ratio or why it refused the file.

    python benchmarks/fit_arch_accuracy.py [--quick] [--before /path/to/old/checkout] [--json OUT]

Targets: weights, KV, recurrent state and output to the byte; compute within 1 %.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
PRESETS = ("deepseek-v3", "kimi-k2", "deepseek-v2-lite", "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b",
           "qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b", "glm-4.5-air", "llama-4-scout-17b-16e",
           "granite-4.0-h-small", "nemotron-nano-9b-v2", "lfm2-1.2b", "mamba2-2.7b", "gemma-3-27b")


@dataclass(frozen=True)
class Case:
    n_ctx: int
    n_seq: int = 1
    flash_attn: bool = True
    kv: str = "f16"

    @property
    def name(self) -> str:
        ctx = f"{self.n_ctx // 1024}K" if self.n_ctx % 1024 == 0 else str(self.n_ctx)
        kv = self.kv if self.flash_attn or self.kv == "f16" else f"{self.kv}/f16"
        return f"{ctx}×{self.n_seq} fa={'on' if self.flash_attn else 'off'} {kv}"

    def request(self):
        from localinfer.backends.memory import FitRequest

        return FitRequest(n_ctx=self.n_ctx, n_seq=self.n_seq, flash_attn=self.flash_attn, type_k=self.kv,
                          type_v=self.kv if self.flash_attn else "f16", mmap=False)   # a quantized V needs FA


TINY_CASES = (Case(512), Case(2048, 4, False), Case(4096, 4, True, "q8_0"), Case(16384, 1, False, "q8_0"))
PRESET_CASES = (Case(32768), Case(32768, kv="q8_0"), Case(8192, 4, False))


def files(workdir: Path, quick: bool) -> list[tuple[str, str, tuple[Case, ...]]]:
    """(label, path, cases) of every tiny model and preset skeleton, written into workdir once."""
    sys.path.insert(0, str(ROOT))
    from gguf_tools.skeleton import write_skeleton
    from tests.support.ggufgen import write_tiny_arch
    from tests.support.tiny_archs import TINY

    out = []
    for name, spec in TINY.items():
        path = workdir / f"tiny-{name}.gguf"
        if not path.exists():
            write_tiny_arch(path, {**spec, "context_length": 32768}, seed=1)
        out.append((f"tiny {name}", str(path), TINY_CASES[:2] if quick else TINY_CASES))
    for preset in () if quick else PRESETS:
        path = workdir / f"{preset}.gguf"
        if not path.exists():
            write_skeleton(preset, path)
        out.append((preset, str(path), PRESET_CASES))
    return out


def predict(path: str, case: Case) -> dict:
    """fit's terms for this machine (dry runs load without mmap), or the one-line refusal fit gives."""
    from localinfer.backends.llamacpp.memory import breakdown
    from localinfer.devices.profiles import local_device
    from localinfer.errors import UsageError
    from localinfer.model.spec import ModelSpec

    try:
        bd, _ = breakdown(ModelSpec.from_gguf(path), local_device(), case.request())
    except UsageError as exc:
        return {"refused": f"{exc.message} ({exc.flag})"}
    return {"weights": bd.weights, "kv": bd.kv, "state": bd.sum("state"), "compute": bd.compute, "output": bd.output}


_BEFORE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from localinfer.backends.llamacpp.memory import breakdown
    from localinfer.backends.memory import FitRequest
    from localinfer.devices.profiles import local_device
    from localinfer.model.spec import ModelSpec
    out = []
    for path, c in json.loads(sys.stdin.read()):
        try:
            bd, _ = breakdown(ModelSpec.from_gguf(path), local_device(), FitRequest(n_ctx=c[0], n_seq=c[1],
                              flash_attn=c[2], type_k=c[3], type_v=c[4], mmap=False))
            out.append({"weights": bd.weights, "kv": bd.kv, "state": bd.sum("state"), "compute": bd.compute})
        except Exception as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}"[:160]})
    print(json.dumps(out))
""")


def predict_before(tree: str, items: list[tuple[str, Case]]) -> list[dict]:
    """The other checkout's predictions of the same cases (its own code, in a subprocess run from its folder)."""
    payload = json.dumps([(p, [c.n_ctx, c.n_seq, c.flash_attn, c.kv, c.request().type_v]) for p, c in items])
    proc = subprocess.run([sys.executable, "-c", _BEFORE, tree], input=payload, capture_output=True, text=True,
                          cwd=tree, timeout=900, check=False)
    if proc.returncode:
        return [{"error": proc.stderr.strip().splitlines()[-1][:160]}] * len(items)
    return json.loads(proc.stdout)


def measure(entries) -> list[list]:
    from localinfer.backends.llamacpp.dryrun import DryRunJob, DryRunRequest, run_jobs

    jobs = [DryRunJob(path, tuple(DryRunRequest.from_fit(c.request()) for c in cases)) for _, path, cases in entries]
    return run_jobs(jobs, timeout=1800)


def compare(pred: dict, res) -> dict:
    from localinfer.errors import DryRunError

    if isinstance(res, DryRunError) or "refused" in pred:
        both = isinstance(res, DryRunError) and res.reason == "context" and "refused" in pred
        llama = res.refusal if isinstance(res, DryRunError) else "planned it"
        return {"refused_both": both, "error": None if both else f"llama.cpp: {llama}; fit: {pred.get('refused', 'planned it')}",
                "note": f"both refuse: {llama}" if both else ""}
    llama = {"weights": sum(b.weights for b in res.buffers), "kv": sum(b.kv for b in res.buffers),
             "state": sum(b.state for b in res.buffers), "compute": sum(b.compute for b in res.buffers),
             "output": res.output}
    d = {k: pred[k] - llama[k] for k in ("weights", "compute")}
    d["kv_state"] = pred["kv"] + pred["state"] - llama["kv"] - llama["state"]
    d["state"] = pred["state"] - llama["state"]
    d["output"] = pred["output"] - llama["output"]
    ok = (d["weights"] == 0 and d["kv_state"] == 0 and abs(d["output"]) <= 0.005 * MIB + 1
          and (res.exact_split and d["state"] == 0 or abs(d["state"]) <= 0.005 * MIB + 1))
    return {"llama": llama, "fit": pred, "delta": d, "exact": ok,
            "compute_ratio": pred["compute"] / llama["compute"] if llama["compute"] else 1.0}


def render(rows: list[dict], before: bool) -> str:
    head = (f"{'model':<30}{'case':<20}{'weights Δ':>10}{'KV+state Δ':>11}{'KV+state MiB':>13}{'state MiB':>10}"
            f"{'compute':>9}  exact" + ("   before: KV+state ratio, weights Δ" if before else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("refused_both"):
            lines.append(f"{r['model'][:29]:<30}{r['case']:<20}  both refuse: {r['note'][13:93]}")
            continue
        if r.get("error"):
            lines.append(f"{r['model'][:29]:<30}{r['case']:<20}  error: {r['error'][:80]}")
            continue
        m, d = r["llama"], r["delta"]
        line = (f"{r['model'][:29]:<30}{r['case']:<20}{d['weights']:>10,}{d['kv_state']:>11,}"
                f"{(m['kv'] + m['state']) / MIB:>13.1f}{m['state'] / MIB:>10.2f}{r['compute_ratio']:>9.3f}  "
                f"{'yes' if r['exact'] else 'NO '}")
        if before:
            b = r.get("before") or {}
            if "error" in b:
                line += f"   refused: {b['error'][:60]}"
            else:
                total, dw = m["kv"] + m["state"], b["weights"] - m["weights"]
                line += f"   {(b['kv'] + b.get('state', 0)) / total if total else 1.0:.2f}×"
                line += f", weights {dw / MIB:+,.1f} MiB" if dw else ""
        lines.append(line)
    ok = [r for r in rows if not r.get("error") and not r.get("refused_both")]
    n_exact = sum(r["exact"] for r in ok) + sum(bool(r.get("refused_both")) for r in rows)
    within = sum(abs(r["compute_ratio"] - 1) <= 0.01 for r in ok)
    lines.append(f"\n{n_exact}/{len(rows)} cases exact (weights, KV + state, state, output) or refused by both; "
                 f"compute within 1 % in {within}/{len(ok)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny models only, two cases each")
    ap.add_argument("--before", metavar="DIR", help="also the predictions of the checkout in DIR")
    ap.add_argument("--json", metavar="OUT", help="write the rows as JSON")
    ap.add_argument("--workdir", default=None, help="where the files are written (default: a temp dir)")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fit-archs-"))
    workdir.mkdir(parents=True, exist_ok=True)
    entries = files(workdir, args.quick)
    results = measure(entries)
    rows, items = [], []
    for (label, path, cases), res in zip(entries, results):
        for case, r in zip(cases, res):
            rows.append({"model": label, "case": case.name, **compare(predict(path, case), r)})
            items.append((path, case))
    if args.before:
        for row, b in zip(rows, predict_before(str(Path(args.before).resolve()), items)):
            row["before"] = b
    print(render(rows, bool(args.before)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("exact") or r.get("refused_both") for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
