"""Print the CMAKE_ARGS that build llama-cpp-python safely for this machine.

Why: on x86-64 Linux, llama.cpp's default GGML_NATIVE build turns on every
instruction set the compiler sees, including AMX; ggml's AMX matmul segfaults on
the first decode on some server CPUs.  A portable build (GGML_NATIVE=OFF) with
the SIMD sets this CPU really has (read from /proc/cpuinfo) and AMX off works
and costs nothing measurable.

Rules:
* macOS, or any non-x86-64 machine: print nothing (llama.cpp's defaults: Metal on
  Apple Silicon).
* CMAKE_ARGS already set by the user (e.g. -DGGML_CUDA=on): keep it, and add the
  portable CPU flags only if it does not mention GGML_NATIVE itself.
* ``--conservative``: AVX2-era flags only (the fallback if a build still crashes).
* Everywhere: llama.cpp's RPC backend (``-DGGML_RPC=ON``), which ``localinfer worker`` and
  ``--rpc`` use, unless CMAKE_ARGS already says ``GGML_RPC``.
"""

from __future__ import annotations

import os
import platform
import sys

# /proc/cpuinfo flag -> ggml CMake option
_FLAGS = [
    ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"), ("avx_vnni", "GGML_AVX_VNNI"),
    ("avx512f", "GGML_AVX512"), ("avx512_vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"),
]
_CONSERVATIVE = {"avx", "avx2", "fma", "f16c"}
_OFF = ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def portable_args(conservative: bool = False) -> list[str]:
    have = cpu_flags()
    args = ["-DGGML_NATIVE=OFF"]
    for flag, option in _FLAGS:
        on = flag in have and (not conservative or flag in _CONSERVATIVE)
        args.append(f"-D{option}={'ON' if on else 'OFF'}")
    args += [f"-D{o}=OFF" for o in _OFF]
    return args


def cmake_args(conservative: bool = False) -> str:
    user = os.environ.get("CMAKE_ARGS", "").strip()
    rpc = [] if "GGML_RPC" in user else ["-DGGML_RPC=ON"]
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return " ".join(filter(None, [user, *rpc]))
    if "GGML_NATIVE" in user:
        return " ".join(filter(None, [user, *rpc]))
    return " ".join(filter(None, [user, *portable_args(conservative), *rpc]))


if __name__ == "__main__":
    print(cmake_args(conservative="--conservative" in sys.argv[1:]))
