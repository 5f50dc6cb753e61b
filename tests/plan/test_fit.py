"""fit_device / check_load and the `localinfer fit` / `localinfer devices` commands."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from gguf_tools.skeleton import write_skeleton
from localinfer.backends.engine import LoadPlan
from localinfer.backends.memory import FitRequest
from localinfer.cli import main
from localinfer.devices.profiles import profile_from_dict
from localinfer.errors import UsageError
from localinfer.model.spec import ModelSpec
from localinfer.plan.fit import check_load, fit_device
from localinfer.units import GiB, MiB

TINY = dict(arch="qwen3", n_layers=8, n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_ff=1024, vocab_size=4096,
            context_length=32768, type="f16")


@pytest.fixture(autouse=True)
def _profiles(monkeypatch, tmp_path_factory):
    d = tmp_path_factory.mktemp("profiles")
    (d / "small-gpu.toml").write_text('name = "small-gpu"\nkind = "cuda"\nmemory = "40MiB"\n'
                                      'host_memory = "1GiB"\n')
    monkeypatch.setenv("LOCALINFER_PROFILES", str(d))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_skeleton(TINY, tmp_path_factory.mktemp("m") / "tiny.gguf")


@pytest.fixture(scope="module")
def spec(model):
    return ModelSpec.from_gguf(model)


def device(memory, kind="cuda", **extra):
    return profile_from_dict({"name": "test", "kind": kind, "memory": memory, **extra})


def test_fits_with_room(spec):
    r = fit_device(spec, device("8GiB"), FitRequest(n_ctx=4096))
    assert r.fits and r.reason.startswith("fits") and r.free_bytes == r.usable_bytes - r.needed
    bd = r.breakdown
    assert bd.device_bytes == bd.sum(pool="device") and bd.weights > 0 and bd.kv > 0 and bd.compute > 0
    assert all(t.formula for t in bd.terms)
    assert "-c 4096" in r.command and "-ngl 999" in r.command


def test_does_not_fit_suggestions_really_fit(spec):
    dev = device("64MiB")
    req = FitRequest(n_ctx=32768)
    r = fit_device(spec, dev, req)
    assert not r.fits and "over" in r.reason and r.suggestions
    assert r.max_ctx and fit_device(spec, dev, replace(req, n_ctx=r.max_ctx), search=False).fits
    assert not fit_device(spec, dev, replace(req, n_ctx=r.max_ctx + 256), search=False).fits
    assert f"--ctx {r.max_ctx}" in r.suggestions
    if r.kv_type:
        t = r.kv_type
        assert fit_device(spec, dev, replace(req, type_k=t, type_v=t, flash_attn=True), search=False).fits


def test_max_parallel_is_the_largest(spec):
    dev = device("96MiB")
    r = fit_device(spec, dev, FitRequest(n_ctx=2048))
    assert r.max_parallel and r.max_parallel > 1
    assert fit_device(spec, dev, FitRequest(n_ctx=2048, n_seq=r.max_parallel), search=False).fits
    assert not fit_device(spec, dev, FitRequest(n_ctx=2048, n_seq=r.max_parallel + 1), search=False).fits


def test_offload_keeps_as_many_layers_as_fit(spec):
    dev = device("32MiB", host_memory="1GiB")
    r = fit_device(spec, dev, FitRequest(n_ctx=2048))
    assert not r.fits and r.offload is not None
    n = r.offload.gpu_layers
    assert 0 < n < spec.n_layers and f"--gpu-layers {n}" in r.suggestions and f"-ngl {n}" in r.command
    assert fit_device(spec, dev, FitRequest(n_ctx=2048, n_gpu_layers=n), search=False).fits
    assert not fit_device(spec, dev, FitRequest(n_ctx=2048, n_gpu_layers=n + 1), search=False).fits
    assert r.offload.host_bytes > 0


def test_host_memory_limits_offload(spec):
    dev = device("20MiB", host_memory="1MiB")
    r = fit_device(spec, dev, FitRequest(n_ctx=2048, n_gpu_layers=2))
    assert not r.fits and "host" in r.reason


def test_unified_working_set_cap(spec):
    dev = device("1GiB", kind="metal", working_set_cap="30MiB")
    r = fit_device(spec, dev, FitRequest(n_ctx=32768))
    assert not r.fits and "working-set cap" in r.reason and r.usable_bytes == 30 * MiB


def test_cpu_device_counts_everything(spec):
    r = fit_device(spec, device("8GiB", kind="cpu"), FitRequest(n_ctx=1024))
    assert r.breakdown.unified and r.breakdown.host_bytes == 0 and "-ngl 0" in r.command


@pytest.mark.parametrize("kwargs, flag", [({"n_ctx": 0}, "--ctx"), ({"n_seq": 0}, "--parallel"),
                                          ({"type_k": "q9"}, "-ctk"), ({"type_v": "nope"}, "-ctv"),
                                          ({"n_gpu_layers": -2}, "--gpu-layers"), ({"backend": "x"}, "--backend"),
                                          ({"type_v": "q8_0", "flash_attn": False}, "--flash-attn")])
def test_bad_requests_name_the_flag(kwargs, flag):
    with pytest.raises(UsageError) as ei:
        FitRequest(**kwargs)
    assert ei.value.flag == flag


def test_check_load_uses_the_plan(spec, model):
    dev = device("8GiB")
    plan = LoadPlan(str(model), n_ctx=3000, n_seq=3, type_k="q8_0", type_v="q8_0")
    r = check_load(spec, plan, device=dev)
    assert r.fits and r.cells.n_ctx == 3072 and r.cells.n_stream == 3
    assert r.needed == r.breakdown.device_bytes and r.available == dev.usable_bytes
    tight = check_load(spec, plan, device=device("40MiB"))
    assert not tight.fits and tight.reason and tight.suggestions


def test_other_backends(spec):
    r = fit_device(spec, device("8GiB"), FitRequest(n_ctx=1000, backend="torch"))
    assert r.fits and r.breakdown.kv == 1008 * 8 * 2 * 64 * 2 * 2 and r.command == ""


# ---- the commands -----------------------------------------------------------------------------

def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_ctx_beyond_training_needs_declared_rope_scaling(tmp_path, capsys):
    """A scaling type, or only the older rope.scale_linear factor (llama.cpp applies it as
    linear scaling), lets --ctx pass the trained context; neither: refused, naming --ctx."""
    from gguf import GGUFValueType as V

    from tests.support.ggufgen import write_tiny_model

    plain = write_tiny_model(tmp_path / "plain.gguf", n_embd=128, n_ff=128, ctx=512)     # heads of 32: q8_0 K fits
    linear = write_tiny_model(tmp_path / "linear.gguf", n_embd=128, n_ff=128, ctx=512,
                              extra_kv={"llama.rope.scale_linear": (4.0, V.FLOAT32)})
    code, _, err = run_cli(capsys, "fit", str(plain), "--ctx", "2048", "--device", "local")
    assert code != 0 and "--ctx 2048" in err and "RoPE scaling" in err and "Traceback" not in err
    code, out, err = run_cli(capsys, "fit", str(linear), "--ctx", "2048", "--device", "local")
    assert code == 0, err
    assert "2048" in out


def test_fit_and_plan_share_the_trained_context_rule_and_the_kv_check(tmp_path, capsys):
    from gguf import GGUFValueType as V

    from localinfer.model.kv import check_kv_type
    from tests.support.ggufgen import write_tiny_model

    plain = write_tiny_model(tmp_path / "plain.gguf", n_embd=128, n_ff=128, ctx=512)     # heads of 32: q8_0 K fits
    linear = write_tiny_model(tmp_path / "linear.gguf", n_embd=128, n_ff=128, ctx=512,
                              extra_kv={"llama.rope.scale_linear": (4.0, V.FLOAT32)})
    assert ModelSpec.from_gguf(plain).context_limit == 512 and ModelSpec.from_gguf(linear).context_limit is None
    for argv, ok in ((["fit", str(plain), "--ctx", "512"], True), (["fit", str(plain), "--ctx", "513"], False),
                     (["plan", str(plain), "--input", "500", "--output", "12"], True),
                     (["plan", str(plain), "--input", "500", "--output", "13"], False),
                     (["plan", str(linear), "--input", "500", "--output", "13"], True)):
        code, _, err = run_cli(capsys, *argv, "--device", "h200")
        assert (code == 0) == ok and ("trained context 512" in err) != ok, (argv, err)
    for flag in ("--kv-type", "-ctk", "-ctv"):
        code, _, err = run_cli(capsys, "fit", str(plain), flag, "f17", "--device", "h200")
        want = pytest.raises(UsageError, check_kv_type, "f17", flag).value
        assert code != 0 and f"error: {want}" in err and want.hint in err
    code, out, _ = run_cli(capsys, "fit", str(plain), "-ctk", "Q8_0", "--device", "h200", "--json")
    assert code == 0 and json.loads(out)["request"]["type_k"] == "q8_0" and json.loads(out)["request"]["type_v"] == "f16"


def test_fit_text_reads_at_100_columns(capsys, model):
    code, out, err = run_cli(capsys, "fit", str(model), "--ctx", "8192", "--device", "small-gpu", "h200", "local")
    assert code == 0, err
    assert "small-gpu" in out and "h200" in out and "local" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "llama-cli" in out


def test_fit_json_has_every_term_and_formula(capsys, model):
    code, out, _ = run_cli(capsys, "fit", str(model), "--json", "--device", "small-gpu", "--parallel", "2",
                           "--kv-type", "q8_0")
    assert code == 0
    data = json.loads(out)
    assert data["request"]["type_k"] == "q8_0" and data["request"]["n_seq"] == 2
    dev = data["devices"][0]
    assert dev["device"]["name"] == "small-gpu" and dev["device"]["usable_formula"]
    terms = dev["breakdown"]["terms"]
    assert {t["key"] for t in terms} >= {"weights", "kv", "output", "compute"}
    assert all(t["formula"] for t in terms)
    assert dev["breakdown"]["total"] == sum(t["bytes"] for t in terms)
    assert data["model"]["kv_bytes_per_token"] > 0


def test_fit_default_is_every_profile(capsys):
    code, out, _ = run_cli(capsys, "fit", "--json")
    assert code == 0
    names = [d["device"]["name"] for d in json.loads(out)["devices"]]
    assert names[0] == "local" and {"rtx-pro-6000", "m2-max-96gb", "h200", "small-gpu"} <= set(names)


@pytest.mark.parametrize("args, flag", [(["--ctx", "0"], "--ctx"), (["--ctx", "100000000"], "--ctx"),
                                        (["--kv-type", "q3"], "--kv-type"), (["-ctk", "zz"], "-ctk"),
                                        (["--kv-type", "q8_0", "-ctv", "q4_0"], "--kv-type"),
                                        (["--device", "nope"], "--device"), (["-fa", "maybe"], "--flash-attn"),
                                        (["--parallel", "0"], "--parallel"), (["--gpu-layers", "-5"], "--gpu-layers")])
def test_fit_bad_input(capsys, model, args, flag):
    code, out, err = run_cli(capsys, "fit", str(model), *args)
    assert code == 2 and out == ""
    assert err.startswith("error:") and flag in err and "Traceback" not in err


def test_fit_malformed_user_profile(capsys, monkeypatch, tmp_path, model):
    (tmp_path / "bad.toml").write_text('name = "bad"\nkind = "cuda"\nmemory = "lots"\n')
    monkeypatch.setenv("LOCALINFER_PROFILES", str(tmp_path))
    code, _, err = run_cli(capsys, "fit", str(model))
    assert code != 0 and "bad.toml" in err and "memory" in err


def test_devices_command(capsys):
    code, out, _ = run_cli(capsys, "devices")
    assert code == 0 and "rtx-pro-6000" in out and "small-gpu" in out and "local" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    code, out, _ = run_cli(capsys, "devices", "m2-max-96gb")
    assert code == 0 and "81.41 GiB" in out and "sources:" in out
    code, out, _ = run_cli(capsys, "devices", "--json")
    rows = json.loads(out)
    assert any(r["name"] == "h100-sxm" and r["sources"]["memory"] for r in rows)


def test_fit_never_imports_heavy_backends(model):
    """Nor numpy: importing it (and starting OpenBLAS) was ~0.1 s of the command's 0.5 s budget on an 80 GiB
    skeleton (benchmarks/fit_speed.py)."""
    code = ("import sys; from localinfer.cli import main; "
            f"assert main(['fit', {str(model)!r}, '--json']) == 0; "
            "bad = {'torch', 'llama_cpp', 'mlx', 'numpy'} & set(sys.modules); assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-500:]


def test_example_instance_fits_on_the_rtx_pro_6000(tmp_path):
    spec = ModelSpec.from_gguf(write_skeleton("qwen3-8b", tmp_path / "q.gguf", type="bf16"))
    from localinfer.devices.profiles import get_device

    r = fit_device(spec, get_device("rtx-pro-6000"), FitRequest(n_ctx=8192, n_seq=16))
    assert r.fits and r.breakdown.kv == 16 * 1152 * MiB and r.needed < 96 * GiB
