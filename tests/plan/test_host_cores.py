"""The host part of a split decode step is bound by the host's RAM or by its cores, whichever is slower
(issue 41 item 4): through the public API on a tiny MoE skeleton, structure rather than typed-in answers."""

from dataclasses import replace

import pytest

from localinfer.backends.memory import FitRequest
from localinfer.devices.hosts import (DECODE_FLOPS_PER_CORE, FALLBACK_MBU, NUMA_SHARE, _parse, builtin_hosts,
                                      get_host)
from localinfer.errors import ProfileError
from localinfer.plan.host_speed import plan_speed
from tests.support.tiny_moe import tiny_moe

HOST = {"name": "h", "memory": "64GB", "bandwidth": "400GB/s", "cores": 8}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_moe(tmp_path_factory.mktemp("host_cores"), "q8_0")


def _terms(sp, host):
    """(the host's memory time, its compute time) for the bytes and FLOPs the step says the host handles."""
    return (sp["host_read_bytes"] / (host.bandwidth_bytes_per_s * host.decode_mbu),
            sp["host_flops"] / (host.cores * host.decode_flops_per_core))


def test_the_host_part_is_the_slower_of_its_ram_and_its_cores(model, gpu):
    req = FitRequest(n_ctx=2048, cpu_moe=True)
    server = get_host("epyc-9004-12ch")
    for cores, bound in ((1, "host compute"), (server.cores, "host memory")):
        host = replace(server, cores=cores)
        sp = plan_speed(model, gpu, host, req)
        mem, comp = _terms(sp, host)
        assert sp["host_flops"] > 0 and sp["host_s"] == pytest.approx(max(mem, comp))
        assert sp["decode_bound"] == bound
        assert sp["decode_step_s"] == pytest.approx(sp["gpu_s"] + sp["host_s"])


def test_host_time_falls_with_cores_until_the_ram_binds(model, gpu):
    req = FitRequest(n_ctx=2048, n_cpu_moe=6)
    base = get_host("threadripper-pro-8ch")
    steps = []
    for cores in (1, 2, 4, 8, 16, 32, 64, 128):
        host = replace(base, cores=cores)
        sp = plan_speed(model, gpu, host, req)
        steps.append((sp["host_s"], _terms(sp, host)))
    times = [t for t, _ in steps]
    assert all(a >= b for a, b in zip(times, times[1:]))
    assert times[0] == pytest.approx(2 * times[1])                       # compute-bound: twice the cores, half
    mem = steps[-1][1][0]
    assert times[-1] == pytest.approx(mem) and times[-2] == pytest.approx(mem)  # enough cores: the RAM's time


def test_the_rate_a_core_reaches_is_fitted_and_cited():
    for h in builtin_hosts().values():
        assert h.decode_flops == h.cores * h.decode_flops_per_core
        assert "offload_published" in h.source("decode_flops_per_core")
        assert h.to_dict()["sources"]["decode_flops_per_core"]
    default = _parse(dict(HOST), "test")
    assert default.decode_flops_per_core == DECODE_FLOPS_PER_CORE
    own = _parse({**HOST, "decode_flops_per_core": 12e9}, "test")
    assert own.decode_flops == 8 * 12e9
    for bad in (0, -1, True, "fast"):
        with pytest.raises(ProfileError, match="decode_flops_per_core"):
            _parse({**HOST, "decode_flops_per_core": bad}, "test")


def test_two_sockets_read_at_the_numa_share_of_one(model, gpu):
    """A two-socket host's decode reads at NUMA_SHARE of one socket's bandwidth (devices/hosts.py: measured on a Xeon
    8480+ with one socket and with two), not at both sockets' sum: slower than one of its sockets alone."""
    two = _parse({**HOST, "sockets": 2, "bandwidth": "800GB/s", "cores": 128}, "test")
    one = _parse({**HOST, "sockets": 1, "bandwidth": "400GB/s", "cores": 64}, "test")   # enough cores: RAM binds
    assert two.effective_bandwidth == pytest.approx(NUMA_SHARE * one.effective_bandwidth)
    assert two.effective_bandwidth < one.effective_bandwidth
    assert "discussions/396" in two.source("sockets") and two.to_dict()["sockets"] == 2
    assert one.source("sockets") == "" and "sockets" not in one.to_dict()["sources"]
    req = FitRequest(n_ctx=2048, cpu_moe=True)
    sp1, sp2 = plan_speed(model, gpu, one, req), plan_speed(model, gpu, two, req)
    assert sp1["decode_bound"] == sp2["decode_bound"] == "host memory"
    assert sp2["host_s"] == pytest.approx(sp1["host_s"] / NUMA_SHARE)
    for bad in (0, 9, True, "2"):
        with pytest.raises(ProfileError, match="sockets"):
            _parse({**HOST, "sockets": bad}, "test")


def test_profiles_without_a_measured_mbu_take_the_fitted_one():
    for name in ("ddr4-3200-2ch", "ddr5-5600-2ch", "grace-lpddr5x"):
        h = get_host(name)
        assert h.decode_mbu == FALLBACK_MBU and "offload_published" in h.source("decode_mbu")
    plain = _parse(dict(HOST), "test")
    assert plain.decode_mbu == FALLBACK_MBU and "offload_published" in plain.source("decode_mbu")
