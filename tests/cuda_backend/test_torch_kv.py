"""The torch KV cache: GGUF block bytes, byte counts equal to fit's prediction, trim."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from cuda_backend import quant
from cuda_backend.kv_cache import KVCache, cache_bytes, padded_tokens
from localinfer.backends.engine import LoadPlan
from localinfer.errors import UsageError
from localinfer.model.spec import ModelSpec
from localinfer.plan.memory import kv_bytes

GGML = {"q8_0": T.Q8_0, "q4_0": T.Q4_0}


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_blocks_are_gguf_bytes(kind):
    x = np.random.default_rng(1).standard_normal((8, 128)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by zero
    ours = quant.quantize(torch.from_numpy(x), kind).reshape(8, -1).numpy()
    theirs = gguf_quantize(x, GGML[kind])
    assert ours.shape[1] == 128 // 32 * quant.BLOCK_BYTES[kind] == (136 if kind == "q8_0" else 72)
    assert np.array_equal(ours, theirs)
    back = quant.dequantize(torch.from_numpy(theirs).reshape(8, 4, -1), kind).numpy()
    assert np.array_equal(back, gguf_dequantize(theirs, GGML[kind]))


def test_rows_must_fill_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize(torch.zeros(4, 48), "q8_0")


@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"),
                                           ("q8_0", "f16"), ("bf16", "q4_0"), ("f32", "f32")])
@pytest.mark.parametrize("n_ctx,n_seq", [(1, 1), (100, 1), (512, 3), (8192, 2)])
def test_bytes_equal_fit_prediction(tiny_models, type_k, type_v, n_ctx, n_seq):
    spec = ModelSpec.from_gguf(tiny_models["llama"])
    cache = KVCache(spec.n_layers, n_seq, n_ctx, spec.n_head_kv[0], spec.head_dim_k, type_k, type_v)
    predicted = kv_bytes(spec, n_ctx, type_k, type_v, backend="torch", n_seq=n_seq)
    assert cache.nbytes == predicted == cache_bytes(spec.n_layers, spec.n_head_kv[0], spec.head_dim_k,
                                                    n_ctx, type_k, type_v, n_seq)
    assert cache.capacity == padded_tokens(n_ctx) and cache.capacity % 16 == 0


def test_q8_0_is_34_and_q4_0_18_bytes_per_32_values():
    f16 = cache_bytes(1, 1, 64, 16, "f16", "f16")
    assert cache_bytes(1, 1, 64, 16, "q8_0", "q8_0") * 64 == f16 * 34
    assert cache_bytes(1, 1, 64, 16, "q4_0", "q4_0") * 64 == f16 * 18


@pytest.mark.parametrize("kind,tol", [("f16", 1e-3), ("bf16", 1e-2), ("q8_0", 1e-2), ("q4_0", 0.15)])
def test_write_read_roundtrip(kind, tol):
    cache = KVCache(1, 2, 40, 2, 64, kind, kind)
    k = torch.randn(2, 5, 2, 64)
    v = torch.randn(2, 5, 2, 64)
    pos = torch.arange(3, 8)[None].expand(2, 5)
    cache.write(0, torch.tensor([[1], [0]]), pos, k, v)
    keys, values = cache.read(0, torch.tensor([1, 0]), 2, 8)
    assert keys.shape == (2, 2, 8, 64)
    assert (keys[:, :, :3] == 0).all()
    err = (keys[:, :, 3:8] - k.transpose(1, 2)).abs().max() / k.abs().max()
    assert err < tol
    assert torch.equal(cache.read(0, None, 2, 8)[1][0], values[1])


def test_unsupported_kv_type_names_the_supported_set():
    with pytest.raises(UsageError, match="q8_0") as exc:
        KVCache(1, 1, 16, 1, 64, "q5_1", "f16")
    assert exc.value.flag == "-ctk" and "llama.cpp" in exc.value.hint
    with pytest.raises(UsageError, match="multiple of 32"):
        KVCache(1, 1, 16, 1, 48, "f16", "q4_0")


def test_trim_bounds():
    cache = KVCache(1, 1, 16, 1, 32)
    cache.lens[0] = 5
    cache.trim(0, 2)
    assert cache.lens[0] == 2
    with pytest.raises(ValueError):
        cache.trim(0, 3)


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
def test_engine_kv_bytes_and_trim(tiny_models, kind):
    from cuda_backend.engine import TorchEngine

    path = tiny_models["qwen3"]
    spec = ModelSpec.from_gguf(path)
    plan = LoadPlan(str(path), n_ctx=2 * 72, n_seq=2, type_k=kind, type_v=kind, options={"quiet": True})
    with TorchEngine(plan) as eng:
        assert eng.memory()["kv"] == kv_bytes(spec, 72, kind, kind, backend="torch", n_seq=2)
        toks = eng.tokenize("the KV cache rewinds to any length")
        first = eng.eval(toks, logits_at=[5, -1])
        eng.trim(6)
        assert eng.kv_len() == 6
        again = eng.eval(toks[6:])
        np.testing.assert_allclose(again[0], first[1], rtol=0, atol=1e-4)
        eng.trim(0)
        np.testing.assert_allclose(eng.eval(toks[:6])[0], first[0], rtol=0, atol=1e-4)
