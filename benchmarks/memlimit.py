"""A memory cgroup of our own: created under this process's memory cgroup, limited, removed afterwards.

Two hierarchies are handled.  cgroup v1: a child of our ``memory`` controller's
cgroup, ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (memory +
swap, so swap cannot soften the limit).  cgroup v2: a child of our cgroup when
``memory`` is enabled in its ``cgroup.subtree_control`` (a non-root cgroup that
holds processes cannot enable it itself), ``memory.max`` and ``memory.swap.max = 0``.
Nothing outside the cgroup created here is ever written.

Charges: a page is charged to the cgroup of the process that first brings it in.
Pages a process touched before it entered stay with its old cgroup, and so do
file pages already in the page cache; ``drop_cache`` evicts a file's clean pages
so that reading it again charges them here.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path

UNLIMITED = 1 << 62     # any value above the kernel's page-rounded maximum means "no limit"
_SERIAL = itertools.count()


class Unavailable(Exception):
    """No memory cgroup this process may create and limit (the message says why)."""


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root inside the hierarchy, mount point, filesystem type, super options) of each cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                out.append((fields[3], fields[4], rfields[0], rfields[2]))
    return out


def _under(mount_root: str, mount_point: str, cg_path: str) -> Path | None:
    if mount_root != "/" and not (cg_path == mount_root or cg_path.startswith(mount_root + "/")):
        return None
    rel = cg_path[len(mount_root):] if mount_root != "/" else cg_path
    p = Path(mount_point + rel)
    return p if p.is_dir() else None


def own_memcg() -> tuple[Path, int]:
    """This process's memory cgroup directory and the hierarchy's version (1 or 2), if we may make a child there."""
    try:
        with open("/proc/self/cgroup") as fh:
            entries = [line.rstrip("\n").split(":", 2) for line in fh]
        mounts = _mounts()
    except OSError as e:
        raise Unavailable(f"cannot read /proc/self/cgroup or mountinfo: {e}") from None
    reasons = []
    for hid, controllers, path in entries:
        if "memory" in controllers.split(","):
            for root, point, fstype, opts in mounts:
                d = _under(root, point, path) if fstype == "cgroup" and "memory" in opts.split(",") else None
                if d is not None and os.access(d, os.W_OK) and (d / "memory.limit_in_bytes").exists():
                    return d, 1
            reasons.append(f"cgroup v1 memory:{path} is not mounted writable here")
        elif hid == "0" and controllers == "":
            for root, point, fstype, _ in mounts:
                d = _under(root, point, path) if fstype == "cgroup2" else None
                if d is None:
                    continue
                sub = (d / "cgroup.subtree_control").read_text().split()
                if "memory" in sub and os.access(d, os.W_OK):
                    return d, 2
                reasons.append(f"cgroup v2 {d}: memory not in cgroup.subtree_control ({' '.join(sub) or 'empty'})")
    raise Unavailable("; ".join(reasons) or "no memory cgroup controller for this process")


class Memcg:
    """One cgroup directory we created: limit it, put a process in it, read what it was charged."""

    def __init__(self, path: str | Path, version: int):
        self.path, self.version = Path(path), version

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def _write(self, name: str, value: str | int) -> None:
        (self.path / name).write_text(str(value))

    def enter(self, pid: int) -> None:
        """Move ``pid`` (and all its threads) here; pages it allocates from now on are charged here."""
        self._write("cgroup.procs", pid)

    def set_limit(self, limit: int) -> None:
        """Cap memory at ``limit`` bytes, swap included (memory + swap = limit)."""
        if self.version == 1:
            old = int(self._read("memory.limit_in_bytes"))
            sw = self.path / "memory.memsw.limit_in_bytes"
            # memsw must stay >= the memory limit: lower memory first when lowering, memsw first when raising
            if limit < old:
                self._write("memory.limit_in_bytes", limit)
                if sw.exists():
                    self._write("memory.memsw.limit_in_bytes", limit)
            else:
                if sw.exists():
                    self._write("memory.memsw.limit_in_bytes", limit)
                self._write("memory.limit_in_bytes", limit)
        else:
            self._write("memory.max", limit)
            if (self.path / "memory.swap.max").exists():
                self._write("memory.swap.max", 0)

    def usage(self) -> int:
        """Bytes charged now (anonymous + page cache + kernel memory)."""
        return int(self._read("memory.usage_in_bytes" if self.version == 1 else "memory.current"))

    def limit(self) -> int:
        return int(self._read("memory.limit_in_bytes")) if self.version == 1 else int(
            self._read("memory.max").replace("max", str(UNLIMITED)))

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return int(self._read(name)) if (self.path / name).exists() else None

    def stat(self) -> dict[str, int]:
        """memory.stat's counters of this cgroup (v1: rss, cache, mapped_file; v2: anon, file, file_mapped)."""
        out = {}
        for line in self._read("memory.stat").splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
        return out

    def kernel(self) -> int | None:
        """Kernel memory charged here (page tables, slab); part of usage."""
        if self.version == 2:
            return self.stat().get("kernel")
        f = self.path / "memory.kmem.usage_in_bytes"
        return int(f.read_text()) if f.exists() else None

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer ended in this cgroup."""
        text = self._read("memory.oom_control" if self.version == 1 else "memory.events")
        return next((int(v) for k, v in (line.split() for line in text.splitlines()) if k == "oom_kill"), 0)

    def pids(self) -> list[int]:
        return [int(x) for x in self._read("cgroup.procs").split()]


@contextlib.contextmanager
def child_memcg(limit: int, *, tag: str = "localinfer-test", timeout: float = 10.0):
    """A new cgroup ``<ours>/<tag>-<pid>-<n>`` limited to ``limit`` bytes; removed on exit, once it holds no process.

    Raises Unavailable where no memory cgroup may be created.  The caller ends the
    processes it put in; removal waits up to ``timeout`` seconds for them to go.
    """
    parent, version = own_memcg()
    path = parent / f"{tag}-{os.getpid()}-{next(_SERIAL)}"
    try:
        path.mkdir()
    except OSError as e:
        raise Unavailable(f"cannot create {path}: {e}") from None
    cg = Memcg(path, version)
    try:
        cg.set_limit(limit)
        yield cg
    finally:
        deadline = time.monotonic() + timeout
        while True:
            try:
                path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def drop_cache(path: str | Path) -> None:
    """Evict ``path``'s clean pages from the page cache (written out first), so the next reader is charged them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
