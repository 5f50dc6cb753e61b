"""`localinfer fit` also says how fast the model will run, from the profile alone."""

from __future__ import annotations

import json

import pytest

from gguf_tools.skeleton import write_skeleton
from localinfer.cli import main
from localinfer.devices.kernels import coefficients
from localinfer.devices.profiles import get_device
from localinfer.model.cost import model_cost
from localinfer.model.spec import ModelSpec
from localinfer.plan.speed import SpeedModel


def _fit_json(capsys, *argv) -> dict:
    assert main(["fit", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama_cpp_decode_is_fixed_time_plus_each_types_bytes_over_its_bandwidth_share(tmp_path, capsys):
    # docs/speed.md: t_token + n_layer·t_layer + Σ_type D_type/(β·e_type) + L·k/(β·e_kv), from the profile's kind
    path = write_skeleton("qwen3-8b", tmp_path / "q8b.gguf", type="q4_k_m")
    doc = _fit_json(capsys, str(path), "--ctx", "2048", "--device", "rtx-4090")
    speed = doc["devices"][0]["speed"]
    spec, dev = ModelSpec.from_gguf(path), get_device("rtx-4090")
    c = coefficients(dev)
    types = {t.type.name for t in spec.tensors}
    assert len(types) >= 3                               # Q4_K_M mixes Q4_K, Q6_K and F32: each its own share
    beta = dev.bandwidth_bytes_per_s
    fixed = c.token_s + spec.n_layers * c.layer_s
    weights = sum(t.n_bytes / (beta * c.bandwidth_fraction(t.type.name.lower()))
                  for t in spec.tensors if t.name != "token_embd.weight")
    kv = model_cost(spec).kv_read_bytes(2048) / (beta * c.bandwidth_fraction("f16"))
    assert speed["decode_bound"] == "memory"
    assert speed["decode_step_s"] == pytest.approx(fixed + weights + kv, rel=1e-9)
    assert speed["decode_fixed_s"] == pytest.approx(fixed, rel=1e-9)
    cal = speed["speed_calibration"]
    assert cal["this_device_calibrated"] and "rtx-4090" in cal["calibrated_on"]
    assert 0 < speed["decode_error"] < 1 and 0 < speed["prefill_error"] < 2


def test_a_tiny_model_on_a_big_gpu_is_bound_by_the_fixed_time_not_its_bytes(capsys):
    # SmolLM2-135M reads ≈ 0.1 GB a token: at 4.8 TB/s that is ≈ 20 µs, the 30 layers' fixed time far more
    doc = _fit_json(capsys, "--device", "h200", "--ctx", "4096")
    speed = doc["devices"][0]["speed"]
    assert speed["decode_fixed_s"] > 0.5 * speed["decode_step_s"]
    assert speed["decode_tok_s"] < 2000                  # the old roofline said 8,295
    assert not speed["speed_calibration"]["this_device_calibrated"]


def test_the_chapters_vllm_roofline_is_still_the_speed_models_without_kernels(tmp_path):
    # SPEC §8.2/8.6: Qwen3-8B BF16, 2K context, batch 1 measured 26.26 ms per step on the RTX PRO 6000 with
    # vLLM; the profile's 33% decode MBU reproduces it (the roofline every non-llama.cpp figure uses)
    spec = ModelSpec.from_gguf(write_skeleton("qwen3-8b", tmp_path / "q8b.gguf"))
    step = SpeedModel(model_cost(spec), get_device("rtx-pro-6000")).decode_step(1, 2048)
    assert step.bound == "memory"
    assert abs(step.seconds - 26.26e-3) / 26.26e-3 < 0.02


def test_no_speed_where_the_profile_has_no_bandwidth(capsys):
    doc = _fit_json(capsys, "--device", "local")
    assert doc["devices"][0]["speed"] is None


def test_text_report_prints_the_predicted_speed(tmp_path, capsys):
    path = write_skeleton("qwen3-8b", tmp_path / "q8b.gguf", type="q4_0")
    assert main(["fit", str(path), "--device", "h200", "--ctx", "8192"]) == 0
    out = capsys.readouterr().out
    assert "speed (predicted, 1 request, 8K context)" in out and "decode" in out
