"""Host memory for a server's caches: how much parked KV and recurrent-state snapshots may take by default, and the
buffers they are read into."""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import numpy as np

HOST_CACHE_MAX = 8 << 30      # llama-server's --cache-ram default: 8192 MiB
POPULATE_MIN = 1 << 20        # buffers from this size get their pages at once (host_buffer)
MADV_POPULATE_WRITE = 23      # Linux 5.14+: fault a range in, writable, in one call


def host_cache_budget() -> int:
    """``HOST_CACHE_MAX``, at most half the RAM free now."""
    import psutil

    return min(HOST_CACHE_MAX, int(psutil.virtual_memory().available) // 2)


def host_buffer(n: int) -> np.ndarray:
    """``n`` bytes (uint8, writable, contents undefined) for a state llama.cpp writes at once, e.g. a parked
    sequence's KV.  From ``POPULATE_MIN`` bytes on Linux they are an anonymous mapping of their own (not the
    transparent huge pages numpy asks for above 4 MiB, where THP is "madvise") whose pages come in one
    ``madvise(MADV_POPULATE_WRITE)``, made through ctypes so the GIL is free meanwhile, instead of a page fault each
    as the copy first touches them: a 9.9 MB parked state took 18.6 ms through ``np.empty`` against 3.6 ms, on the
    2-vCPU KVM dev VM (5.1 ms mapped but not populated, where the kernel is older).  The memory goes back when the
    last array over it does, so each call maps afresh: for a state that is kept.  Temporaries freed at once are
    cheaper through ``np.empty``, whose freed memory the allocator hands out again (eight 9.9 MB states written and
    freed, again and again: 14-16 ms a round against 36-40 here)."""
    if n < POPULATE_MIN or sys.platform != "linux":
        return np.empty(n, dtype=np.uint8)
    try:
        area = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:           # the kernel refused the mapping: the allocator's answer (MemoryError when it has none)
        return np.empty(n, dtype=np.uint8)
    buf = np.frombuffer(area, dtype=np.uint8)
    madvise = _madvise()
    if madvise is not None:   # a refusal (older kernel, memory short) leaves the pages to come as they are written
        madvise(buf.ctypes.data, n, MADV_POPULATE_WRITE)
    return buf


@functools.cache
def _madvise():
    try:
        f = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f
