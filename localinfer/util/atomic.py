"""Write a file so that readers see the old version or the new one, never half.

Temp file in the same directory, write, flush, fsync, rename over the target,
fsync the directory.  On any error (disk full, permission) the temp file is
removed and the previous file is untouched.  A path that cannot name a file
(it ends in ``/``, is a directory, its folder is missing or read-only) is an
:class:`~localinfer.errors.OutputError` naming the path the user gave, never a
temp name; :func:`check_writable` runs the same checks before any long work.
"""

from __future__ import annotations

import errno
import os
import tempfile

from localinfer.errors import OutputError


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _target(path: str | os.PathLike) -> tuple[str, str, str]:
    """(the path as given, absolute path, folder), or OutputError when the path cannot name a file."""
    given = os.fspath(path)
    if not given:
        raise OutputError("the output path is empty", path=given, hint="give a file name")
    if given.endswith(os.sep) or (os.altsep and given.endswith(os.altsep)):
        raise OutputError(f"{given} ends in {given[-1]}, so it names a folder, not a file", path=given,
                          hint=f"give a file name inside it, e.g. {given}out.txt (the folder must exist)")
    full = os.path.abspath(given)
    if os.path.isdir(full):
        raise OutputError(f"{given} is a directory, not a file", path=given,
                          hint=f"give a file name inside it, e.g. {os.path.join(given, 'out.txt')}")
    folder = os.path.dirname(full)
    if not os.path.isdir(folder):
        shown = os.path.dirname(given) or folder
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise OutputError(f"cannot write {given}: {shown} {what}", path=given,
                          hint=f"create the folder first (mkdir -p {shown}) or choose another path")
    return given, full, folder


def _failed(given: str, full: str, exc: OSError) -> OutputError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "free some disk space, or write somewhere else"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "choose a folder you can write to"
    else:
        hint = "choose another path"
    if os.path.exists(full):
        hint += f"; {given} was left as it was"
    return OutputError(f"cannot write {given}: {exc.strerror or exc}", path=given, errno=exc.errno, hint=hint)


def check_writable(path: str | os.PathLike, inputs=()) -> str:
    """Fail now, with an OutputError, if :func:`atomic_write` could not write ``path`` (probes the folder)
    or ``path`` is one of the ``inputs`` (a model file must never be written over)."""
    given, full, folder = _target(path)
    for src in inputs:
        try:
            same = os.path.exists(full) and os.path.samefile(full, src)
        except OSError:
            same = False
        if same:
            raise OutputError(f"{given} is an input of this command ({os.fspath(src)}); refusing to write over it",
                              path=given, hint="choose another output path")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".localinfer-probe.", dir=folder)
    except OSError as exc:
        raise _failed(given, full, exc) from None
    os.close(fd)
    os.unlink(tmp)
    return full


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace path with data atomically (str is written as UTF-8); OutputError when it cannot."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    given, path, folder = _target(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise _failed(given, path, exc) from None
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
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise _failed(given, path, exc) from None
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
