"""User profiles a careless user writes: absurd sizes, two files with one name, a path that is not there."""

from __future__ import annotations

import pytest

from localinfer.devices.profiles import load_profiles
from localinfer.errors import ProfileError

GOOD = 'name = "{name}"\nkind = "cuda"\nmemory = "{memory}"\n'


def _write(d, file, name="mine", memory="24GB", extra=""):
    d.mkdir(exist_ok=True)
    (d / file).write_text(GOOD.format(name=name, memory=memory) + extra)


@pytest.mark.parametrize("key, line", [
    ("memory", None),                                   # was: printed as 93132257461547848641282048.00 GiB
    ("bandwidth", 'bandwidth = "1e30GB/s"'),
    ("power_w", "power_w = 1e12"),
])
def test_absurd_numbers_are_refused(tmp_path, monkeypatch, key, line):
    d = tmp_path / "p"
    if line is None:
        _write(d, "a.toml", memory="99999999999999999999999TB")
    else:
        _write(d, "a.toml", extra=line + "\n")
    monkeypatch.setenv("LOCALINFER_PROFILES", str(d))
    err = pytest.raises(ProfileError, load_profiles).value
    assert err.field == key and "a.toml" in str(err) and err.hint


def test_two_user_profiles_with_one_name_are_refused(tmp_path, monkeypatch):
    # was: the last one won silently
    d = tmp_path / "p"
    _write(d, "a.toml", name="twin")
    _write(d, "b.toml", name="twin", memory="48GB")
    monkeypatch.setenv("LOCALINFER_PROFILES", str(d))
    err = pytest.raises(ProfileError, load_profiles).value
    assert "twin" in str(err) and "a.toml" in str(err) and "b.toml" in str(err)


def test_a_user_profile_may_still_replace_a_built_in(tmp_path, monkeypatch):
    d = tmp_path / "p"
    _write(d, "a.toml", name="rtx-4090", memory="48GB")
    monkeypatch.setenv("LOCALINFER_PROFILES", str(d))
    assert load_profiles()["rtx-4090"].memory_bytes == 48 * 10**9


def test_a_profile_path_that_does_not_exist_is_an_error(tmp_path, monkeypatch):
    # was: LOCALINFER_PROFILES=/nonexistent ignored silently
    monkeypatch.setenv("LOCALINFER_PROFILES", str(tmp_path / "nonexistent"))
    err = pytest.raises(ProfileError, load_profiles).value
    assert "nonexistent" in str(err) and "LOCALINFER_PROFILES" in err.hint
    monkeypatch.setenv("LOCALINFER_PROFILES", "")          # empty: no user profiles
    assert "rtx-4090" in load_profiles()


def test_a_fifo_or_a_huge_file_among_the_profiles_is_refused_without_reading_it(tmp_path, monkeypatch):
    import os

    d = tmp_path / "p"
    d.mkdir()
    os.mkfifo(d / "a.toml")                          # was: open() blocked forever
    monkeypatch.setenv("LOCALINFER_PROFILES", str(d))
    assert "not a regular file" in str(pytest.raises(ProfileError, load_profiles).value)
    (d / "a.toml").unlink()
    (d / "a.toml").write_text(GOOD.format(name="big", memory="24GB") + "#" * (2 << 20) + "\n")
    assert "KiB" in str(pytest.raises(ProfileError, load_profiles).value)
