"""Weight offload with prefetch: what it frees, what it costs per step.

Offloaded tensor groups live in host memory and are copied back over the
device's link before each use, every forward pass.  Groups go in this order:
routed experts (MoE), then FFN matrices, then attention matrices, spread evenly
over the layers.  Prefetch buffers sit on the device: 0 or 1 buffer serialises
copy and compute, 2 let the next copy run under the current compute.

    net freed      = Σ offloaded − buffers × largest group
    copy per step  ≥ Σ offloaded / link bandwidth (per direction)
    step           = compute + copy (0/1 buffer)  or  max(compute, copy) (2 buffers)

Compressing what crosses the link pays only if the decompressor outputs
R_dec > B_link / (1 − r) (``CompressedTransfer``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from localinfer.errors import UsageError
from localinfer.model.spec import ModelSpec
from localinfer.util.memo import spec_cache

_GROUP_RE = re.compile(r"^blk\.(\d+)\.(\w+?)\.")
_KIND_ORDER = ("experts", "ffn", "attention")


@dataclass(frozen=True)
class OffloadGroup:
    """Tensors of one layer that move together: ``kind`` is experts, ffn or attention."""

    layer: int
    kind: str
    bytes: int
    tensors: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"blk.{self.layer}.{self.kind}"


def _kind(tensor: str) -> str | None:
    if "_exps." in tensor:
        return "experts"
    part = tensor.split(".")[2] if tensor.count(".") >= 3 else ""
    if part.startswith("ffn_") and part not in ("ffn_norm", "ffn_gate_inp") and "norm" not in part:
        return "ffn"
    if part.startswith("attn_") and "norm" not in part and part != "attn_sinks":
        return "attention"
    return None


def offload_groups(spec: ModelSpec) -> list[OffloadGroup]:
    """Every offloadable group, in the order they should leave the device (memoised per spec)."""
    memo = spec_cache(spec)
    if "offload_groups" not in memo:
        memo["offload_groups"] = tuple(_groups(spec))
    return list(memo["offload_groups"])


def _groups(spec: ModelSpec) -> list[OffloadGroup]:
    by_key: dict[tuple[int, str], list] = {}
    for t in spec.tensors:
        m = _GROUP_RE.match(t.name)
        kind = _kind(t.name) if m else None
        if kind:
            by_key.setdefault((int(m.group(1)), kind), []).append(t)
    groups = []
    for kind in _KIND_ORDER:
        layers = sorted(il for il, k in by_key if k == kind)
        for il in _spread(layers):
            ts = by_key[(il, kind)]
            groups.append(OffloadGroup(il, kind, sum(t.n_bytes for t in ts), tuple(t.name for t in ts)))
    return groups


def _spread(layers: list[int]) -> list[int]:
    """Layers reordered so that any first n of them are evenly spaced (every 4th for n = N/4)."""
    order, seen = [], set()
    n = len(layers)
    for step in (4, 2, 1):
        for i in range(step - 1, n, step):
            if i not in seen:
                seen.add(i)
                order.append(layers[i])
    for i in range(n):
        if i not in seen:
            order.append(layers[i])
    return order


@dataclass(frozen=True)
class OffloadPlan:
    """Which groups live on the host, and the per-step copy that buys."""

    groups: tuple[OffloadGroup, ...]
    buffers: int
    link_name: str | None
    link_bytes_per_s: float | None
    step_compute_s: float = 0.0

    @property
    def freed_bytes(self) -> int:
        return sum(g.bytes for g in self.groups)

    @property
    def buffer_bytes(self) -> int:
        return self.buffers * max((g.bytes for g in self.groups), default=0)

    @property
    def net_bytes(self) -> int:
        return self.freed_bytes - self.buffer_bytes

    @property
    def copy_s_per_step(self) -> float:
        if not self.groups:
            return 0.0
        if not self.link_bytes_per_s:
            raise UsageError("this device has no host link to offload over (unified memory)", flag="--device")
        return self.freed_bytes / self.link_bytes_per_s

    @property
    def overlapped(self) -> bool:
        return self.buffers >= 2

    @property
    def step_s(self) -> float:
        copy = self.copy_s_per_step
        return max(self.step_compute_s, copy) if self.overlapped else self.step_compute_s + copy

    @property
    def copy_hidden(self) -> bool:
        """True when prefetch hides the whole copy under compute."""
        return self.overlapped and self.copy_s_per_step <= self.step_compute_s

    def copy_s(self, steps: int) -> float:
        """Lower bound of copy time over ``steps`` forward passes."""
        return steps * self.copy_s_per_step

    def decode_s(self, steps: int) -> float:
        return steps * self.step_s

    def meets(self, steps: int, budget_s: float) -> bool:
        """Whether ``steps`` decode steps fit in ``budget_s`` seconds."""
        return self.decode_s(steps) <= budget_s

    def required_link(self, steps: int, copy_budget_s: float) -> float:
        """Per-direction bandwidth (bytes/s) that moves ``steps`` copies in ``copy_budget_s``."""
        return steps * self.freed_bytes / copy_budget_s

    def extra_requests(self, per_request_bytes: int) -> int:
        """How many more requests of ``per_request_bytes`` the net freed memory holds."""
        return max(self.net_bytes, 0) // per_request_bytes

    def describe(self) -> str:
        kinds = sorted({g.kind for g in self.groups}, key=_KIND_ORDER.index)
        return f"offload {len(self.groups)} {'+'.join(kinds)} groups, {self.buffers} prefetch buffer(s)"


def plan_offload(spec: ModelSpec, device, *, groups: int | None = None, free_bytes: int | None = None,
                 buffers: int = 2, step_compute_s: float = 0.0, kinds: tuple[str, ...] | None = None) -> OffloadPlan:
    """Offload the first ``groups`` groups, or as many as needed for ``free_bytes`` net.

    Raises UsageError when nothing can be offloaded (unified memory, no link) or
    when even every group does not free ``free_bytes``.
    """
    if buffers not in (0, 1, 2):
        raise UsageError(f"prefetch buffers must be 0, 1 or 2, got {buffers}", flag="--buffers")
    if getattr(device, "unified", False) or not getattr(device, "link_bytes_per_s", None):
        raise UsageError(f"{getattr(device, 'name', 'this device')} shares memory with the host; "
                         "there is nothing to offload to", flag="--device")
    pool = [g for g in offload_groups(spec) if kinds is None or g.kind in kinds]
    if groups is None and free_bytes is None:
        raise UsageError("say how many groups to offload or how many bytes to free", flag="--offload")

    def plan(chosen) -> OffloadPlan:
        return OffloadPlan(tuple(chosen), buffers, device.link_name, device.link_bytes_per_s, step_compute_s)

    if groups is not None:
        if not 0 <= groups <= len(pool):
            raise UsageError(f"cannot offload {groups} groups; the model has {len(pool)}", flag="--offload")
        return plan(pool[:groups])
    n = 0
    while n < len(pool) and plan(pool[:n]).net_bytes < free_bytes:
        n += 1
    result = plan(pool[:n])
    if result.net_bytes < free_bytes:
        raise UsageError(f"offloading every group frees only {result.net_bytes:,} bytes net, "
                         f"{free_bytes:,} needed", flag="--offload")
    return result


@dataclass(frozen=True)
class CompressedTransfer:
    """Moving ``bytes`` over a link raw, or compressed to ``ratio`` of the size and decompressed."""

    bytes: int
    ratio: float
    link_bytes_per_s: float
    decompress_bytes_per_s: float | None = None

    @property
    def raw_s(self) -> float:
        return self.bytes / self.link_bytes_per_s

    @property
    def wire_s(self) -> float:
        return self.ratio * self.bytes / self.link_bytes_per_s

    @property
    def compressed_s(self) -> float:
        """Transfer then decompress: rS/B + S/R_dec."""
        if not self.decompress_bytes_per_s:
            return self.wire_s
        return self.wire_s + self.bytes / self.decompress_bytes_per_s

    @property
    def min_decompress_rate(self) -> float:
        """R_dec must exceed B_link / (1 − r) (bytes of original data per second)."""
        return self.link_bytes_per_s / (1 - self.ratio)

    @property
    def pays(self) -> bool | None:
        d = self.decompress_bytes_per_s
        return None if d is None else d > self.min_decompress_rate
