"""Host profiles: the system RAM, its bandwidth and the CPU cores on the host side of a split.

When experts (``--n-cpu-moe``) or whole layers (``-ngl``) live in system RAM, the verdict needs the
host's usable memory and the speed model its bandwidth.  Facts live in ``profiles/hosts/*.toml``
(``name``, ``memory``, ``reserve``, ``bandwidth``, ``cores``, ``fp32_flops``, ``decode_mbu``, optionally
``decode_flops_per_core``, and a ``[sources]`` table citing each one), shipped as ``localinfer.profiles/hosts``.
A device profile names its default host with ``host = "NAME"``; ``fit --host NAME`` picks another.

``local_host()`` describes this machine: RAM and cores through psutil; its bandwidth is not
probed, so a conservative default (:data:`LOCAL_BANDWIDTH`) stands in and its source says so.
On unified memory (Apple silicon) the host is the device itself: :func:`unified_host`.

A decode step's host part reads the host's weights at ``bandwidth × decode_mbu`` and computes them at
``cores × decode_flops_per_core``, whichever takes longer: llama.cpp's CPU kernels dequantise every weight inside
the dot product, one thread a core, so a host with few cores for its channels (a 24-core Threadripper on eight
DDR5 channels, a 32-core EPYC on twelve) is bound by the cores, not by the RAM.  :data:`DECODE_FLOPS_PER_CORE`
is fitted on published expert-offload runs (``benchmarks/offload_published.py --fit``).

On a host of several sockets (``sockets = 2``; ``bandwidth`` is all of them) llama.cpp's threads span the NUMA
nodes while each page of weights sits in one node's memory, so half the reads cross the socket link: a decode reads
at :data:`NUMA_SHARE` of ONE socket's rate, not at the sum (a Xeon Platinum 8480+ went from about 40 to 27 tok/s
when a second socket and its eight DIMMs were added, ``--numa distribute``, and back to 40 bound to one node; its
host part, the GPU's taken out, read at 0.53 of one socket's rate: :data:`NUMA_SOURCE`).  Bind llama.cpp to one
node (``numactl --cpunodebind=0 --membind=0``) to get one socket's rate; ``sockets = 1`` describes that run.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType

from localinfer.errors import UsageError

LOCAL_NAME = "local"
LOCAL_BANDWIDTH = 40e9      # bytes/s: below a DDR4-3200 dual-channel desktop's 51.2 GB/s theoretical
LOCAL_RESERVE = "10%"
# the share of a host's theoretical RAM bandwidth llama.cpp's CPU expert kernels read at, where a host profile has no
# measurement of its own: fitted (benchmarks/offload_published.py --fit) on 12 published expert-offload decode runs
# on 5 machines (Ryzen desktops, a Threadripper, an EPYC, a two-socket Xeon at NUMA_SHARE); each machine left out in
# turn is predicted within 25% by the others' fit (MBU 0.48-0.53) on 11 of the 12 runs
FALLBACK_MBU = 0.5
MBU_SOURCE = ("fitted: llama.cpp's CPU kernels read host RAM at about 50% of theoretical bandwidth across 12 published "
              "expert-offload runs on 5 machines; leaving each machine out, the others' fit (0.48-0.53) predicts 11 "
              "of the 12 runs within 25% (benchmarks/offload_published.py --fit, "
              "benchmarks/results/offload_published.txt)")
FALLBACK_EFFICIENCY = 0.5   # of fp32_flops, for the host's share of a prefill (batched: GEMM-like)
# FLOP/s one core's llama.cpp CPU kernels reach on the routed experts' matrix-vector products at batch 1 (quantized
# weights dequantised in the dot product).  Fitted (benchmarks/offload_published.py --fit) on published expert-offload
# decode runs: a Threadripper PRO 7965WX (24 threads, Zen 4) with DeepSeek-R1 UD-Q2_K_XL and an EPYC 9355 (30-32
# threads, Zen 5) with DeepSeek-V3 UD-Q4_K_XL each give 29e9 on their own.
DECODE_FLOPS_PER_CORE = 29e9
# a decode on S > 1 sockets, threads and pages spread over the nodes, reads at this share of one socket's bandwidth
NUMA_SHARE = 0.53
NUMA_SOURCE = ("measured: one Xeon Platinum 8480+ with an RTX 3090 decoded Llama-4-Maverick UD-IQ4_XS, every routed "
               "expert in RAM, at ~40 tok/s; two sockets (16 DIMMs) with --numa distribute at ~27; bound to one node "
               "(numactl --membind=0) at 40 again (https://github.com/ikawrakow/ik_llama.cpp/discussions/396).  Less "
               "the GPU part of a step localinfer predicts for that plan (11.5 ms), the host's share reads at "
               "(1/40 - g)/(1/27 - g) = 0.53 of one socket's rate (benchmarks/offload_published.py --fit prints it)")
DECODE_FLOPS_SOURCE = ("fitted: llama.cpp's CPU expert kernels at batch 1 reach about 29 GFLOP/s a core "
                       "(benchmarks/offload_published.py --fit: a Threadripper PRO 7965WX with DeepSeek-R1 UD-Q2_K_XL "
                       "and an EPYC 9355 with DeepSeek-V3 UD-Q4_K_XL give 29 each; "
                       "https://github.com/ikawrakow/ik_llama.cpp/discussions/258)")


@dataclass(frozen=True)
class HostProfile:
    """A host's RAM and CPU.  Bytes are integers; rates per second."""

    name: str
    display_name: str
    memory_bytes: int
    reserve: str
    bandwidth_bytes_per_s: float
    cores: int
    fp32_flops: float | None = None
    decode_mbu: float = FALLBACK_MBU
    decode_flops_per_core: float = DECODE_FLOPS_PER_CORE
    unified: bool = False                  # the host is the accelerator's own memory
    sockets: int = 1                       # CPU sockets (NUMA nodes) the bandwidth and cores are spread over
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    origin: str = "built-in"

    @property
    def reserve_bytes(self) -> int:
        from localinfer.devices.profiles import reserve_bytes

        return reserve_bytes(self.reserve, self.memory_bytes)

    @property
    def usable_bytes(self) -> int:
        return max(0, self.memory_bytes - self.reserve_bytes)

    @property
    def effective_bandwidth(self) -> float:
        """β_host · MBU: what reading weights from RAM achieves; on several sockets one socket's share of β times
        :data:`NUMA_SHARE` (see the module)."""
        if self.sockets > 1:
            return self.bandwidth_bytes_per_s / self.sockets * NUMA_SHARE * self.decode_mbu
        return self.bandwidth_bytes_per_s * self.decode_mbu

    @property
    def effective_flops(self) -> float | None:
        """What a batched host computation (a prefill's share) reaches: ``fp32_flops`` × 0.5."""
        return self.fp32_flops * FALLBACK_EFFICIENCY if self.fp32_flops else None

    @property
    def decode_flops(self) -> float:
        """What a decode step's host part computes at: ``cores`` × ``decode_flops_per_core`` (one thread a core)."""
        return self.cores * self.decode_flops_per_core

    @property
    def computes(self) -> bool:
        """Whether the profile gives the host a rate to compute with (cores or FLOP/s); a unified-memory profile
        (the accelerator's own memory) may give neither."""
        return bool(self.decode_flops or self.effective_flops)

    def source(self, key: str) -> str:
        if key == "decode_flops_per_core" and key not in self.sources:
            return DECODE_FLOPS_SOURCE
        if key == "sockets" and self.sockets > 1 and key not in self.sources:
            return NUMA_SOURCE
        if key == "decode_mbu" and key not in self.sources and self.decode_mbu == FALLBACK_MBU:
            return MBU_SOURCE
        return self.sources.get(key, "")

    def to_dict(self) -> dict:
        return {"name": self.name, "display_name": self.display_name, "memory_bytes": self.memory_bytes,
                "reserve": self.reserve, "usable_bytes": self.usable_bytes,
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "cores": self.cores,
                "fp32_flops": self.fp32_flops, "decode_mbu": self.decode_mbu,
                "decode_flops_per_core": self.decode_flops_per_core, "unified": self.unified, "sockets": self.sockets,
                "sources": {"decode_flops_per_core": DECODE_FLOPS_SOURCE,
                            **({"sockets": NUMA_SOURCE} if self.sockets > 1 else {}), **self.sources},
                "origin": self.origin}


