"""llama.cpp's kernel coefficients: per-kind defaults, a device's own scales, and what the speed model does with them."""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import pytest

from gguf_tools.skeleton import write_skeleton
from localinfer.devices.kernels import MAX_FRACTION, coefficients, kind_defaults
from localinfer.devices.profiles import get_device, load_profiles, profile_from_dict
from localinfer.errors import ProfileError
from localinfer.model.spec import ModelSpec
from localinfer.plan.kernel_speed import kernel_speed, weight_groups

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"


@pytest.fixture(autouse=True)
def _no_user_profiles(monkeypatch):
    monkeypatch.setenv("LOCALINFER_PROFILES", "")


def test_every_kind_ships_fitted_coefficients_calibrated_on_built_in_devices():
    profiles = load_profiles()
    for backend in ("cuda", "metal", "vulkan", "rocm"):
        k = kind_defaults(backend)
        assert k["backend"] == backend and "fit" in k["sources"]
        assert k["calibrated_on"] and set(k["calibrated_on"]) <= set(profiles)
        assert 0 < k["decode_bw"]["default"] <= MAX_FRACTION
        assert k["error"]["decode"] and k["error"]["prefill"]
    assert kind_defaults("cpu") == {}                  # the CPU path is calibrated by `localinfer bench`
    assert coefficients(get_device("local")) is None


def test_a_devices_scales_multiply_its_kinds_fractions_up_to_the_cap():
    dev = get_device("h100-pcie")
    base = coefficients(dataclasses.replace(dev, llamacpp={}))
    own = coefficients(dev)
    ds, ps = dev.llamacpp["decode_scale"], dev.llamacpp["prefill_scale"]
    for t, v in base.decode_bw.items():
        if t != "moe":
            assert own.decode_bw[t] == pytest.approx(min(MAX_FRACTION, v * ds))
    assert own.prefill["quant"] == pytest.approx(min(MAX_FRACTION, base.prefill["quant"] * ps))
    assert own.token_s == base.token_s and own.origin == "profile:cuda" and base.origin == "kind:cuda"
    # a device without a table of its own runs on its kind's defaults (for its memory class)
    pro = get_device("rtx-pro-6000")
    assert coefficients(pro).decode_bw == coefficients(dataclasses.replace(dev, llamacpp={}, memory_type=pro.memory_type)).decode_bw


def test_the_memory_class_scales_the_kinds_decode_fractions():
    h100 = dataclasses.replace(get_device("h100-pcie"), llamacpp={})
    plain = coefficients(dataclasses.replace(h100, memory_type=None))
    hbm = kind_defaults("cuda")["memory_scale"]["hbm"]
    assert h100.memory_class == "hbm" and get_device("rtx-4090").memory_class == "gddr"
    assert coefficients(h100).decode_bw["default"] == pytest.approx(min(MAX_FRACTION, plain.decode_bw["default"] * hbm))
    assert coefficients(h100).prefill == plain.prefill
    assert coefficients(dataclasses.replace(h100, memory_type="GDDR6X")).decode_bw == plain.decode_bw


@pytest.mark.parametrize("value", ["SRAM", "HBM", 3, "GDDR6X-ECC"])
def test_a_bad_memory_type_names_the_field(value):
    with pytest.raises(ProfileError) as e:
        profile_from_dict({"name": "mine", "kind": "cuda", "memory": "24GB", "memory_type": value}, "mine.toml")
    assert e.value.field == "memory_type"


def _volta():
    return profile_from_dict({"name": "volta", "kind": "cuda", "memory": "16GB", "memory_type": "HBM2",
                              "bandwidth": "900GB/s", "fp16_flops": 112e12}, "volta.toml")


def test_a_part_without_int8_tensor_cores_prefills_quantized_weights_through_an_f16_copy(tmp_path):
    volta = _volta()
    q4 = ModelSpec.from_gguf(write_skeleton("qwen2.5-0.5b", tmp_path / "q.gguf", type="q4_0"))
    f16 = ModelSpec.from_gguf(write_skeleton("qwen2.5-0.5b", tmp_path / "f.gguf", type="f16"))
    ks, ks16 = kernel_speed(q4, volta), kernel_speed(f16, volta)
    assert ks.dequant and math.isfinite(ks.decode(1, 600).seconds)
    # the same F16 GEMM as the F16 model, after a conversion pass: slower than it, and than INT8 MMQ would be
    assert ks.prefill(1, 512).compute_s == pytest.approx(ks16.prefill(1, 512).compute_s, rel=0.05)
    assert ks.prefill(1, 512).seconds > ks16.prefill(1, 512).seconds
    turing = dataclasses.replace(volta, int8_ops=224e12)
    assert not kernel_speed(q4, turing).dequant
    # below 64 tokens a micro-batch takes the quantized kernel (no conversion)
    assert ks.prefill(1, 32).bytes < ks16.prefill(1, 32).bytes


