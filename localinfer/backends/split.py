"""The vocabulary of a split across devices, shared by a backend's memory model and the planner.

A backend that can split a model across devices (llama.cpp: layers over RPC
workers and local GPUs) answers with a :class:`SplitBreakdown`: for each
:class:`SplitDevice` the layers it holds and its weights, KV and compute bytes
(:class:`DeviceShare`), and what stays on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HOST = -1


@dataclass(frozen=True)
class SplitDevice:
    """One device of the split, as llama.cpp sees it."""

    name: str                  # llama.cpp's buffer name ("RPC0[10.0.0.2:50052]", "CUDA0") or a profile label
    kind: str                  # allocation rules: "cuda", or "cpu" (an RPC worker's CPU, Metal: plain copies)
    free: int                  # free bytes as llama.cpp reads them: the default split's share
    usable: int                # bytes a plan may use there
    async_events: bool = True  # async compute and events (RPC, CUDA): pipeline parallelism when all have them
    remote: bool = True        # across the network (an RPC worker), not this machine's own GPU


@dataclass(frozen=True)
class DeviceShare:
    """What one device holds under a split."""

    name: str
    kind: str
    layers: tuple[int, ...]
    output: bool
    weights: int
    kv: int
    compute: int
    usable: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    @property
    def fits(self) -> bool:
        return self.total <= self.usable


@dataclass(frozen=True)
class SplitBreakdown:
    """A split's bytes per device and on the host."""

    devices: tuple[DeviceShare, ...]
    host_weights: dict[str, int]        # buffer name -> bytes ("CPU_Mapped model", "CPU_REPACK model", ...)
    host_kv: int
    host_output: int
    host_compute: int
    units: tuple[int, ...]              # device index of each layer, then of the output layer (HOST: the CPU)
    shares: tuple[float, ...]
    pipeline: bool
    n_ctx: int                          # llama.cpp's padded context
    notes: tuple[str, ...] = field(default=())
    host_tensors: frozenset[str] = field(default=frozenset())   # weights the host CPU computes (not the input layer)

    @property
    def host_total(self) -> int:
        return sum(self.host_weights.values()) + self.host_kv + self.host_output + self.host_compute

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    def counts(self) -> tuple[int, ...]:
        """Units (layers, the output layer counting as one) per device: a --tensor-split that reproduces it."""
        return tuple(sum(1 for u in self.units if u == i) for i in range(len(self.devices)))

    def to_dict(self) -> dict:
        return {"devices": [dict(d.__dict__, total=d.total, fits=d.fits) for d in self.devices],
                "host": {"weights": dict(self.host_weights), "kv": self.host_kv, "output": self.host_output,
                         "compute": self.host_compute, "total": self.host_total},
                "units": list(self.units), "shares": list(self.shares), "counts": list(self.counts()),
                "pipeline": self.pipeline, "n_ctx": self.n_ctx, "fits": self.fits, "notes": list(self.notes)}
