"""How much host memory a server's caches may take by default: parked KV and recurrent-state snapshots."""

from __future__ import annotations

HOST_CACHE_MAX = 8 << 30      # llama-server's --cache-ram default: 8192 MiB


def host_cache_budget() -> int:
    """``HOST_CACHE_MAX``, at most half the RAM free now."""
    import psutil

    return min(HOST_CACHE_MAX, int(psutil.virtual_memory().available) // 2)
