"""llama.cpp --fit's choice beside localinfer's plan over several devices (`fit --devices`, plan/split_fit.py), on
header-only skeletons: the flags are the port's (fit_cpp_split) for the same devices, and localinfer's plan fits
devices and host wherever --fit's does and is never predicted slower (issue 41's rule)."""

import json

import pytest

from gguf_tools.skeleton import write_skeleton
from localinfer.backends.llamacpp.split import split_breakdown
from localinfer.backends.memory import FitRequest
from localinfer.backends.split import SplitDevice
from localinfer.cli import main
from localinfer.devices.hosts import get_host
from localinfer.model.spec import ModelSpec
from localinfer.plan.fit_cpp import MARGIN, fit_cpp_split
from localinfer.plan.split import fit_split, split_speed
from localinfer.plan.split_devices import from_profiles
from localinfer.plan.split_fit import AS_FIT, SplitEnv, llamacpp_split_fit, split_plan

MiB = 1 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("split_fit")
    cache = {}

    def get(preset, qtype="q4_k_m"):
        if preset not in cache:
            cache[preset] = str(write_skeleton(preset, folder / f"{preset}.gguf", type=qtype))
        return cache[preset], ModelSpec.from_gguf(cache[preset])
    return get


def _fit(capsys, *argv) -> dict:
    assert main(["fit", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _port(spec, hosts, req, **kw) -> str:
    """The port's line for the profiles' devices (a profile's usable bytes are its target: free − the margin)."""
    return fit_cpp_split(spec, from_profiles(hosts).devices, req, margin=0, **kw).line()


def _obeys_the_rule(doc):
    plan, ref = doc["plan"], doc["llamacpp_fit"]
    assert plan is not None and plan["fits"] and plan["split"]["fits"]
    if ref is not None and ref["fits"]:
        assert plan["speed"]["decode_tok_s"] >= ref["speed"]["decode_tok_s"]


@pytest.mark.parametrize("hosts, flags, expect", [
    ("2x rtx-3090", [], "own"),                               # --fit's mapped host range is over the RAM
    ("2x rtx-3090", ["--no-mmap"], "fit"),                    # --fit's plan fits and is predicted faster (q8_0
                                                              # KV is, but by under 3%)
    ("rtx-4090,rtx-3090,rtx-3090", ["--host", "epyc-9004-12ch"], "q8_0"),   # q8_0 KV: 6% faster than --fit's
])
def test_moe_over_gpus_shows_fits_flags_and_keeps_the_rule(models, capsys, hosts, flags, expect):
    path, spec = models("qwen3-235b-a22b")
    doc = _fit(capsys, path, "--devices", hosts, "--ctx", "16384", *flags)
    req = FitRequest(n_ctx=16384, mmap="--no-mmap" not in flags)
    ref = doc["llamacpp_fit"]
    assert ref["flags"] == _port(spec, hosts, req)
    assert ref["flags"].startswith("-c 16384 -ngl 95 -ts ") and "exps=CPU" in ref["flags"]
    assert ref["experts_on_host"] > 0 and len(ref["dry_run_bytes"]) == len(ref["split"]["devices"])
    assert all(u <= t for u, t in zip(ref["dry_run_bytes"], ref["targets"]))     # within fit.cpp's targets
    _obeys_the_rule(doc)
    plan = doc["plan"]
    assert (plan["by"] == AS_FIT) == (expect == "fit")
    if expect == "fit":
        assert plan["flags"] == ref["flags"] and plan["why"].startswith("localinfer adopts --fit's plan")
        assert "-ctk q8_0 -ctv q8_0 -fa on would give " in plan["why"] and "under 3% better" in plan["why"]
    elif expect == "q8_0":
        assert plan["type_k"] == "q8_0" and plan["speed"]["decode_tok_s"] > 1.03 * ref["speed"]["decode_tok_s"]
        assert "KV q8_0 " in plan["why"] and f"against {ref['speed']['decode_tok_s']:.1f} tok/s" in plan["why"]
    else:
        assert not ref["fits_host"] and "--fit's plan does not fit: the host needs" in plan["why"]
        assert plan["n_cpu_moe"] > 0 and plan["host_total"] <= plan["host_usable"]


def test_the_text_shows_fits_line_bytes_and_speed(models, capsys):
    path, spec = models("qwen3-235b-a22b")
    assert main(["fit", path, "--devices", "2x rtx-3090", "--ctx", "16384", "--no-mmap"]) == 0
    out = capsys.readouterr().out
    line = _port(spec, "2x rtx-3090", FitRequest(n_ctx=16384, mmap=False))
    assert f"llama.cpp --fit: {line}\n" in out
    assert "  its plan: CUDA0[rtx-3090] " in out and "tok/s" in out
    assert f"localinfer's plan: {line} (--fit's)" in out and "why: localinfer adopts --fit's plan" in out


def test_dense_over_gpus(models, capsys):
    path, spec = models("llama-3.1-70b")
    doc = _fit(capsys, path, "--devices", "rtx-4090,rtx-4090", "--ctx", "32768")
    assert not doc["fits"] and doc["suggestion"] is None
    assert doc["llamacpp_fit"]["flags"] == _port(spec, "rtx-4090,rtx-4090", FitRequest(n_ctx=32768))
    assert doc["llamacpp_fit"]["split"]["host"]["weights"]        # layers below -ngl on the host
    _obeys_the_rule(doc)
    assert 0 < doc["plan"]["n_gpu_layers"] <= spec.n_layers


def test_with_ctx_left_out_fits_own_context_is_shown(models, capsys):
    path, spec = models("llama-3.1-70b")
    doc = _fit(capsys, path, "--devices", "rtx-4090,rtx-4090")
    auto = doc["llamacpp_fit_ctx_auto"]
    assert doc["ctx_given"] is False and doc["request"]["n_ctx"] == 4096
    assert auto["flags"] == _port(spec, "rtx-4090,rtx-4090", FitRequest(), ctx_auto=True)
    assert 4096 < auto["n_ctx"] < spec.n_ctx_train and "context lowered from" in auto["steps"][0]
    assert main(["fit", path, "--devices", "rtx-4090,rtx-4090"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp --fit with -c left out (it starts from the train context" in out and auto["flags"] in out
    assert "only when -c is left out, never a -c given" in out
    doc = _fit(capsys, path, "--devices", "rtx-4090,rtx-4090", "--ctx", "4096")
    assert doc["ctx_given"] is True and doc["llamacpp_fit_ctx_auto"] is None


def test_fit_gives_up_on_a_user_split_that_does_not_fit(models, capsys):
    path, _ = models("llama-3.1-70b")
    doc = _fit(capsys, path, "--devices", "rtx-4090,rtx-4090", "--ctx", "8192", "-ts", "1,3")
    assert doc["llamacpp_fit"] is None and doc["plan"]["fits"] and doc["plan"]["tensor_split"]
    assert main(["fit", path, "--devices", "rtx-4090,rtx-4090", "--ctx", "8192", "-ts", "1,3"]) == 0
    assert "llama.cpp --fit gives up: -ngl, -ot or -ts set by the user" in capsys.readouterr().out
    doc = _fit(capsys, path, "--devices", "rtx-4090,rtx-4090", "--ctx", "8192", "-ts", "1,1")   # fits as it is
    # the real llama-fit-params prints a user's -ts back (benchmarks/results/fit_params_devices.txt, "a user -ts
    # that fits as it is": "-c 4096 -ngl -1 -ts 3,4")
    assert doc["llamacpp_fit"]["flags"] == "-c 8192 -ngl -1 -ts 1,1" and doc["plan"]["by"] == "localinfer"


def test_worker_devices_reproduce_the_real_tools_line(models):
    """benchmarks/results/fit_params_devices.txt, "2 devices, MoE": two `worker --mem` devices (10240 + 8192 MiB),
    target free − 1 GiB; no profiles, so no speed: the plan keeping the least in host RAM, --fit's included."""
    _, spec = models("qwen3-30b-a3b")
    devs = (SplitDevice("RPC0[EP1]", "cpu", 10240 * MiB, 10240 * MiB),
            SplitDevice("RPC0[EP2]", "cpu", 8192 * MiB, 8192 * MiB))
    env = SplitEnv(devs, margin=MARGIN)
    req = FitRequest(n_ctx=4096)
    plan, ref = split_plan(spec, env, req, fit_split(spec, devs, req))
    assert ref.flags().startswith("-c 4096 -ngl 49 -ts 25,24 -ot \"blk\\.24\\.ffn_down.*=RPC0[EP2],")
    assert ref.flags() == llamacpp_split_fit(spec, env, req).flags() and ref.speed is None
    assert plan.fits and (not ref.fits or plan.breakdown.host_total <= ref.breakdown.host_total)


def test_host_weights_are_a_stage_of_the_split_speed(models):
    _, spec = models("qwen3-30b-a3b")
    setup = from_profiles("2x rtx-3090")
    req = FitRequest(n_ctx=4096)
    host = get_host("ddr5-5600-2ch")
    full = split_breakdown(spec, setup.devices, req)
    moe = FitRequest(n_ctx=4096, n_cpu_moe=24)
    part = split_breakdown(spec, setup.devices, moe)
    assert not full.host_tensors and {t for t in part.host_tensors if "_exps." in t}
    fast = split_speed(spec, full, req, setup.profiles, host=host)
    slow = split_speed(spec, part, moe, setup.profiles, host=host)
    assert [s.device for s in slow.stages][-1] == "host ddr5-5600-2ch" and slow.stages[-1].layers == 0
    assert slow.decode_tok_s < fast.decode_tok_s
    assert split_speed(spec, part, moe, setup.profiles) is None        # no host profile: no speed
    assert split_speed(spec, full, req, setup.profiles) == fast         # nothing on the host: no host needed


def test_unified_memory_puts_no_weights_in_host_ram(models, capsys):
    """On a Mac the host's RAM is the device's memory: no --n-cpu-moe plan, and --fit's experts on the CPU are
    judged on the one pool (its devices and host together)."""
    path, _ = models("qwen3-235b-a22b")
    doc = _fit(capsys, path, "--devices", "m2-max-96gb", "--ctx", "32768")
    ref = doc["llamacpp_fit"]
    assert ref["experts_on_host"] > 0 and not ref["fits_host"]
    assert ref["host_need"] == ref["host_total"] + sum(d["total"] for d in ref["split"]["devices"])
    assert doc["plan"] is None
