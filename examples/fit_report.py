"""A cross-device fit report from the Python API: which model runs where, and with how much context.

Writes header-only skeletons of a few models (no download; sparse files of
their real size), asks `localinfer.plan.fit` about every device profile, and prints
a matrix of the largest context per request (or the layers to keep on the
accelerator when the weights alone do not fit).

    python examples/fit_report.py [--ctx 8192] [--kv f16|q8_0|q4_0]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from gguf_tools.skeleton import write_skeleton
from localinfer.backends.memory import FitRequest
from localinfer.devices.profiles import all_devices
from localinfer.model.spec import ModelSpec
from localinfer.plan.fit import fit_device

MODELS = [("qwen3-8b", "bf16"), ("qwen3-8b", "q4_0"), ("llama-3.1-8b", "q8_0"), ("qwen3-235b-a22b", "q2_k")]


def cell(result, ctx: int) -> str:
    if result.fits:
        return f"ok, ≤{result.max_ctx // 1024}K" if result.max_ctx else "ok"
    if result.offload is not None:
        return f"-ngl {result.offload.gpu_layers}"
    if result.max_ctx:
        return f"ctx ≤{result.max_ctx}"
    return "no"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=8192, help="tokens per request")
    ap.add_argument("--kv", default="f16", help="KV cache type for K and V")
    args = ap.parse_args()
    devices = all_devices()
    request = FitRequest(n_ctx=args.ctx, type_k=args.kv, type_v=args.kv, flash_attn=True)
    print(f"{args.ctx} tokens, KV {args.kv}: 'ok, ≤N' fits with up to N tokens per request; "
          "'-ngl N' fits with N layers on the accelerator\n")
    width = 14
    print(f"{'model':<24}" + "".join(f"{d.name[:width - 1]:>{width}}" for d in devices))
    with tempfile.TemporaryDirectory() as tmp:
        for preset, qtype in MODELS:
            spec = ModelSpec.from_gguf(write_skeleton(preset, Path(tmp) / f"{preset}-{qtype}.gguf", type=qtype))
            row = [cell(fit_device(spec, d, request), args.ctx) for d in devices]
            print(f"{preset + ' ' + qtype:<24}" + "".join(f"{c:>{width}}" for c in row))


if __name__ == "__main__":
    main()
