"""fit for --backend torch / mlx: resident weights equal what the real engines hold, devices, dtype, --force."""

import argparse

import pytest
from gguf import GGMLQuantizationType as T

from cuda_backend.memory import torch_weight_bytes
from localinfer.backends.engine import LoadPlan
from localinfer.backends.memory import FitRequest, check_weight_dtype
from localinfer.backends.mlx.memory import mlx_weight_bytes
from localinfer.cli import main
from localinfer.devices.profiles import profile_from_dict
from localinfer.errors import UsageError
from localinfer.model.spec import ModelSpec
from localinfer.plan.fit import check_load, fit_device
from localinfer.plan.memory import backend_device, resident_weights
from tests.support.ggufgen import write_tiny_model

# Every weight type both engines read, in one file: Q4_0/Q4_1/Q8_0 (MLX keeps them quantized,
# torch can keep q8_0/q4_0 packed), K-quants, Q5_0, F16, BF16 and 2-D F32 (dequantized).
MIXED = {
    "qwen2": {"arch": "qwen2", "qtype": T.Q4_0, "output_qtype": T.Q5_0,
              "overrides": {"ffn_up": T.Q4_1, "ffn_down": T.Q8_0, "ffn_gate": T.Q6_K, "attn_v": T.F16,
                            "attn_output": T.BF16, "token_embd": T.Q8_0}},
    "llama-tied": {"arch": "llama", "qtype": T.Q4_1, "tied": True, "rope_freqs": True,
                   "overrides": {"attn_q": T.Q8_0, "ffn_down": T.Q4_K, "attn_k": T.F32, "token_embd": T.Q4_0}},
}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    return {name: write_tiny_model(root / f"{name}.gguf", **kw) for name, kw in MIXED.items()}


def device(kind, memory="8GiB", **extra):
    return profile_from_dict({"name": f"test-{kind}", "kind": kind, "memory": memory, **extra})


def _plan(path, **kw) -> LoadPlan:
    opts = kw.pop("options", {})
    return LoadPlan(str(path), n_ctx=256, n_threads=1, device="cpu", options={"quiet": True, **opts}, **kw)


def _fit_weights(spec, backend, kind="cpu", dtype=None) -> int:
    return fit_device(spec, device(kind), FitRequest(n_ctx=256, backend=backend, dtype=dtype), search=False) \
        .breakdown.weights


# ---- pure: where each backend runs, defaults, formulas --------------------------------------

def test_where_each_backend_computes():
    assert backend_device("torch", "cuda") == ("cuda", None)
    assert backend_device("mlx", "metal") == ("metal", None)
    assert backend_device("torch", "metal")[0] == "cpu" and "mps" in backend_device("torch", "metal")[1]
    assert backend_device("mlx", "cuda")[0] == "cpu" and "CUDA" in backend_device("mlx", "cuda")[1]
    with pytest.raises(UsageError):
        backend_device("vllm", "cuda")


def test_mixed_models_hold_the_types_they_claim(mixed):
    types = {n: {t.type.name for t in ModelSpec.from_gguf(p).tensors} for n, p in mixed.items()}
    assert {"Q4_0", "Q4_1", "Q8_0", "Q6_K", "Q5_0", "F16", "BF16", "F32"} <= types["qwen2"]
    assert {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "F32"} <= types["llama-tied"]


def test_default_dtypes_follow_the_engines(mixed):
    spec = ModelSpec.from_gguf(mixed["qwen2"])          # has a BF16 tensor: mlx on Metal computes in bf16
    assert resident_weights(spec, "torch", "cuda").dtype == "bf16"
    assert resident_weights(spec, "torch", "cpu").dtype == "f32"
    assert resident_weights(spec, "torch", "metal").dtype == "f32"
    assert resident_weights(spec, "mlx", "metal").dtype == "bf16"
    assert resident_weights(ModelSpec.from_gguf(mixed["llama-tied"]), "mlx", "metal").dtype == "f16"
    assert resident_weights(spec, "mlx", "cpu", "f16").bytes == mlx_weight_bytes(spec, "f16")
    with pytest.raises(UsageError) as ei:
        check_weight_dtype("q8_0")
    assert ei.value.flag == "--dtype"


