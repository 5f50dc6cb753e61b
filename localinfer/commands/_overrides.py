"""llama.cpp's tensor buffer override flags, shared by `fit` and by `run`, `chat`, `bench`, `serve`.

``-ot/--override-tensor REGEX=BUFFER[,...]`` (repeatable), ``-cmoe/--cpu-moe`` and ``-ncmoe/--n-cpu-moe N``,
spelled as llama.cpp's common/arg.cpp spells them; their meaning is :mod:`localinfer.backends.llamacpp.overrides`.
"""

from __future__ import annotations

import argparse

from localinfer.errors import UsageError


def add_override_args(g) -> None:
    g.add_argument("-ot", "--override-tensor", dest="override_tensor", action="append", default=None,
                   metavar="REGEX=BUFFER,...",
                   help="llama.cpp: put tensors whose name matches REGEX in BUFFER (CPU, CUDA0, an RPC device's "
                        "name); the first matching entry wins")
    g.add_argument("-cmoe", "--cpu-moe", dest="cpu_moe", action="store_true", default=None,
                   help="llama.cpp: every layer's MoE expert weights in host memory")
    g.add_argument("-ncmoe", "--n-cpu-moe", dest="n_cpu_moe", type=int, default=None, metavar="N",
                   help="llama.cpp: the MoE expert weights of the first N layers in host memory")


def override_fields(args: argparse.Namespace) -> dict:
    """FitRequest fields / LoadPlan options for the flags given ({} without them)."""
    from localinfer.backends.llamacpp.overrides import parse_override_tensor

    out: dict = {}
    if getattr(args, "override_tensor", None):
        out["override_tensor"] = parse_override_tensor(args.override_tensor, "-ot")
    if getattr(args, "cpu_moe", None):
        out["cpu_moe"] = True
    n = getattr(args, "n_cpu_moe", None)
    if n is not None:
        if n < 0:
            raise UsageError(f"--n-cpu-moe must be a layer count >= 0, got {n}", flag="--n-cpu-moe")
        if n:
            out["n_cpu_moe"] = n
    backend = getattr(args, "backend", None) or "llama.cpp"
    if out and backend not in ("llama.cpp", "llamacpp", "llama_cpp", "cpp"):
        flag = "-ot" if "override_tensor" in out else "--cpu-moe" if "cpu_moe" in out else "--n-cpu-moe"
        raise UsageError(f"{flag} places tensors in llama.cpp's buffers", flag=flag, hint="drop --backend")
    return out
