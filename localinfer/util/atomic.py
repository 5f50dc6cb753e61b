"""Write a file so that readers see the old version or the new one, never half.

Temp file in the same directory, write, flush, fsync, rename over the target,
fsync the directory.  On any error (disk full, permission) the temp file is
removed and the previous file is untouched.
"""

from __future__ import annotations

import os
import tempfile


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace path with data atomically (str is written as UTF-8)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            os.chmod(tmp, os.stat(path).st_mode & 0o777)
        else:  # mkstemp makes 0600; a new file gets the usual 0666 & ~umask
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
