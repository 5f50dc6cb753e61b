"""read_capped: a regular file only, at most the cap; and the three readers that use it keep their words."""

from __future__ import annotations

import os
import signal

import pytest

from localinfer.devices.profiles import MAX_PROFILE_BYTES, load_profile_file
from localinfer.errors import ProfileError, UsageError
from localinfer.generation.chat import MAX_TRANSCRIPT_BYTES, read_transcript
from localinfer.plan.bench_import import MAX_BENCH_BYTES, load_bench
from localinfer.util import files
from localinfer.util.files import read_capped


class Refused(Exception):
    pass


def why(problem, exc):
    return Refused(problem, exc)


@pytest.fixture
def no_blocking():
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("blocked on a FIFO"))
    signal.alarm(5)
    yield
    signal.alarm(0)


def test_reads_a_small_file_and_refuses_the_rest(tmp_path, no_blocking):
    f = tmp_path / "a"
    f.write_bytes(b"x" * 10)
    assert read_capped(f, 10, why) == b"x" * 10
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(f)
    assert read_capped(tmp_path / "link", 10, why) == b"x" * 10
    for path, limit, problem in ((f, 9, files.TOO_LARGE), (tmp_path / "fifo", 10, files.NOT_REGULAR),
                                 ("/dev/zero", 10, files.NOT_REGULAR), (tmp_path, 10, files.NOT_REGULAR),
                                 (tmp_path / "absent", 10, files.MISSING)):
        err = pytest.raises(Refused, read_capped, path, limit, why).value
        assert err.args[0] == problem, path
    assert isinstance(pytest.raises(Refused, read_capped, tmp_path / "absent", 1, why).value.args[1], OSError)


def test_the_open_file_is_checked_too(tmp_path, monkeypatch, no_blocking):
    """A FIFO swapped in between the check and the open is refused, not waited on."""
    os.mkfifo(tmp_path / "fifo")
    f = tmp_path / "a"
    f.write_bytes(b"{}")
    real_open = os.open
    monkeypatch.setattr(files.os, "open", lambda p, flags: real_open(tmp_path / "fifo", flags))
    assert pytest.raises(Refused, read_capped, f, 10, why).value.args[0] == files.NOT_REGULAR


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable(tmp_path):
    f = tmp_path / "a"
    f.write_bytes(b"{}")
    f.chmod(0)
    assert pytest.raises(Refused, read_capped, f, 10, why).value.args[0] == files.UNREADABLE


def test_each_reader_keeps_its_messages(tmp_path, no_blocking):
    os.mkfifo(tmp_path / "fifo.toml")
    big = tmp_path / "big"
    big.write_bytes(b" " * (max(MAX_PROFILE_BYTES, MAX_BENCH_BYTES, MAX_TRANSCRIPT_BYTES) + 1))
    fifo, absent = tmp_path / "fifo.toml", tmp_path / "absent"
    cases = [
        (load_profile_file, ProfileError, fifo, f"profile {fifo}: not a regular file"),
        (load_profile_file, ProfileError, absent, f"profile {absent}: not a regular file"),
        (load_profile_file, ProfileError, big, f"profile {big}: over {MAX_PROFILE_BYTES >> 10} KiB; a profile is a few keys"),
        (load_bench, UsageError, fifo, f"--bench {fifo}: not a regular file; not a bench result"),
        (load_bench, UsageError, absent, f"--bench {absent}: cannot read: No such file or directory"),
        (load_bench, UsageError, big, f"--bench {big}: larger than 16 MiB; not a bench result"),
        (read_transcript, UsageError, fifo, f"{fifo} is not a regular file"),
        (read_transcript, UsageError, absent, f"cannot read {absent}: No such file or directory"),
        (read_transcript, UsageError, big, f"{big} is over 16 MiB"),
    ]
    for reader, kind, path, message in cases:
        err = pytest.raises(kind, reader, str(path)).value
        assert err.message == message, (reader.__name__, path)
