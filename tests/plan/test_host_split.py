"""A host in every plan, the speed of a split and the MoE placement search (issue 41 items 2-4), through the
public API on a tiny MoE skeleton and a small CUDA profile: structure, not typed-in answers."""

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from localinfer.backends.memory import FitRequest
from localinfer.devices.hosts import builtin_hosts, get_host, host_for, local_host, with_host
from localinfer.devices.profiles import get_device
from localinfer.errors import UsageError
from localinfer.plan.fit import fit_device
from localinfer.plan.host_speed import plan_speed
from localinfer.plan.moe_fit import llamacpp_fit, moe_plan
from localinfer.plan.speed import predict_speed
from tests.support.tiny_moe import tiny_moe


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_moe(tmp_path_factory.mktemp("host_split"), "f16")


def _req(**kw):
    return FitRequest(n_ctx=2048, **kw)


def test_every_host_profile_cites_its_figures():
    hosts = builtin_hosts()
    assert {"ddr5-5600-2ch", "ddr4-3200-2ch", "threadripper-pro-8ch", "epyc-9004-12ch"} <= set(hosts)
    for h in hosts.values():
        for key in ("memory", "bandwidth", "cores", "decode_mbu"):
            assert h.source(key), (h.name, key)
        assert 0 < h.usable_bytes < h.memory_bytes
    assert hosts["ddr5-5600-2ch"].bandwidth_bytes_per_s == 5600e6 * 8 * 2     # JEDEC rate × 64-bit × 2 channels


def test_hosts_by_device_and_by_name():
    assert host_for(get_device("rtx-4090")).name == "ddr5-5600-2ch"
    assert host_for(get_device("rtx-4090"), "epyc-9004-12ch").name == "epyc-9004-12ch"
    m = host_for(get_device("m2-max-96gb"))
    assert m.unified and m.memory_bytes == get_device("m2-max-96gb").memory_bytes
    local = local_host()
    assert local.memory_bytes > 0 and local.cores >= 1 and "not probed" in local.source("bandwidth")
    with pytest.raises(UsageError, match="--host"):
        get_host("no-such-host")


def test_the_verdict_fails_when_the_host_part_does_not_fit(model, gpu):
    req = _req(n_cpu_moe=8)
    assert fit_device(model, with_host(gpu, get_host("ddr5-5600-2ch")), req, search=False).fits
    small = replace(get_host("ddr5-5600-2ch"), memory_bytes=200 << 20, reserve="0")
    r = fit_device(model, with_host(gpu, small), req, search=False)
    assert not r.fits and "host" in r.reason


def test_split_decode_is_the_all_gpu_figure_at_zero_and_slows_with_each_layer(model, gpu):
    host = host_for(gpu)
    big = replace(gpu, memory_bytes=8 << 30)
    whole = predict_speed(model, big, _req())
    assert plan_speed(model, big, host, _req(n_cpu_moe=0))["decode_tok_s"] == whole["decode_tok_s"]
    rates = [plan_speed(model, big, host, _req(n_cpu_moe=n))["decode_tok_s"] for n in range(model.n_layers + 1)]
    assert all(a > b for a, b in zip(rates, rates[1:]))
    assert rates[-1] < whole["decode_tok_s"]


def test_host_bandwidth_matters_only_for_what_the_host_holds(model, gpu):
    slow, fast = get_host("ddr4-3200-2ch"), get_host("epyc-9004-12ch")
    split = _req(n_cpu_moe=4)
    assert plan_speed(model, gpu, fast, split)["decode_tok_s"] > plan_speed(model, gpu, slow, split)["decode_tok_s"]
    big = replace(gpu, memory_bytes=8 << 30)
    assert plan_speed(model, big, fast, _req())["decode_tok_s"] == plan_speed(model, big, slow, _req())["decode_tok_s"]


def test_prefill_copies_host_weights_per_ubatch_or_computes_on_the_host(model, gpu):
    host = host_for(gpu)
    a = plan_speed(model, gpu, host, _req(n_cpu_moe=2))
    b = plan_speed(model, gpu, host, _req(n_cpu_moe=6))
    assert b["ttft_s"] > a["ttft_s"] and "link" in a["prefill_rule"]
    small_ub = plan_speed(model, gpu, host, _req(n_cpu_moe=2, n_ubatch=16))
    assert "host computes" in small_ub["prefill_rule"] and math.isfinite(small_ub["ttft_s"])


