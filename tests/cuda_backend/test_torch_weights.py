"""GGUF tensors into torch: exact dequantization, torch layout, packed blocks, streaming memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from cuda_backend.support import SUPPORTED_WEIGHT_TYPES
from cuda_backend.weights import Packed, load_weights, weights_nbytes
from gguf_tools import GGUFFormatError
from localinfer.model.spec import ModelSpec
from tests.support.ggufgen import write_tiny_model


@pytest.fixture(scope="module")
def typed_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("typed")
    return {t: write_tiny_model(root / f"{t.name}.gguf", n_layers=1, qtype=t, seed=int(t))
            for t in SUPPORTED_WEIGHT_TYPES}


@pytest.mark.parametrize("qtype", SUPPORTED_WEIGHT_TYPES, ids=lambda t: t.name)
def test_every_tensor_equals_gguf_dequantize(typed_models, qtype):
    path = typed_models[qtype]
    weights = load_weights(ModelSpec.from_gguf(path), "cpu", torch.float32, quiet=True)
    reader = GGUFReader(str(path))
    assert {t.name for t in reader.tensors} == set(weights)
    seen = set()
    for t in reader.tensors:
        want = dequantize(np.array(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        got = weights[t.name]
        assert tuple(got.shape) == want.shape, t.name           # torch order: GGUF shape reversed
        assert np.array_equal(got.numpy(), want.astype(np.float32)), t.name
        seen.add(t.tensor_type)
    assert qtype in seen or qtype == T.F32


def test_bf16_matrices_f32_vectors(typed_models):
    spec = ModelSpec.from_gguf(typed_models[T.Q8_0])
    w = load_weights(spec, "cpu", torch.bfloat16, quiet=True)
    assert w["blk.0.attn_q.weight"].dtype == torch.bfloat16
    assert w["blk.0.attn_norm.weight"].dtype == torch.float32
    f32 = load_weights(spec, "cpu", torch.float32, quiet=True)
    assert torch.equal(w["blk.0.attn_q.weight"], f32["blk.0.attn_q.weight"].bfloat16())


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_packed_blocks_keep_file_bytes(typed_models, qtype):
    spec = ModelSpec.from_gguf(typed_models[qtype])
    packed = load_weights(spec, "cpu", torch.float32, packed=True, quiet=True)
    plain = load_weights(spec, "cpu", torch.float32, quiet=True)
    q = packed["blk.0.ffn_up.weight"]
    assert isinstance(q, Packed)
    assert q.nbytes == spec.tensor("blk.0.ffn_up.weight").n_bytes
    assert q.shape == tuple(plain["blk.0.ffn_up.weight"].shape)
    assert torch.equal(q.dequantize(torch.float32), plain["blk.0.ffn_up.weight"])
    matrices = [t for t in spec.tensors if len(t.shape) == 2]
    vectors = sum(t.n_elements * 4 for t in spec.tensors if len(t.shape) == 1)
    assert weights_nbytes(packed) == sum(t.n_bytes for t in matrices) + vectors


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_block_matrices_hold_the_gguf_codes(typed_models, qtype):
    """llamacpp_rounding keeps q8_0/q4_0/q4_1 matrices as codes and scales: d·q (+ m) gives
    back gguf's dequantized values exactly, codes are integers in the type's range, and a
    q4_1 block's smallest value is its min (its quantizer maps it to code 0)."""
    from cuda_backend.ggml_numerics import BlockMatrix

    spec = ModelSpec.from_gguf(typed_models[qtype])
    w = load_weights(spec, "cpu", torch.float32, llamacpp_rounding=True, quiet=True)
    plain = load_weights(spec, "cpu", torch.float32, quiet=True)
    q = w["blk.0.attn_q.weight"]
    assert isinstance(q, BlockMatrix) and q.shape == tuple(plain["blk.0.attn_q.weight"].shape)
    assert torch.equal(q.rows(torch.arange(q.shape[0])), plain["blk.0.attn_q.weight"])
    assert torch.equal(q.codes, q.codes.round())
    lo, hi = {T.Q8_0: (-128, 127), T.Q4_0: (-8, 7), T.Q4_1: (0, 15)}[qtype]
    assert lo <= q.codes.min() and q.codes.max() <= hi
    if qtype == T.Q4_1:
        values = plain["blk.0.attn_q.weight"]
        assert torch.equal(values.view(values.shape[0], -1, 32).amin(-1), q.m)
    assert not any(name.endswith(":mins") for name in w)


def test_truncated_file_is_a_format_error(tmp_path, typed_models):
    data = typed_models[T.Q8_0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFFormatError, match="truncated|bytes"):
        spec = ModelSpec.from_gguf(cut)
        load_weights(spec, "cpu", torch.float32, quiet=True)


def test_progress_bar_on_stderr_unless_quiet(typed_models, capfd):
    spec = ModelSpec.from_gguf(typed_models[T.F16])
    load_weights(spec, "cpu", torch.float32, quiet=True)
    assert capfd.readouterr().err == ""
    load_weights(spec, "cpu", torch.float32)
    captured = capfd.readouterr()
    assert "loading tiny-llama" in captured.err and captured.out == ""


_PEAK = textwrap.dedent("""
    import sys, torch
    from localinfer.model.spec import ModelSpec
    from cuda_backend.weights import load_weights, weights_nbytes

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    spec = ModelSpec.from_gguf(sys.argv[1])
    torch.empty(1)
    base = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")   # reset the peak (VmHWM) to the current RSS
    w = load_weights(spec, "cpu", torch.float32, quiet=True)
    print(status("VmHWM:") - base, weights_nbytes(w))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_host_memory_within_1_2x_of_loaded_model(default_model):
    """Streaming in row chunks: the process grows by the loaded model, not by float32 copies of it."""
    out = subprocess.run([sys.executable, "-c", _PEAK, str(default_model)], capture_output=True, text=True,
                         timeout=300, check=False)
    if out.returncode != 0 and "clear_refs" in out.stderr:
        pytest.skip("this kernel does not allow resetting the peak RSS")
    assert out.returncode == 0, out.stderr
    grown, loaded = map(int, out.stdout.split())
    assert loaded > 400 * 2**20          # 135M parameters in float32
    assert grown <= 1.2 * loaded, f"peak grew {grown / loaded:.2f}x the loaded model"


def test_packed_engine_gives_the_same_logits_in_file_bytes(tmp_path):
    from cuda_backend.engine import TorchEngine
    from localinfer.backends.engine import LoadPlan

    path = str(write_tiny_model(tmp_path / "q4.gguf", qtype=T.Q4_0, tied=True))
    plain = TorchEngine(LoadPlan(path, n_ctx=64, n_threads=1, options={"quiet": True}))
    packed = TorchEngine(LoadPlan(path, n_ctx=64, n_threads=1, options={"quiet": True, "packed": True}))
    tokens = plain.tokenize("packed weights, unpacked when used")
    assert np.array_equal(plain.eval(tokens)[0], packed.eval(tokens)[0])
    spec = ModelSpec.from_gguf(path)
    vectors = sum(t.n_elements * 4 for t in spec.tensors if len(t.shape) == 1)
    assert packed.memory()["weights"] == sum(t.n_bytes for t in spec.tensors if len(t.shape) == 2) + vectors
