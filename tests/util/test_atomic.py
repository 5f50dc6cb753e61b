"""atomic_write and check_writable: a path that cannot name a file is an OutputError naming the path
the user gave (never the temp file), and the previous file survives every failure."""

from __future__ import annotations

import errno
import os

import pytest

from localinfer.errors import OutputError
from localinfer.util.atomic import atomic_write, check_writable


@pytest.mark.parametrize("make, words", [
    (lambda d: str(d / "newdir") + "/", "names a folder"),            # was: wrote a file named newdir
    (lambda d: str(d), "is a directory"),                               # was: [Errno 21] ... '.DIR.xxx.tmp'
    (lambda d: str(d / "missing" / "x.txt"), "does not exist"),
    (lambda d: str(d / "file.txt" / "x.txt"), "is not a folder"),
])
def test_paths_that_cannot_name_a_file(tmp_path, make, words):
    (tmp_path / "file.txt").write_text("keep")
    path = make(tmp_path)
    for fn in (check_writable, lambda p: atomic_write(p, "data")):
        with pytest.raises(OutputError) as ei:
            fn(path)
        msg = str(ei.value)
        assert words in msg and path in msg and ".tmp" not in msg and "Errno" not in msg and ei.value.hint
    assert not (tmp_path / "newdir").exists() and (tmp_path / "file.txt").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["file.txt"]


def _disk_full(monkeypatch):
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)


def test_disk_full_keeps_the_previous_file_and_says_so(tmp_path, monkeypatch):
    old = tmp_path / "t.json"
    old.write_text("previous")
    _disk_full(monkeypatch)
    with pytest.raises(OutputError) as ei:
        atomic_write(old, "new")
    assert "No space left" in str(ei.value) and "left as it was" in ei.value.hint
    assert old.read_text() == "previous" and os.listdir(tmp_path) == ["t.json"]


def test_disk_full_with_no_previous_file_claims_none(tmp_path, monkeypatch):
    _disk_full(monkeypatch)
    with pytest.raises(OutputError) as ei:
        atomic_write(tmp_path / "t.json", "new")
    assert "left as it was" not in ei.value.hint and "intact" not in ei.value.hint   # there was no file
    assert os.listdir(tmp_path) == []


def test_check_writable_leaves_nothing_behind(tmp_path):
    assert check_writable(tmp_path / "out.txt") == str(tmp_path / "out.txt")
    assert os.listdir(tmp_path) == []