def _parse(data: dict, origin: str) -> HostProfile:
    from localinfer.devices.profiles import _bad, _rate, _size

    known = {"name", "display_name", "memory", "reserve", "bandwidth", "cores", "fp32_flops", "decode_mbu",
             "decode_flops_per_core", "sockets", "sources"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise _bad(origin, unknown[0], f"unknown key; known keys: {', '.join(sorted(known))}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(origin, "name", "required")
    cores = data.get("cores")
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise _bad(origin, "cores", "required: a whole number of CPU cores")
    bandwidth = _rate(data, "bandwidth", origin)
    if bandwidth is None:
        raise _bad(origin, "bandwidth", "required: e.g. \"89.6GB/s\"")
    mbu = data.get("decode_mbu", FALLBACK_MBU)
    if isinstance(mbu, bool) or not isinstance(mbu, (int, float)) or not 0 < mbu <= 1:
        raise _bad(origin, "decode_mbu", "must be a fraction in (0, 1]")
    sockets = data.get("sockets", 1)
    if isinstance(sockets, bool) or not isinstance(sockets, int) or not 1 <= sockets <= 8:
        raise _bad(origin, "sockets", "must be a whole number of CPU sockets, 1 to 8")
    per_core = data.get("decode_flops_per_core", DECODE_FLOPS_PER_CORE)
    if isinstance(per_core, bool) or not isinstance(per_core, (int, float)) or not per_core > 0:
        raise _bad(origin, "decode_flops_per_core", "must be a positive rate, e.g. 29e9")
    return HostProfile(name=name, display_name=str(data.get("display_name") or name),
                       memory_bytes=_size(data, "memory", origin, required=True),
                       reserve=str(data.get("reserve", "0")), bandwidth_bytes_per_s=bandwidth, cores=cores,
                       fp32_flops=_rate(data, "fp32_flops", origin), decode_mbu=float(mbu),
                       decode_flops_per_core=float(per_core), sockets=sockets,
                       sources=MappingProxyType(dict(data.get("sources") or {})), origin=origin)


@lru_cache(maxsize=1)
def builtin_hosts() -> dict[str, HostProfile]:
    """The host profiles shipped in ``localinfer.profiles/hosts``, by name."""
    from localinfer.devices.profiles import builtin_dir

    folder = builtin_dir().joinpath("hosts")
    out = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            host = _parse(tomllib.loads(entry.read_text(encoding="utf-8")), f"built-in:hosts/{entry.name}")
            out[host.name] = host
    return out


def local_host() -> HostProfile:
    """This machine's RAM and cores (psutil); the bandwidth is a conservative default, said as such."""
    import psutil

    ram = int(psutil.virtual_memory().total)
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return HostProfile(
        name=LOCAL_NAME, display_name=f"this machine ({cores} cores)", memory_bytes=ram, reserve=LOCAL_RESERVE,
        bandwidth_bytes_per_s=LOCAL_BANDWIDTH, cores=cores,
        sources=MappingProxyType({
            "memory": "psutil.virtual_memory().total", "cores": "psutil.cpu_count(logical=False)",
            "bandwidth": "not probed: a conservative default of 40 GB/s (below DDR4-3200 dual channel, 51.2 GB/s); "
                         "give a host profile with --host for a better figure"}),
        origin="detected")


def unified_host(device) -> HostProfile:
    """The host of a unified-memory device (Apple silicon): its own memory and bandwidth."""
    return HostProfile(
        name=device.name, display_name=f"{device.display_name} (unified memory)", memory_bytes=device.memory_bytes,
        reserve=device.reserve, bandwidth_bytes_per_s=device.bandwidth_bytes_per_s or LOCAL_BANDWIDTH,
        cores=(os.cpu_count() or 1) if device.origin == "detected" else 0, unified=True,
        sources=MappingProxyType({"memory": "the device's own memory: host = device on unified memory"}),
        origin=device.origin)


def get_host(name: str) -> HostProfile:
    """A host profile by name (``"local"`` is this machine); UsageError naming --host otherwise."""
    key = str(name).strip().lower()
    if key == LOCAL_NAME:
        return local_host()
    hosts = builtin_hosts()
    if key not in hosts:
        raise UsageError(f"--host: unknown host {name!r}", flag="--host",
                         hint="use one of: " + ", ".join([LOCAL_NAME, *hosts]))
    return hosts[key]


def host_for(device, name: str | None = None) -> HostProfile | None:
    """The host of ``device``: ``name`` if given, else the profile's own ``host``, this machine's for
    ``local``, the device itself on unified memory; None when nothing says which host it has."""
    if name:
        return get_host(name)
    if device.unified or device.kind == "cpu":
        return unified_host(device) if device.origin != "detected" else local_host()
    if device.host:
        return get_host(device.host)
    if device.origin == "detected":
        return local_host()
    return None


def with_host(device, host: HostProfile | None):
    """The device profile with its host's usable RAM as ``host_memory_bytes`` (what the verdict judges)."""
    from dataclasses import replace

    if host is None or host.unified or device.unified or device.kind == "cpu":
        return device
    return replace(device, host_memory_bytes=host.usable_bytes)


__all__ = ["HostProfile", "builtin_hosts", "get_host", "host_for", "local_host", "unified_host", "with_host"]
