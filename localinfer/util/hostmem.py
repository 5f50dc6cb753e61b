"""Host memory for a server's caches: how much parked KV and recurrent-state snapshots may take by default, and the
buffers they are read into."""

from __future__ import annotations

import mmap

import numpy as np

HOST_CACHE_MAX = 8 << 30      # llama-server's --cache-ram default: 8192 MiB
POPULATE_MIN = 1 << 20        # buffers from this size get their pages at once (host_buffer)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def host_cache_budget() -> int:
    """``HOST_CACHE_MAX``, at most half the RAM free now."""
    import psutil

    return min(HOST_CACHE_MAX, int(psutil.virtual_memory().available) // 2)


def host_buffer(n: int) -> np.ndarray:
    """``n`` bytes (uint8, writable, contents undefined) for a state llama.cpp writes at once, e.g. a parked
    sequence's KV.  From ``POPULATE_MIN`` bytes on Linux its pages come in one ``mmap(MAP_POPULATE)`` call instead of a
    page fault each as the copy first touches them: a 9.9 MB parked state took 18.6 ms through ``np.empty`` (numpy
    asks for transparent huge pages there) against 3.4 ms populated, on the 2-vCPU KVM dev VM.  The memory goes back
    when the array does."""
    if n < POPULATE_MIN or not _POPULATE:
        return np.empty(n, dtype=np.uint8)
    try:
        area = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    except OSError:           # no room for it all at once: let the pages come as they are touched
        return np.empty(n, dtype=np.uint8)
    return np.frombuffer(area, dtype=np.uint8)
