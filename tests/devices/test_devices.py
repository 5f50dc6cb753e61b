"""Device profiles: built-ins, user files, the local machine, malformed files."""

import subprocess
import sys

import pytest

from localinfer.devices.profiles import (
    DeviceProfile,
    get_device,
    load_profile_file,
    load_profiles,
    local_device,
    profile_from_dict,
    reserve_bytes,
)
from localinfer.errors import ProfileError, UsageError
from localinfer.units import GB, GiB, MiB

BUILTINS = {"rtx-pro-6000", "m2-max-96gb", "h200", "h100-sxm", "a100-80gb-pcie", "gh200", "rtx-4090"}


@pytest.fixture(autouse=True)
def _no_user_profiles(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALINFER_PROFILES", "")   # no user profiles (a path that does not exist is an error)


def test_builtins_present_with_sources():
    profiles = load_profiles()
    assert BUILTINS <= set(profiles)
    for p in profiles.values():
        assert p.kind in ("cuda", "metal", "cpu")
        assert 0 < p.usable_bytes < p.memory_bytes
        for f in ("memory", "bandwidth", "bf16_flops"):
            assert p.source(f), f"{p.name}: no source for {f}"
        for f, given in (("decode_mbu", p.decode_mbu), ("prefill_mfu", p.prefill_mfu), ("fp16_flops", p.fp16_flops),
                         ("int8_ops", p.int8_ops), ("llamacpp", p.llamacpp)):
            assert not given or p.source(f), f"{p.name}: {f} without a source"


def test_m2_max_budget_is_96gb_minus_8gib():
    m2 = get_device("m2-max-96gb")
    assert m2.unified and m2.kind == "metal"
    assert m2.memory_bytes == 96 * GB
    assert m2.usable_bytes == 96 * GB - 8 * GiB
    assert round(m2.usable_bytes / GiB, 2) == 81.41


def test_rtx_pro_6000_facts_and_efficiency_table():
    p = get_device("rtx-pro-6000")
    assert p.bandwidth_bytes_per_s == 1792e9
    assert p.bf16_flops == pytest.approx(503.8e12)
    assert p.link_bytes_per_s == 64e9 and p.power_w == 600
    assert [p.decode_mbu_at(b) for b in (1, 4, 16, 64)] == [0.33, 0.34, 0.41, 0.65]
    assert [p.prefill_mfu_at(b) for b in (1, 4, 16, 64)] == [0.62, 0.61, 0.61, 0.58]
    assert 0.41 < p.decode_mbu_at(32) < 0.65
    assert p.decode_mbu_at(1000) == 0.65


def test_spec_links():
    assert get_device("gh200").link_bytes_per_s == 450e9
    a100 = get_device("a100-80gb-pcie")
    assert a100.link_bytes_per_s == 32e9 and a100.memory_bytes == 81920 * MiB


def test_unknown_device_lists_names():
    with pytest.raises(UsageError) as ei:
        get_device("tpu-v9")
    assert ei.value.flag == "--device"
    assert "rtx-4090" in ei.value.hint and "local" in ei.value.hint


def test_case_insensitive_and_display_name():
    assert get_device("H200").name == "h200"
    assert get_device("NVIDIA GeForce RTX 4090").name == "rtx-4090"


def test_user_profile_added_and_overrides(tmp_path, monkeypatch):
    d = tmp_path / "profiles"
    d.mkdir()
    (d / "mine.toml").write_text('name = "my-box"\nkind = "cpu"\nmemory = "64GiB"\nreserve = "4GiB"\n')
    (d / "h200.toml").write_text('name = "h200"\nkind = "cuda"\nmemory = "141GB"\n')
    monkeypatch.setenv("LOCALINFER_PROFILES", str(d))
    profiles = load_profiles()
    assert profiles["my-box"].usable_bytes == 60 * GiB
    assert profiles["h200"].memory_bytes == 141 * GB and profiles["h200"].origin.endswith("h200.toml")
    assert get_device("my-box").kind == "cpu"


@pytest.mark.parametrize("text, key", [
    ('kind = "cuda"\nmemory = "1GB"\n', "name"),
    ('name = "x"\nkind = "tpu"\nmemory = "1GB"\n', "kind"),
    ('name = "x"\nkind = "cuda"\n', "memory"),
    ('name = "x"\nkind = "cuda"\nmemory = "lots"\n', "memory"),
    ('name = "x"\nkind = "cuda"\nmemory = "8GB"\nreserve = "9GB"\n', "reserve"),
    ('name = "x"\nkind = "cuda"\nmemory = "8GB"\nreserve = "150%"\n', "reserve"),
    ('name = "x"\nkind = "cuda"\nmemory = "8GB"\nbandwidth = "fast"\n', "bandwidth"),
    ('name = "x"\nkind = "cuda"\nmemory = "8GB"\n[efficiency]\ndecode_mbu = { 1 = 1.5 }\n', "efficiency.decode_mbu"),
    ('name = "x"\nkind = "cuda"\nmemory = "8GB"\ncolour = "green"\n', "colour"),
    ('name = "x"\nkind = "cuda"\nmemory = \n', None),
])
def test_malformed_profile_names_the_key(tmp_path, text, key):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ProfileError) as ei:
        load_profile_file(path)
    assert str(path) in str(ei.value)
    if key:
        assert ei.value.field == key and key in str(ei.value)


def test_malformed_user_profile_fails_load(tmp_path, monkeypatch):
    (tmp_path / "bad.toml").write_text("name = [")
    monkeypatch.setenv("LOCALINFER_PROFILES", str(tmp_path))
    with pytest.raises(ProfileError):
        load_profiles()


def test_reserve_policy():
    assert reserve_bytes("10%", 1000) == 100
    assert reserve_bytes("8GiB", 0) == 8 * GiB
    with pytest.raises(ValueError):
        reserve_bytes("-5%", 100)


def test_working_set_cap_limits_usable():
    p = profile_from_dict({"name": "mac", "kind": "metal", "memory": "96GB", "reserve": "8GiB",
                           "working_set_cap": "72GB"})
    assert p.unified and p.usable_bytes == 72 * GB


def test_local_device_reads_ram_without_torch():
    import psutil

    dev = local_device()
    assert isinstance(dev, DeviceProfile) and dev.name == "local"
    if dev.kind == "cpu":
        assert dev.memory_bytes == psutil.virtual_memory().total
    code = "import sys, localinfer.devices.profiles as d; d.local_device(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