def test_a_part_without_a_bf16_rate_runs_bf16_weights_at_its_fp16_rate(tmp_path):
    volta = _volta()
    spec = ModelSpec.from_gguf(write_skeleton("qwen2.5-0.5b", tmp_path / "b.gguf", type="bf16"))
    both = dataclasses.replace(volta, bf16_flops=112e12)
    assert kernel_speed(spec, volta).prefill(1, 512).seconds == pytest.approx(
        kernel_speed(spec, both).prefill(1, 512).seconds)


def test_an_older_build_era_replaces_only_the_figures_its_table_names():
    dev = get_device("rtx-4090")
    eras = kind_defaults("cuda")["eras"]
    now, then = coefficients(dev), coefficients(dev, "2025")
    assert then.token_s == pytest.approx(eras["2025"]["token_us"] * 1e-6)
    assert then.decode_bw == now.decode_bw and then.prefill == now.prefill
    assert coefficients(dev, "no such era") == now
    with pytest.raises(ProfileError):
        profile_from_dict({"name": "mine", "kind": "cuda", "memory": "24GB", "bandwidth": "1TB/s",
                           "bf16_flops": 1e14, "llamacpp": {"eras": {"old": {"token_us": -1}}}}, "mine.toml")


@pytest.mark.parametrize("table, field", [
    ({"decode_scale": 40}, "llamacpp.decode_scale"), ({"backend": "opencl"}, "llamacpp.backend"),
    ({"prefill": {"quant": 1.5}}, "llamacpp.prefill.quant"), ({"speed": 1}, "llamacpp.speed"),
    ({"prefill": {"tensor": 0.5}}, "llamacpp.prefill.tensor"), ({"token_us": -3}, "llamacpp.token_us")])
def test_a_bad_llamacpp_table_names_the_field(table, field):
    data = {"name": "mine", "kind": "cuda", "memory": "24GB", "bandwidth": "1TB/s", "bf16_flops": 1e14,
            "llamacpp": table}
    with pytest.raises(ProfileError) as e:
        profile_from_dict(data, "mine.toml")
    assert e.value.field == field and field in str(e.value)


def test_another_backend_for_the_same_device_takes_that_kinds_defaults():
    strix = get_device("ryzen-ai-max-395")
    assert strix.kind == "cpu" and coefficients(strix).backend == "vulkan"
    rocm = dataclasses.replace(strix, llamacpp={**strix.llamacpp, "backend": "rocm"})
    assert coefficients(rocm).backend == "rocm" and coefficients(rocm).token_s == kind_defaults("rocm")["token_us"] * 1e-6


def test_a_moe_prefill_micro_batch_reads_every_expert_and_a_decode_step_only_the_routed_ones(tmp_path):
    spec = ModelSpec.from_gguf(write_skeleton("qwen3-30b-a3b", tmp_path / "moe.gguf"))
    ks = kernel_speed(spec, get_device("rtx-4090"), ubatch=512)
    experts = sum(g.n_bytes for g in weight_groups(spec) if g.role == "expert")
    dense = sum(g.n_bytes for g in weight_groups(spec) if g.role != "expert")
    assert experts > 10 * dense
    one = ks.prefill(1, 512)
    assert one.bytes > 0.99 * experts                  # 512 tokens × 8 of 128 experts: (15/16)^512 untouched ≈ 0
    step = ks.decode(1, 1)
    assert step.bytes < dense + experts * 8 / 128 * 1.01 + 2 ** 20
    two = ks.prefill(1, 1024)                          # two micro-batches: the experts are read twice
    assert two.bytes == pytest.approx(2 * one.bytes, rel=0.01)


def test_host_tensors_leave_the_device_part_of_a_decode_but_not_of_a_prefill(tmp_path):
    spec = ModelSpec.from_gguf(write_skeleton("qwen3-30b-a3b", tmp_path / "moe.gguf"))
    dev = get_device("rtx-4090")
    host = frozenset(t.name for t in spec.tensors if "_exps." in t.name)
    full, split = kernel_speed(spec, dev), kernel_speed(spec, dev, exclude=host)
    assert split.decode(1, 1).seconds < full.decode(1, 1).seconds
    assert split.prefill(1, 512).seconds == pytest.approx(full.prefill(1, 512).seconds)


def test_the_published_table_cites_every_row():
    seen = 0
    for table in ("published_cuda.csv", "published_unified.csv", "published_offload.csv"):
        with open(DATA / table, newline="", encoding="utf-8") as fh:
            for r in csv.DictReader(fh):
                seen += 1
                assert r["url"].startswith("http"), r
                assert math.isfinite(float(r["tok_s"])) and float(r["tok_s"]) > 0, r
                assert r["row_text"].strip(), r
    assert seen >= 60 + 60
