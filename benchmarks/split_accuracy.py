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
    from gguf import GGMLQuantizationType

    from gguf_tools.skeleton import write_skeleton
    from localinfer.model.sources import resolve_model
    from tests.support.ggufgen import write_tiny_model

    moe = write_skeleton({"n_layers": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 0,
                          "vocab_size": 1000, "context_length": 4096, "arch": "qwen3moe", "n_expert": 8,
                          "n_expert_used": 2, "expert_ff": 128, "type": "f16"}, d / "moe.gguf")
    untied = write_tiny_model(d / "untied.gguf", arch="qwen3", n_layers=6, qtype=GGMLQuantizationType.Q8_0)
    from tests.backends.test_rpc_split import MORE
    from tests.plan.test_fit_llamacpp import write_tiny_gemma3

    qwen2 = write_tiny_model(d / "qwen2.gguf", arch="qwen2", n_layers=4, qtype=GGMLQuantizationType.Q8_0)
    rope = write_tiny_model(d / "rope.gguf", arch="llama", n_layers=4, qtype=GGMLQuantizationType.Q4_0,
                            rope_freqs=True, tied=True)
    small = CASES[:2] + [{"n_ctx": 512, "n_gpu_layers": 3}]
    return {"smollm2-135m q4_1": (str(resolve_model(None)), CASES + MORE["smollm2"]),
            "qwen3moe 4L f16 (skeleton)": (str(moe), small), "qwen3 6L q8_0 untied": (str(untied), small),
            "qwen2 4L q8_0 (biases)": (str(qwen2), MORE["qwen2-bias"]),
            "llama 4L q4_0 rope_freqs tied": (str(rope), MORE["llama-rope-freqs-tied"]),
            "gemma3 8L f32 iSWA (skeleton)": (str(write_tiny_gemma3(d / "gemma3.gguf")), MORE["gemma3-iswa"])}


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