def test_mlx_groups_are_cheaper_on_the_gpu_by_the_scale_width(default_model):
    """f32 vs f16 scales: each affine group of 32 grows by 2 × 2 B, every dense value by 2 B."""
    spec = ModelSpec.from_gguf(default_model)
    groups = sum(t.n_elements // 32 for t in spec.tensors if t.type.name in ("Q4_0", "Q4_1", "Q8_0"))
    dense = sum(t.n_elements for t in spec.tensors if t.type.name not in ("Q4_0", "Q4_1", "Q8_0"))
    assert mlx_weight_bytes(spec, "f32") - mlx_weight_bytes(spec, "f16") == 4 * groups + 2 * dense
    assert mlx_weight_bytes(spec, "f16") > spec.weight_bytes    # f16 scale+bias vs one f16 scale (+ f16 min)


def test_fit_counts_resident_weights_not_file_bytes(default_model):
    spec = ModelSpec.from_gguf(default_model)
    cuda, metal = device("cuda"), device("metal", unified=True)
    torch_gpu = fit_device(spec, cuda, FitRequest(n_ctx=1024, backend="torch"), search=False)
    w = next(t for t in torch_gpu.breakdown.terms if t.key == "weights")
    assert w.bytes == torch_weight_bytes(spec, "bf16") != spec.weight_bytes and w.pool == "device"
    assert "torch on cuda, bf16" in w.formula and "tied" in w.formula
    forced = fit_device(spec, cuda, FitRequest(n_ctx=1024, backend="torch", dtype="f32"), search=False)
    assert forced.breakdown.weights == torch_weight_bytes(spec, "f32") > torch_gpu.breakdown.weights
    on_mac = fit_device(spec, metal, FitRequest(n_ctx=1024, backend="torch"), search=False)
    assert on_mac.fits and on_mac.breakdown.weights == torch_weight_bytes(spec, "f32")
    assert any("mps" in n for n in on_mac.breakdown.notes)
    mlx_mac = fit_device(spec, metal, FitRequest(n_ctx=1024, backend="mlx"))
    assert mlx_mac.fits and mlx_mac.breakdown.weights == mlx_weight_bytes(spec, "f16") and mlx_mac.max_ctx


def test_mlx_on_a_cuda_device_is_not_supported(default_model, capsys):
    spec = ModelSpec.from_gguf(default_model)
    r = fit_device(spec, device("cuda", host_memory="64GiB"), FitRequest(n_ctx=1024, backend="mlx"))
    assert not r.fits and not r.supported and r.reason.startswith("not supported")
    assert r.max_ctx is None and r.max_parallel is None and not r.suggestions
    assert r.breakdown.device_bytes == 0 and r.breakdown.host_bytes == r.breakdown.total > 0
    assert r.to_dict()["supported"] is False
    assert main(["fit", "--backend", "mlx", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "not supported" in out and "nothing fits" not in out


def test_check_load_checks_where_the_engine_computes(default_model):
    spec = ModelSpec.from_gguf(default_model)
    gpu = device("cuda", memory="1GiB", host_memory="32GiB")
    on_cpu = check_load(spec, LoadPlan(str(default_model), n_ctx=512, device="cpu"), device=gpu, backend="torch")
    assert on_cpu.device.kind == "cpu" and on_cpu.device.memory_bytes == gpu.host_memory_bytes
    assert on_cpu.breakdown.weights == torch_weight_bytes(spec, "f32")
    packed = check_load(spec, LoadPlan(str(default_model), n_ctx=512, options={"packed": True}, dtype="bf16"),
                        device=gpu, backend="torch")
    assert packed.device.kind == "cuda" and packed.breakdown.weights == torch_weight_bytes(spec, "bf16", packed=True)
    mlx = check_load(spec, LoadPlan(str(default_model), n_ctx=512), device=gpu, backend="mlx")
    assert mlx.fits and mlx.device.kind == "cpu" and mlx.breakdown.weights == mlx_weight_bytes(spec, "f32")


def test_fit_cli_dtype(default_model, capsys):
    import json

    assert main(["fit", "--backend", "torch", "--dtype", "bf16", "--device", "local", "--json"]) == 0
    term = next(t for t in json.loads(capsys.readouterr().out)["devices"][0]["breakdown"]["terms"]
                if t["key"] == "weights")
    assert term["bytes"] == torch_weight_bytes(ModelSpec.from_gguf(default_model), "bf16")
    assert "bf16" in term["formula"]
    for argv, flag in ((["--dtype", "bf16"], "--dtype"), (["--backend", "mlx", "--dtype", "int4"], "--dtype")):
        assert main(["fit", *argv, "--device", "local"]) != 0
        assert flag in capsys.readouterr().err


# ---- --force reaches the engines ----------------------------------------------------------

def test_force_is_a_plan_option(default_model):
    from localinfer.commands import _common

    spec = ModelSpec.from_gguf(default_model)
    parser = argparse.ArgumentParser()
    _common.add_model_args(parser)
    forced = _common.plan_from(parser.parse_args(["--force", "--ctx", "99999"]), default_model, spec)
    assert forced.options["force"] is True and forced.n_ctx == 99999
    plain = _common.plan_from(parser.parse_args([]), default_model, spec)
    assert not plain.options.get("force")
    both = _common.plan_from(parser.parse_args(["--force"]), default_model, spec, options={"quiet": True})
    assert both.options == {"quiet": True, "force": True}


# ---- the real engines hold exactly the predicted bytes -------------------------------------

def _torch_model_bytes(model) -> int:
    """Bytes of every weight tensor the torch Transformer keeps (shared storage counted once)."""
    import dataclasses

    import torch

    from cuda_backend.weights import Packed

    seen, total = set(), 0

    def visit(x):
        nonlocal total
        if isinstance(x, Packed):
            x = x.blocks
        if isinstance(x, torch.Tensor):
            key = x.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += x.untyped_storage().nbytes()
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name))

    for x in (model.embd, model.output_norm, model.output, *model.layers):
        visit(x)
    return total


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_torch_engine_holds_the_prediction_embedded(default_model, dtype):
    pytest.importorskip("torch")
    from cuda_backend.engine import TorchEngine

    spec = ModelSpec.from_gguf(default_model)
    with TorchEngine(_plan(default_model, dtype=None if dtype == "f32" else dtype)) as eng:
        got = eng.memory()["weights"]
        assert got == _torch_model_bytes(eng.model)
    assert got == torch_weight_bytes(spec, dtype) == _fit_weights(spec, "torch", dtype=dtype if dtype != "f32" else None)


@pytest.mark.parametrize("name", list(MIXED))
@pytest.mark.parametrize("dtype,options", [("f32", {}), ("bf16", {}), ("bf16", {"packed": True}),
                                           ("f32", {"llamacpp_rounding": True})])
def test_torch_engine_holds_the_prediction_mixed(mixed, name, dtype, options):
    pytest.importorskip("torch")
    from cuda_backend.engine import TorchEngine

    spec = ModelSpec.from_gguf(mixed[name])
    with TorchEngine(_plan(mixed[name], dtype=dtype, options=options)) as eng:
        got = eng.memory()["weights"]
        assert got == _torch_model_bytes(eng.model)
        if spec.arch == "qwen2":
            assert eng.model.layers[0].wq.b.dtype == eng.dtype       # biases live in the compute dtype
    packed = bool(options.get("packed"))
    assert got == torch_weight_bytes(spec, dtype, packed=packed,
                                    llamacpp_rounding=bool(options.get("llamacpp_rounding")))
    if not options.get("llamacpp_rounding"):
        req = FitRequest(n_ctx=256, backend="torch", dtype=dtype, packed=packed)
        assert got == fit_device(spec, device("cpu"), req, search=False).breakdown.weights


def _mlx_engine(path, **kw):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from localinfer.backends.mlx.engine import MLXEngine

    return MLXEngine(_plan(path, **kw))


def test_mlx_engine_holds_the_prediction_embedded(default_model):
    spec = ModelSpec.from_gguf(default_model)
    with _mlx_engine(default_model) as eng:
        got = eng.memory()["weights"]
        assert got == eng.planned_bytes["weights"]
    assert got == mlx_weight_bytes(spec, "f32") == _fit_weights(spec, "mlx")
    assert got - mlx_weight_bytes(spec, "f16") > 0     # the Metal figure: same groups, half-width scales


@pytest.mark.parametrize("name", list(MIXED))
@pytest.mark.parametrize("dtype", [None, "f16", "bf16"])
def test_mlx_engine_holds_the_prediction_mixed(mixed, name, dtype):
    """On the CPU MLX computes in float32 by default; f16/bf16 give the GPU's layout (2-byte scales)."""
    spec = ModelSpec.from_gguf(mixed[name])
    with _mlx_engine(mixed[name], dtype=dtype) as eng:
        got = eng.memory()["weights"]
        from mlx.utils import tree_flatten

        quantized = {p for p, _ in tree_flatten(eng.model.parameters()) if p.endswith(".scales")}
    assert quantized                                             # the affine path was really taken
    assert got == mlx_weight_bytes(spec, dtype or "f32") == _fit_weights(spec, "mlx", dtype=dtype)


def test_mlx_engine_refuses_above_the_working_set_unless_forced(default_model, monkeypatch):
    """The engine's working-set check reads plan.options["force"], which plan_from sets.

    Only Apple GPUs report a working-set limit, so the limit is patched to 1 MiB here."""
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from localinfer.backends.mlx import engine as mlx_engine
    from localinfer.errors import DoesNotFitError

    monkeypatch.setattr(mlx_engine, "working_set_limit", lambda: 1 << 20)
    with pytest.raises(DoesNotFitError):
        _mlx_engine(default_model)
    with _mlx_engine(default_model, options={"force": True}) as eng:
        assert eng.memory()["weights"] > 1 << 20

