"""host_buffer: a state's bytes in memory whose pages are there before llama.cpp writes them."""

import mmap
import platform
import sys

import numpy as np
import pytest

from localinfer.util import hostmem
from localinfer.util.hostmem import MADV_POPULATE_WRITE, POPULATE_MIN, host_buffer


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.parametrize("n", [0, 7, POPULATE_MIN - 1, POPULATE_MIN, 3 * POPULATE_MIN + 5])
def test_a_host_buffer_is_n_writable_bytes(n):
    b = host_buffer(n)
    assert b.dtype == np.uint8 and b.shape == (n,) and b.flags.writeable
    b[:] = 7
    assert int(b.sum()) == 7 * n


def _kernel() -> tuple[int, ...]:
    return tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2] if x.isdigit())


@pytest.mark.skipif(not sys.platform.startswith("linux") or _kernel() < (5, 14),
                    reason="MADV_POPULATE_WRITE is Linux 5.14's")
def test_a_large_host_buffer_is_resident_before_it_is_written():
    """Populated at allocation (one madvise call), where np.empty's pages come one fault at a time as they are
    touched: 64 MiB untouched adds 64 MiB to the resident set through host_buffer, and next to nothing through
    np.empty."""
    n = 64 << 20
    before = _rss()
    b = host_buffer(n)
    grew = _rss() - before
    lazy_before = _rss()
    e = np.empty(n, dtype=np.uint8)
    lazy = _rss() - lazy_before
    assert grew >= 0.95 * n > 10 * lazy
    del b, e


def test_a_slice_keeps_the_mapping_alive():
    """Parked states are cut into slices and copies: the memory stays mapped while any array over it lives."""
    b = host_buffer(2 * POPULATE_MIN)
    tail = b[POPULATE_MIN:]
    del b
    tail[:] = 3
    assert int(tail[-1]) == 3 and tail.size == POPULATE_MIN


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the populated mapping is Linux's")
@pytest.mark.parametrize("answer", [0, -1])
def test_a_large_buffer_asks_the_kernel_for_its_pages_once_and_survives_a_refusal(monkeypatch, answer):
    """One madvise(MADV_POPULATE_WRITE) over the whole page-aligned mapping; a kernel that refuses it (before
    5.14, or memory short) leaves a buffer that works, its pages coming as they are written."""
    calls = []
    monkeypatch.setattr(hostmem, "_madvise", lambda: lambda addr, n, advice: calls.append((addr, n, advice)) or answer)
    n = 3 * POPULATE_MIN + 5
    b = host_buffer(n)
    assert [(a % mmap.PAGESIZE, m, advice) for a, m, advice in calls] == [(0, n, MADV_POPULATE_WRITE)]
    assert calls[0][0] == b.ctypes.data
    b[:] = 9
    assert int(b[-1]) == 9 and host_buffer(POPULATE_MIN - 1) is not None and len(calls) == 1
