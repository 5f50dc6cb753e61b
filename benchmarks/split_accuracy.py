"""How exact is `fit` across devices?  Predicted vs llama.cpp's bytes per device over two loopback workers.

For each model and split, llama.cpp loads the model across two `localinfer worker`s (1 thread each, in a
subprocess) and reports its buffers per buffer type (``llama_get_memory_breakdown``: model, KV, compute);
fit predicts the same from the GGUF header and the workers' free memory.  Prints one row per device and
the largest difference.

    python benchmarks/split_accuracy.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [
    {"n_ctx": 512},
    {"n_ctx": 1024, "tensor_split": [1, 3]},
    {"n_ctx": 768, "tensor_split": [5, 1]},
    {"n_ctx": 512, "n_gpu_layers": 20},
    {"n_ctx": 1024, "n_seq": 2, "n_ubatch": 128, "n_batch": 256},
]


def models(d: Path) -> dict[str, tuple[str, list[dict]]]:
    from tests.backends.test_rpc_split import MORE, write_split_models

    m = write_split_models(d)
    small = CASES[:2] + [{"n_ctx": 512, "n_gpu_layers": 3}]
    return {"smollm2-135m q4_1": (m["smollm2"], CASES + MORE["smollm2"]),
            "qwen3moe 4L f16 (skeleton)": (m["qwen3moe"], small), "qwen3 6L q8_0 untied": (m["qwen3-untied"], small),
            "qwen2 4L q8_0 (biases)": (m["qwen2-bias"], MORE["qwen2-bias"]),
            "llama 4L q4_0 rope_freqs tied": (m["llama-rope-freqs-tied"], MORE["llama-rope-freqs-tied"]),
            "gemma3 8L f32 iSWA (skeleton)": (m["gemma3-iswa"], MORE["gemma3-iswa"])}

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tests.backends.test_rpc_split import _predict
    from tests.support.rpc_workers import reported, workers

    rows, worst = [], 0
    with tempfile.TemporaryDirectory() as tmp, workers(2) as ws:
        eps = [ep for _, ep in ws]
        for name, (path, cases) in models(Path(tmp)).items():
            for case, got in zip(cases, reported(path, eps, cases)):
                sb = _predict(path, eps, case)
                for i, d in enumerate(sb.devices):
                    m, kv, c = got["buffers"].get(d.name, [0, 0, 0])
                    diff = max(abs(d.weights - m), abs(d.kv - kv), abs(d.compute - c))
                    worst = max(worst, diff)
                    rows.append({"model": name, "case": case, "device": f"worker {i + 1}", "layers": len(d.layers),
                                 "output": d.output, "predicted": [d.weights, d.kv, d.compute],
                                 "reported": [m, kv, c], "max_diff": diff})
                host = [sum(v[k] for n, v in got["buffers"].items() if not n.startswith("RPC")) for k in range(3)]
                pred = [sum(sb.host_weights.values()), sb.host_kv, sb.host_compute]
                diff = max(abs(a - b) for a, b in zip(pred, host))
                worst = max(worst, diff)
                rows.append({"model": name, "case": case, "device": "host", "predicted": pred, "reported": host,
                             "max_diff": diff})
    for r in rows:
        print(f"{r['model']:<28} {json.dumps(r['case']):<52} {r['device']:<9} predicted {r['predicted']} "
              f"reported {r['reported']} diff {r['max_diff']}")
    print(f"largest difference: {worst} bytes over {len(rows)} device rows")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "max_diff": worst}, indent=1) + "\n")
    return 0 if worst == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
