"""llama.cpp's tensor buffer overrides: ``-ot/--override-tensor``, ``--cpu-moe`` and ``--n-cpu-moe``.

The flags (common/arg.cpp) all append to one list, ``tensor_buft_overrides``, of (regex, buffer type):

* ``-ot REGEX=BUFFER[,REGEX=BUFFER...]`` one entry per pair; BUFFER is the name of a device's default buffer
  type (``ggml_backend_buft_name``: ``CPU``, ``CUDA0``, ``MTL0``, ``RPC0[host:port]``...);
* ``--cpu-moe`` one entry ``\\.ffn_(up|down|gate|gate_up)_(ch|)exps`` = CPU (common.h ``LLM_FFN_EXPS_REGEX``);
* ``--n-cpu-moe N`` N entries ``blk\\.{i}\\.ffn_(up|down|gate|gate_up)_(ch|)exps`` = CPU for i = 0..N-1
  (``llm_add_n_cpu_ffn_overrides``): the experts of the *first* N layers, weights and biases alike.

The loader (llama-model-loader.cpp, ``create_tensor``'s buffer choice) takes the first entry whose regex
``std::regex_search``-es the tensor name.  An entry to CPU does not force the plain CPU buffer: the tensor's
buffer is chosen from the CPU list (CPU_REPACK where this CPU repacks its type, else CPU, mapped from the file
under mmap); any other buffer type is used as named.  This module is pure: names, patterns and matching.
"""

from __future__ import annotations

import re
from functools import lru_cache

from localinfer.errors import UsageError

EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
CPU = "CPU"


def parse_override_tensor(values, flag: str = "-ot") -> tuple[tuple[str, str], ...]:
    """``-ot`` values (a string or several) as (pattern, buffer) pairs, in order; UsageError naming the flag."""
    if isinstance(values, str):
        values = [values]
    out = []
    for value in values or ():
        for item in str(value).split(","):
            pattern, sep, buft = item.partition("=")
            if not sep or not pattern or not buft:
                raise UsageError(f"{flag} {item!r}: expected REGEX=BUFFER, e.g. 'blk\\.1[0-9]\\.ffn_.*_exps=CPU'",
                                 flag=flag)
            compiled(pattern, flag)
            out.append((pattern, buft.strip()))
    return tuple(out)


@lru_cache(maxsize=1024)
def _compile(pattern: str):
    return re.compile(pattern)


def compiled(pattern: str, flag: str = "-ot"):
    try:
        return _compile(pattern)
    except re.error as exc:
        raise UsageError(f"{flag}: {pattern!r} is not a regular expression ({exc})", flag=flag) from None


def buft_overrides(ot=(), cpu_moe: bool = False, n_cpu_moe: int = 0) -> tuple[tuple[str, str, str], ...]:
    """The list llama.cpp builds, as (pattern, buffer, flag): ``-ot`` pairs, then ``--cpu-moe``, then
    ``--n-cpu-moe``'s per-layer entries (the order ``llama_command`` prints them in)."""
    out = [(p, b, "-ot") for p, b in ot]
    if cpu_moe:
        out.append((EXPS_REGEX, CPU, "--cpu-moe"))
    out += [(f"blk\\.{i}{EXPS_REGEX}", CPU, "--n-cpu-moe") for i in range(n_cpu_moe)]
    return tuple(out)


def override_of(name: str, overrides) -> str | None:
    """The buffer the first matching entry names for tensor ``name`` (None: no entry matches)."""
    for entry in overrides:
        if _compile(entry[0]).search(name):
            return entry[1]
    return None


def check_overrides(tensor_names, overrides, buffers) -> None:
    """UsageError (one line, naming the flag) for an entry whose buffer is not one of ``buffers``, an ``-ot``
    pattern that matches no tensor, or ``--cpu-moe``/``--n-cpu-moe`` on a model without expert tensors.
    ``--n-cpu-moe`` beyond the layers that hold experts is llama.cpp's no-op and stays one."""
    names = tuple(tensor_names)
    known = tuple(buffers)
    for pattern, buft, flag in overrides:
        if buft not in known:
            raise UsageError(f"{flag}: unknown buffer type {buft!r} (this plan has {', '.join(known)})", flag=flag)
        if flag == "-ot" and not any(_compile(pattern).search(n) for n in names):
            raise UsageError(f"-ot: {pattern!r} matches no tensor of this model", flag="-ot",
                             hint="`localinfer inspect MODEL` lists the tensor names")
    moe = [f for _, _, f in overrides if f != "-ot"]
    if moe and not any(_compile(EXPS_REGEX).search(n) for n in names):
        raise UsageError(f"{moe[0]}: this model has no expert tensors (ffn_*_exps)", flag=moe[0])


def request_overrides(req) -> tuple[tuple[str, str, str], ...]:
    """:func:`buft_overrides` of a FitRequest (or LoadPlan options) with ``override_tensor``, ``cpu_moe``,
    ``n_cpu_moe``."""
    get = req.get if isinstance(req, dict) else (lambda k, d=None: getattr(req, k, d))
    return buft_overrides(tuple(get("override_tensor", ()) or ()), bool(get("cpu_moe", False)),
                          int(get("n_cpu_moe", 0) or 0))


def override_flags(ot=(), cpu_moe: bool = False, n_cpu_moe: int = 0) -> list[str]:
    """llama.cpp's command-line flags for the overrides (shell-quoted patterns)."""
    parts: list[str] = []
    if ot:
        parts += ["-ot", "'" + ",".join(f"{p}={b}" for p, b in ot).replace("'", "'\\''") + "'"]
    if cpu_moe:
        parts.append("--cpu-moe")
    if n_cpu_moe:
        parts += ["--n-cpu-moe", str(n_cpu_moe)]
    return parts
