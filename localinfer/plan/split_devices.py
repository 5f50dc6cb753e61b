"""The devices of a split, from running workers (``--rpc``) or offline from profiles (``--devices``).

llama.cpp orders a split's devices as RPC workers first, then this machine's GPUs;
the host CPU is never one of them (it keeps the input layer and the logits).
"""

from __future__ import annotations

from dataclasses import dataclass

from localinfer.backends.split import SplitDevice
from localinfer.devices.profiles import DeviceProfile, get_device, load_profiles, local_device, reserve_bytes
from localinfer.errors import UsageError

WORKER_CPU_RESERVE = "10%"     # an RPC worker's CPU reports all of its RAM as free: keep some for its OS


@dataclass(frozen=True)
class SplitSetup:
    devices: tuple[SplitDevice, ...]
    profiles: tuple[DeviceProfile | None, ...]   # one per device, for speed (None: unknown)
    remote: tuple[bool, ...]
    host: DeviceProfile                           # the client machine
    host_usable: int | None


def _local_accelerators(host: DeviceProfile, have: int) -> list[tuple[SplitDevice, DeviceProfile]]:
    if host.kind == "cpu":
        return []
    name = "CUDA" if host.kind == "cuda" else "MTL"
    return [(SplitDevice(f"{name}{have}", host.kind, host.usable_bytes, host.usable_bytes, remote=False), host)]


def from_workers(infos, host: DeviceProfile | None = None) -> SplitSetup:
    """Devices from probed workers (rpc_probe.WorkerInfo), then this machine's accelerator."""
    host = host or local_device()
    devs, profs, remote = [], [], []
    for info in infos:
        for wd in info.devices:
            usable = wd.free - (reserve_bytes(WORKER_CPU_RESERVE, wd.free) if wd.kind == "cpu" else 0)
            devs.append(SplitDevice(f"RPC{wd.index}[{wd.endpoint}]", wd.kind, wd.free, usable))
            profs.append(None)
            remote.append(True)
    for dev, prof in _local_accelerators(host, 0):
        devs.append(dev)
        profs.append(prof)
        remote.append(False)
    host_usable = host.usable_bytes if host.kind == "cpu" or host.unified else host.host_memory_bytes
    return SplitSetup(tuple(devs), tuple(profs), tuple(remote), host, host_usable)


def parse_hosts(text: str) -> list[tuple[int, str]]:
    """``m2-max-96gb,m2-max-96gb`` or ``2x rtx-4090``: (count, profile name) per host, this machine first."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        count, name = 1, item
        head, sep, tail = item.partition("x ")
        if sep and head.strip().isdigit():
            count, name = int(head), tail.strip()
        elif item[:1].isdigit() and "x" in item:
            head, _, tail = item.partition("x")
            if head.isdigit():
                count, name = int(head), tail.strip()
        if not 1 <= count <= 16:
            raise UsageError(f"--devices {item!r}: 1 to 16 devices per host", flag="--devices")
        out.append((count, name))
    if not out:
        raise UsageError("--devices needs at least one profile", flag="--devices",
                         hint="e.g. --devices m2-max-96gb,m2-max-96gb or --devices '2x rtx-4090'")
    return out


def from_profiles(text: str) -> SplitSetup:
    """Offline: the first item is the machine the client runs on, the others run `localinfer worker`."""
    profiles = load_profiles()
    hosts = [(n, get_device(name, profiles)) for n, name in parse_hosts(text)]
    devs, profs, remote = [], [], []
    k = 0
    for h, (count, prof) in enumerate(hosts[1:], start=1):
        for j in range(count):
            devs.append(SplitDevice(f"RPC{j}[host{h}:{prof.name}]", prof.kind if prof.kind == "cuda" else "cpu",
                                    prof.usable_bytes, prof.usable_bytes))
            profs.append(prof)
            remote.append(True)
            k += 1
    count, local = hosts[0]
    if local.kind != "cpu":
        for j in range(count):
            name = "CUDA" if local.kind == "cuda" else "MTL"
            devs.append(SplitDevice(f"{name}{j}[{local.name}]", local.kind if local.kind == "cuda" else "cpu",
                                    local.usable_bytes, local.usable_bytes, remote=False))
            profs.append(local)
            remote.append(False)
    if not devs:
        raise UsageError(f"--devices {text!r} has no device to put layers on: a CPU host keeps only the input "
                         "layer", flag="--devices", hint="add the workers' profiles after this machine's")
    host_usable = local.usable_bytes if local.kind == "cpu" or local.unified else local.host_memory_bytes
    return SplitSetup(tuple(devs), tuple(profs), tuple(remote), local, host_usable)
