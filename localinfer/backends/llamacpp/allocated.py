"""What llama.cpp allocated on each device, beside fit's prediction (``run --json``'s ``devices``, serve's
``/metrics`` and ``/v1/engine/state``).

llama.cpp logs every buffer it allocates as ``<buffer> model|KV|compute buffer size = X MiB`` (two decimals:
within 0.005 MiB of the bytes).  A device's buffers are grouped under its name: ``CPU_Mapped``, ``CPU_REPACK``,
``CPU`` and ``CUDA_Host`` are host memory, ``CPU``; ``RPC0[10.0.0.2:50052]`` is a worker's device, ``CUDA0`` a
GPU.  A row per device: ``{"device", "predicted": {"weights", "kv", "compute"}, "reported": {...}}`` (bytes),
and for a split the layers it holds and whether it holds the output layer.
"""

from __future__ import annotations

import re

from localinfer.backends.memory import MemoryBreakdown
from localinfer.backends.split import SplitBreakdown

KINDS = ("weights", "kv", "state", "compute")     # state: a hybrid's recurrent state ("RS buffer")
HOST = "CPU"
_BUF = re.compile(r"(\S+) (model|KV|RS|compute) buffer size\s*=\s*([0-9]+(?:\.[0-9]+)?) MiB")
_KIND = {"model": "weights", "KV": "kv", "RS": "state", "compute": "compute"}


def buffer_device(name: str) -> str:
    """The device a llama.cpp buffer (type) name belongs to: ``CPU_Mapped`` -> ``CPU``, ``RPC0[h:p]`` itself."""
    if "[" in name:
        return name
    if name.endswith("_Host"):
        return HOST
    return name.split("_", 1)[0]


def reported_by_buffer(lines) -> dict[str, dict[str, int]]:
    """Buffer sizes llama.cpp logged while loading, per buffer name ("RPC0[host:port]", "CPU_Mapped", "CPU"):
    weights, kv, compute in bytes.  A compute buffer is logged again when re-reserved; the last figure stands."""
    out: dict[str, dict[str, int]] = {}
    for line in lines:
        for name, kind, mib in _BUF.findall(line):
            entry = out.setdefault(name, dict.fromkeys(KINDS, 0))
            value = round(float(mib) * (1 << 20))
            entry[_KIND[kind]] = value if kind == "compute" else entry[_KIND[kind]] + value
    return out


def predicted_split(sb: SplitBreakdown) -> list[dict]:
    """A row per device of the split, then the host's (input layer, layers left on the CPU, its compute buffer)."""
    rows = [{"device": d.name, "layers": list(d.layers), "output": d.output,
             "predicted": {"weights": d.weights, "kv": d.kv, "state": 0, "compute": d.compute}} for d in sb.devices]
    rows.append({"device": HOST, "predicted": {"weights": sum(sb.host_weights.values()), "kv": sb.host_kv,
                                               "state": 0, "compute": sb.host_compute}})
    return rows


def predicted_terms(bd: MemoryBreakdown) -> list[dict]:
    """A row per device of one device's breakdown (the accelerator, then the host; a CPU alone is one row), with
    each buffer as llama.cpp prints it (a host mapping whole)."""
    rows: dict[str, dict[str, int]] = {}
    for t in bd.terms:
        if t.buffer is None or t.key not in KINDS:
            continue
        row = rows.setdefault(buffer_device(t.buffer.rsplit(" ", 1)[0]), dict.fromkeys(KINDS, 0))
        row[t.key] += t.bytes if t.reported is None else t.reported
    return [{"device": name, "predicted": kinds} for name, kinds in rows.items()]


def with_reported(rows: list[dict], lines) -> list[dict]:
    """``rows`` with what llama.cpp's log says each device got (zeros where it logged nothing), and a row with
    no prediction for a device it logged that was not predicted."""
    reported: dict[str, dict[str, int]] = {}
    for name, kinds in reported_by_buffer(lines).items():
        entry = reported.setdefault(buffer_device(name), dict.fromkeys(KINDS, 0))
        for k in KINDS:
            entry[k] += kinds[k]
    out = [{**r, "reported": reported.pop(r["device"], dict.fromkeys(KINDS, 0))} for r in rows]
    return out + [{"device": name, "predicted": None, "reported": kinds} for name, kinds in reported.items()]