def test_the_search_fits_and_is_never_slower_than_fit_cpp(model, gpu):
    host = host_for(gpu)
    req = _req()
    assert not fit_device(model, with_host(gpu, host), req, search=False).fits
    ours, ref = moe_plan(model, gpu, host, req), llamacpp_fit(model, gpu, host, req)
    assert ours is not None and ours.fits and ref is not None
    assert ours.decode_tok_s >= ref.decode_tok_s
    assert "--n-cpu-moe" in ours.flags() or "-ot" in ours.flags()
    assert ours.why
    # one layer's experts fewer on the host than the plan keeps does not fit the device
    if ours.request.n_cpu_moe and not ours.partial:
        tighter = replace(ours.request, n_cpu_moe=ours.request.n_cpu_moe - 1)
        assert not fit_device(model, gpu, tighter, search=False).fits


def test_fit_cli_shows_the_host_and_the_plan(model, tmp_path):
    prof = tmp_path / "tiny.toml"
    prof.write_text('name = "tiny-gpu"\nkind = "cuda"\nmemory = "500MiB"\nbandwidth = "1000GB/s"\n'
                    'bf16_flops = 100e12\nlink = { name = "PCIe", per_direction = "32GB/s" }\nhost = "ddr5-5600-2ch"\n')
    env = {"LOCALINFER_PROFILES": str(prof), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "localinfer", "fit", model.path, "--device", "tiny-gpu", "-c", "2048"]
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env, check=True).stdout
    d = json.loads(out)["devices"][0]
    assert d["host"]["name"] == "ddr5-5600-2ch" and d["host"]["usable_bytes"] > 0
    assert d["moe_plan"]["fits"] and d["plan_speed"]["decode_tok_s"] > 0
    text = subprocess.run(cmd + ["--host", "ddr4-3200-2ch"], capture_output=True, text=True, env=env, check=True).stdout
    text = " ".join(text.split())                  # the report wraps at 100 columns
    assert "host ddr4-3200-2ch" in text and "llama-server" in text and "of the plan above" in text


def test_the_ttft_objective_trades_decode_for_the_first_token(model, gpu):
    """--objective ttft: the plan with the shortest predicted time to the first token of a prompt filling the
    context (larger -ub tried: fewer copies of the host experts over the link), never slower to it than the
    decode plan or --fit's; the decode plan is never slower to decode; both say both speeds."""
    host = host_for(gpu)
    req = _req()
    dec, ttft, ref = (moe_plan(model, gpu, host, req), moe_plan(model, gpu, host, req, "ttft"),
                      llamacpp_fit(model, gpu, host, req))
    assert ttft.fits and ttft.speed["ttft_s"] <= min(dec.speed["ttft_s"], ref.speed["ttft_s"])
    assert dec.decode_tok_s >= ttft.decode_tok_s
    assert "TTFT" in dec.why and "TTFT" in ttft.why
    if ttft.request.n_ubatch != req.n_ubatch:
        assert f"-ub {ttft.request.n_ubatch}" in ttft.flags() and req.n_ubatch < ttft.request.n_ubatch <= req.n_batch
    with pytest.raises(UsageError, match="--objective"):
        moe_plan(model, gpu, host, req, "throughput")


def test_fit_cli_takes_the_objective(model, tmp_path):
    prof = tmp_path / "tiny.toml"
    prof.write_text('name = "tiny-gpu"\nkind = "cuda"\nmemory = "500MiB"\nbandwidth = "1000GB/s"\n'
                    'bf16_flops = 100e12\nlink = { name = "PCIe", per_direction = "32GB/s" }\nhost = "ddr5-5600-2ch"\n')
    env = {"LOCALINFER_PROFILES": str(prof), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "localinfer", "fit", model.path, "--device", "tiny-gpu", "-c", "2048", "--json"]
    plans = {o: json.loads(subprocess.run(cmd + ["--objective", o], capture_output=True, text=True, env=env,
                                          check=True).stdout)["devices"][0]["moe_plan"] for o in ("decode", "ttft")}
    assert plans["ttft"]["speed"]["ttft_s"] <= plans["decode"]["speed"]["ttft_s"]
    assert plans["decode"]["speed"]["decode_tok_s"] >= plans["ttft"]["speed"]["decode_tok_s"]
