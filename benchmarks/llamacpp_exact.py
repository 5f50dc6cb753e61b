"""Does the torch backend's ``llamacpp_rounding`` give llama.cpp's logits to the bit on a long prompt?

A --prompt-token prompt goes through both engines with the same context,
threads and batch size (long enough that llama.cpp takes its tiled attention
kernel for the prefill chunks and, past a 512-cell KV view, the split-KV decode
kernel when it has more than one thread), then --steps greedy decode steps
follow llama.cpp's tokens.  Prints, per step, whether the logits are equal and
the largest difference.  ``--all-rows`` asks for logits at every prompt position
in the one eval (the llama.cpp backend then runs llama_decode calls of 64 output
rows, the last one short: the one-row attention kernel) and reports how many
rows differ and the first; ``--generated`` adds the random-weight models of
tests/cuda_backend/test_torch_llamacpp_exact_models.py (several shapes and
weight types).  The short cases are in tests/cuda_backend/test_torch_llamacpp_exact*.py.

The emulation follows llama.cpp's x86 AVX2 kernels; on an AVX-512 machine, run
it against an AVX2-only build of the vendored llama.cpp:

    LLAMA_CPP_LIB_PATH=/path/to/build/bin python benchmarks/llamacpp_exact.py [MODEL ...]
        [--prompt 600] [--threads 2] [--steps 8] [--ctx 1024] [--all-rows] [--generated]
        [--json OUT [--append] [--note TEXT]]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from localinfer.model.sources import resolve_model

TEXT = "The quick brown fox jumps over the lazy dog near the river bank while the old miller watches. "


def machine() -> dict:
    """The CPU, and the llama.cpp library the run loaded (which kernels it has)."""
    import llama_cpp

    from cuda_backend import ggml_numerics

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    flags = set()
    if Path("/proc/cpuinfo").exists():
        flags = set(next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("flags")), []))
    lib = getattr(getattr(llama_cpp.llama_cpp, "_lib", None), "_name", None)
    try:
        code = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=False).stdout.strip()
    except OSError:
        code = ""
    return {"cpu": cpu, "cpu_has_avx512f": "avx512f" in flags, "cpus": os.cpu_count(), "platform": platform.platform(),
            "llama_cpp_python": getattr(llama_cpp, "__version__", "?"), "lib": lib,
            "LLAMA_CPP_LIB_PATH": os.environ.get("LLAMA_CPP_LIB_PATH"),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            "kernel_mismatch": ggml_numerics.kernel_mismatch(), "commit": code}


def compare(model: str, *, prompt: int, threads: int, steps: int, ctx: int, all_rows: bool) -> dict:
    kw = {"n_ctx": ctx, "n_threads": threads, "flash_attn": True}
    ours = load_engine(LoadPlan(model, options={"quiet": True, "llamacpp_rounding": True}, **kw), "torch")
    ref = load_engine(LoadPlan(model, options={"quiet": True}, **kw), "llama.cpp")
    with ours, ref:
        ids = ref.tokenize(TEXT * (prompt // 10 + 1))[:prompt]
        at = list(range(len(ids))) if all_rows else [len(ids) - 1]
        t0 = time.perf_counter()
        a = ours.eval(ids, logits_at=at)
        prefill_s = time.perf_counter() - t0
        b = ref.eval(ids, logits_at=at)
        diff = np.abs(a - b).max(-1)
        bad = np.nonzero(diff)[0]
        rows = [{"step": "prefill", "kv_len": len(ids), "logit_rows": len(at), "equal": not len(bad),
                 "rows_differing": len(bad), "first_differing_row": at[bad[0]] if len(bad) else None,
                 "max_abs_diff": float(diff.max())}]
        token = int(b[-1].argmax())
        for i in range(steps):
            a, b = ours.eval([token])[0], ref.eval([token])[0]
            rows.append({"step": i, "kv_len": ref.kv_len(), "equal": bool(np.array_equal(a, b)),
                         "max_abs_diff": float(np.abs(a - b).max())})
            token = int(b.argmax())
    return {"model": model, "prompt_tokens": len(ids), "threads": threads, "ctx": ctx, "all_rows": all_rows,
            "rows": rows, "emulated_prefill_s": round(prefill_s, 2)}


def generated(root: Path) -> dict[str, str]:
    from tests.cuda_backend.test_torch_llamacpp_exact_models import SHAPES
    from tests.support.ggufgen import write_tiny_model

    return {name: str(write_tiny_model(root / f"{name}.gguf", ctx=4096, seed=i, **kw))
            for i, (name, kw) in enumerate(SHAPES.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="*", help="GGUF files (default: the embedded model, unless --generated alone)")
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--all-rows", action="store_true", help="logits at every prompt position, all compared")
    ap.add_argument("--generated", action="store_true", help="also the test suite's random-weight models")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--append", action="store_true", help="add this run's results to those already in --json")
    ap.add_argument("--note", default="", help="recorded with the machine (e.g. how the llama.cpp library was built)")
    args = ap.parse_args()
    models = {Path(m).stem if m else "default": str(resolve_model(m or None)) for m in args.model}
    if not models and not args.generated:
        models["default"] = str(resolve_model(None))
    with tempfile.TemporaryDirectory() as tmp:
        if args.generated:
            models.update(generated(Path(tmp)))
        runs = []
        for name, path in models.items():
            run = compare(path, prompt=args.prompt, threads=args.threads, steps=args.steps, ctx=args.ctx,
                          all_rows=args.all_rows)
            run["name"] = name
            runs.append(run)
            pre = run["rows"][0]
            decode_equal = sum(r["equal"] for r in run["rows"][1:])
            verdict = ("equal" if pre["equal"] else f"{pre['rows_differing']} differ (first "
                       f"{pre['first_differing_row']}, max |d| {pre['max_abs_diff']:.3g})")
            print(f"{name}: prefill {run['prompt_tokens']} tokens, {pre['logit_rows']} row(s) {verdict}; "
                  f"decode {decode_equal}/{args.steps} equal; emulated prefill {run['emulated_prefill_s']:.0f} s",
                  flush=True)
    equal = sum(r["equal"] for run in runs for r in run["rows"])
    total = sum(len(run["rows"]) for run in runs)
    print(f"{equal}/{total} steps equal to the bit ({args.threads} thread(s), context {args.ctx})")
    if args.json:
        out = Path(args.json)
        record = {"machine": {**machine(), "note": args.note}, "invocations": [], "runs": []}
        if args.append and out.exists():
            record = json.loads(out.read_text())
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "append", "note")}
        record["invocations"].append(settings)
        record["runs"] += [{**run, "model": os.path.basename(run["model"])} for run in runs]
        out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
