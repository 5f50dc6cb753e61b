"""Reading a small file whole: only a regular file, and at most a cap of bytes.

A FIFO would block the read and ``/dev/zero`` never end, so the path is
checked before it is opened and the open file again (it may have been swapped
in between); opening does not wait for a FIFO's writer.  Each caller words its
own refusals: ``what(problem, error)`` builds the exception to raise.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

MISSING = "missing"            # nothing at the path (error: the OSError)
NOT_REGULAR = "not regular"    # a directory, FIFO, device or socket
UNREADABLE = "unreadable"      # stat, open or read failed (error: the OSError)
TOO_LARGE = "too large"        # more than the cap

Refusal = Callable[[str, "OSError | None"], Exception]


def read_capped(path: str | os.PathLike, limit: int, what: Refusal) -> bytes:
    """The bytes of the regular file at ``path`` (symlinks followed), at most ``limit`` of them.

    Raises ``what(problem, error)`` with ``problem`` one of MISSING, NOT_REGULAR, UNREADABLE or TOO_LARGE.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError as exc:
        raise what(MISSING, exc) from None
    except OSError as exc:
        raise what(UNREADABLE, exc) from None
    if not stat.S_ISREG(mode):
        raise what(NOT_REGULAR, None)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        raise what(MISSING, exc) from None
    except OSError as exc:
        raise what(UNREADABLE, exc) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise what(NOT_REGULAR, None)
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise what(UNREADABLE, exc) from None
    if len(data) > limit:
        raise what(TOO_LARGE, None)
    return data
