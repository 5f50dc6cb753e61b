"""Is a cached prefix worth its memory?  V_h = p_h (T_r − T_f) − T_m.

``T_r`` recomputes the prefix (a prefill, from the speed model), ``T_f`` fetches
its KV back over the host link, ``T_m`` maintains it (by default one write-back,
the same transfer).  Keep a prefix when p_h > T_m / (T_r − T_f); with limited
space, rank prefixes by expected saving per MiB.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from localinfer.errors import UsageError
from localinfer.plan.speed import SpeedModel
from localinfer.units import MiB


@dataclass(frozen=True)
class PrefixValue:
    """The expected saving of keeping one prefix's KV (seconds per request that might reuse it)."""

    name: str
    tokens: int
    bytes: int
    hit_prob: float
    recompute_s: float
    fetch_s: float
    maintain_s: float

    @property
    def saving_per_hit_s(self) -> float:
        return self.recompute_s - self.fetch_s

    @property
    def value_s(self) -> float:
        """V_h = p_h (T_r − T_f) − T_m."""
        return self.hit_prob * self.saving_per_hit_s - self.maintain_s

    @property
    def break_even_prob(self) -> float:
        """Smallest hit probability at which keeping the prefix saves time."""
        saving = self.saving_per_hit_s
        return self.maintain_s / saving if saving > 0 else math.inf

    @property
    def value_per_mib_s(self) -> float:
        return self.value_s / (self.bytes / MiB)


def prefix_value(speed: SpeedModel, tokens: int, hit_prob: float, *, kv="f16", name: str = "",
                 link_bytes_per_s: float | None = None, maintain_s: float | None = None) -> PrefixValue:
    """Value of caching a ``tokens``-token prefix on ``speed``'s device.

    The fetch goes over ``link_bytes_per_s`` (default: the device's host link;
    none on unified memory, where the KV never leaves).
    """
    if not 0 <= hit_prob <= 1:
        raise UsageError(f"hit probability must be between 0 and 1, got {hit_prob}", flag="--hit-prob")
    if tokens < 1:
        raise UsageError("a prefix has at least one token", flag="--shared-prefix")
    nbytes = speed.cost.kv_read_bytes(tokens, kv)
    link = link_bytes_per_s
    if link is None and not getattr(speed.device, "unified", False):
        link = getattr(speed.device, "link_bytes_per_s", None)
    fetch = nbytes / link if link else 0.0
    return PrefixValue(name or f"{tokens}-token prefix", tokens, nbytes, hit_prob,
                       speed.prefill(1, tokens).seconds, fetch, fetch if maintain_s is None else maintain_s)


def choose_prefixes(candidates: Iterable[PrefixValue], capacity_bytes: int) -> tuple[list[PrefixValue], float]:
    """Prefixes to keep in ``capacity_bytes``, best value per MiB first; and their total value (s)."""
    chosen, used, total = [], 0, 0.0
    for p in sorted(candidates, key=lambda p: p.value_per_mib_s, reverse=True):
        if p.value_s > 0 and used + p.bytes <= capacity_bytes:
            chosen.append(p)
            used += p.bytes
            total += p.value_s
    return chosen, total
