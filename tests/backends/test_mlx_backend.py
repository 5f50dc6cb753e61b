"""The mlx backend (MLX on the CPU here): weights, logits against llama.cpp, KV cache, contract, faults.

Tolerances.  Logits are compared relative to the largest |logit| of the reference:
* same F32 weights in both engines: 1e-3.  Both compute in float32 and round K/V
  to f16 (the default cache type); llama.cpp's flash attention also rounds Q to
  f16.  One f16 rounding is 2^-11 ≈ 4.9e-4 relative; measured differences are
  2e-4 to 3e-4 of the largest logit.
* quantized file in MLX against llama.cpp on an F32 copy of the same weights:
  also 1e-3, because MLX's affine groups reproduce the GGUF values exactly
  (checked bit for bit below) and multiply them with float32 activations.
* quantized file in both engines: 5e-2.  llama.cpp rounds activations to
  8 bits per 32 values before quantized products (about 0.4% per value);
  measured about 1.1% of the largest logit on these 2-layer models.
* quantized KV against the f16 cache: MLX's affine groups of 64 values have a
  step of (max - min) / 255 at 8 bits and / 15 at 4 bits; measured 0.35% (q8_0)
  and 5.8% (q4_0) of the largest logit, tolerances 2% and 15%.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import get_backend, load_engine
from localinfer.errors import (
    BackendUnavailableError,
    DoesNotFitError,
    LocalinferError,
    UnsupportedModelError,
    UsageError,
)
from tests.support.ggufgen import write_tiny_llama, write_tiny_model

HAVE_MLX = all(importlib.util.find_spec(m) is not None for m in ("mlx", "mlx_lm"))
needs_mlx = pytest.mark.skipif(not HAVE_MLX, reason="mlx / mlx-lm not installed (pip install 'localinfer[mlx]')")
TOKENS = [int(t) for t in np.random.default_rng(1).integers(0, 256, 24)]
SAME_WEIGHTS_TOL = 1e-3
QUANTIZED_BOTH_TOL = 5e-2


def rel_diff(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def engine(path, backend="mlx", **kw):
    kw.setdefault("n_ctx", 256)
    return load_engine(LoadPlan(str(path), **kw), backend)


def logits(path, backend="mlx", tokens=TOKENS, **kw):
    with engine(path, backend, **kw) as e:
        return e.eval(tokens, logits_at=list(range(len(tokens))))


# ---- without mlx ---------------------------------------------------------------------

_BLOCK_MLX = "import sys; sys.modules['mlx'] = sys.modules['mlx.core'] = sys.modules['mlx_lm'] = None; "


def test_missing_mlx_is_a_typed_error_with_the_install_hint():
    code = _BLOCK_MLX + (
        "from localinfer.backends.registry import get_backend\n"
        "from localinfer.errors import BackendUnavailableError\n"
        "try:\n    get_backend('mlx')\nexcept BackendUnavailableError as e:\n    print('HINT', e.hint)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert "HINT pip install 'localinfer[mlx]'" in out.stdout, out.stderr


def test_missing_mlx_on_the_command_line_is_one_line_and_no_traceback():
    code = _BLOCK_MLX + "from localinfer.cli import main; sys.exit(main(['run', '--backend', 'mlx', '-p', 'hi', '-n', '1']))"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "hint: pip install 'localinfer[mlx]'" in out.stderr
    assert "Traceback" not in out.stderr


# ---- weights -------------------------------------------------------------------------

@needs_mlx
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_repacked_blocks_equal_mx_load_and_the_gguf_values(tmp_path, qtype):
    import mlx.core as mx
    from gguf.quants import dequantize

    from gguf_tools import read_header
    from localinfer.backends.mlx.weights import AFFINE_BITS, affine_from_blocks

    path = write_tiny_model(tmp_path / "m.gguf", qtype=qtype, n_layers=1)
    t = read_header(path).tensor("blk.0.ffn_down.weight")
    blob = np.fromfile(path, dtype=np.uint8, count=t.n_bytes, offset=t.file_offset).reshape(t.shape[1], -1)
    ours = affine_from_blocks(blob, qtype)
    loaded = mx.load(str(path))
    for got, key in zip(ours, ("weight", "scales", "biases")):
        want = loaded[f"blk.0.ffn_down.{key}"]
        assert got.dtype == want.dtype and np.array_equal(np.array(got), np.array(want)), key
    w, s, b = ours
    values = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=AFFINE_BITS[qtype])
    assert np.array_equal(np.array(values), dequantize(blob, qtype))


@needs_mlx
def test_other_types_are_dequantized_and_the_cost_is_stated(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", qtype=T.Q4_0, output_qtype=T.Q6_K)
    with engine(path) as e:
        assert len(e.notes) == 1 and "Q6_K dequantized to f32" in e.notes[0]
        assert e.memory()["weights"] == e.planned_bytes["weights"]


@needs_mlx
def test_a_type_nothing_can_read_is_refused():
    from gguf_tools import TensorInfo
    from localinfer.backends.mlx.weights import _dense

    t = TensorInfo(name="blk.0.ffn_down.weight", shape=(256, 2), type=T.I64, offset=0, file_offset=0,
                   n_elements=512, n_bytes=4096)
    with pytest.raises(UnsupportedModelError, match="I64") as err:
        _dense(np.zeros(4096, np.uint8), t)
    assert "llama.cpp" in err.value.hint


# ---- logits against llama.cpp ----------------------------------------------------------

SAME_FILE = [("llama", T.F32, {}), ("qwen2", T.F32, {}), ("qwen3", T.F32, {}),
             ("llama", T.F32, {"rope_freqs": True}), ("llama", T.F32, {"tied": True}),
             # RoPE scaling as ModelSpec reads it: the older key without a type is linear for llama.cpp
             ("llama", T.F32, {"extra_kv": {"llama.rope.scale_linear": (4.0, V.FLOAT32)}}),
             ("qwen3", T.F32, {"extra_kv": {"qwen3.rope.scaling.type": "linear",
                                            "qwen3.rope.scaling.factor": (4.0, V.FLOAT32)}})]


@needs_mlx
@pytest.mark.parametrize("arch,qtype,kw", SAME_FILE, ids=lambda v: str(getattr(v, "name", v)))
def test_f32_models_match_llamacpp(tmp_path, arch, qtype, kw):
    path = write_tiny_model(tmp_path / "m.gguf", arch=arch, qtype=qtype, **kw)
    assert rel_diff(logits(path), logits(path, "llama.cpp")) < SAME_WEIGHTS_TOL


QUANTIZED = [("llama", T.Q4_0, {"output_qtype": T.Q6_K}), ("qwen3", T.Q4_1, {}), ("llama", T.Q8_0, {"tied": True}),
             ("qwen2", T.Q8_0, {})]


@needs_mlx
@pytest.mark.parametrize("arch,qtype,kw", QUANTIZED, ids=lambda v: str(getattr(v, "name", v)))
def test_quantized_models_compute_the_exact_weights(tmp_path, arch, qtype, kw):
    from localinfer.backends.mlx.reference import write_f32_copy

    path = write_tiny_model(tmp_path / "q.gguf", arch=arch, qtype=qtype, **kw)
    ours = logits(path)
    exact = logits(write_f32_copy(path, tmp_path / "f32.gguf"), "llama.cpp")
    assert rel_diff(ours, exact) < SAME_WEIGHTS_TOL
    assert rel_diff(ours, logits(path, "llama.cpp")) < QUANTIZED_BOTH_TOL


# ---- the engine contract ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mlx") / "tiny.gguf", qtype=T.Q8_0)


@needs_mlx
def test_chunks_increments_and_trim_give_the_same_logits(tiny):
    with engine(tiny, n_batch=5, n_seq=2, n_ctx=512) as e:
        whole = e.eval(TOKENS, logits_at=list(range(len(TOKENS))), seq=1)
        assert e.kv_len(1) == len(TOKENS) and e.kv_len(0) == 0
        e.eval(TOKENS[:10], logits_at=[])
        e.eval(TOKENS[10:14], logits_at=[])
        e.trim(12)
        assert e.kv_len(0) == 12
        rest = e.eval(TOKENS[12:], logits_at=[0, -1, 3])
        np.testing.assert_allclose(rest, whole[[12, len(TOKENS) - 1, 15]], rtol=0, atol=1e-4)
        with pytest.raises(ValueError):
            e.trim(len(TOKENS) + 1)
        e.trim(0)
        assert e.kv_len(0) == 0 and e.kv_len(1) == len(TOKENS)


@needs_mlx
@pytest.mark.parametrize("kv_type,tol", [("q8_0", 2e-2), ("q4_0", 1.5e-1)])
def test_quantized_kv_stays_close_to_f16(tiny, kv_type, tol):
    assert rel_diff(logits(tiny, type_k=kv_type, type_v=kv_type), logits(tiny)) < tol


@needs_mlx
@pytest.mark.parametrize("kv_type", ["f16", "f32", "bf16", "q8_0", "q4_0"])
def test_kv_bytes_equal_the_planners_mlx_formula(tiny, kv_type):
    from localinfer.model.spec import ModelSpec
    from localinfer.plan.memory import kv_bytes

    spec = ModelSpec.from_gguf(tiny)
    with engine(tiny, n_ctx=1000, n_seq=2, type_k=kv_type, type_v=kv_type) as e:
        e.eval(TOKENS)
        assert e.n_ctx == 500
        measured = e.memory()["kv"]
        assert measured == e.planned_bytes["kv"]
        assert measured == kv_bytes(spec, e.n_ctx, kv_type, kv_type, backend="mlx", n_seq=2)


@needs_mlx
@pytest.mark.parametrize("n_embd,group", [(384, 32), (128, 32)])     # heads of 96 and 32 values
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_fit_plans_the_quantized_kv_of_heads_not_a_multiple_of_64(tmp_path, n_embd, group, kv_type):
    """Such heads get groups of 32 in the engine; `fit --backend mlx` must plan (not refuse) the same bytes."""
    from localinfer.backends.memory import FitRequest
    from localinfer.backends.mlx.kv import cache_bytes
    from localinfer.backends.mlx.memory import mlx_quant_group
    from localinfer.devices.profiles import profile_from_dict
    from localinfer.model.spec import ModelSpec
    from localinfer.plan.fit import fit_device

    path = write_tiny_model(tmp_path / "odd.gguf", n_embd=n_embd, n_ff=256)
    spec = ModelSpec.from_gguf(path)
    assert spec.head_dim_k % 64 and mlx_quant_group(spec) == group
    cpu = profile_from_dict({"name": "test-cpu", "kind": "cpu", "memory": "8GiB"})
    planned = fit_device(spec, cpu, FitRequest(n_ctx=300, n_seq=2, backend="mlx", type_k=kv_type, type_v=kv_type),
                         search=False).breakdown.kv
    with engine(path, n_ctx=600, n_seq=2, type_k=kv_type, type_v=kv_type) as e:
        assert {c.group_size for seq in e._caches for c in seq} == {group}
        held = sum(cache_bytes(c) for c in e._caches)
        assert held == e.memory()["kv"] == e.planned_bytes["kv"] == planned


@needs_mlx
@pytest.mark.parametrize("type_k,type_v,flag", [("q5_0", "q5_0", "-ctk"), ("q8_0", "q4_0", "-ctv"),
                                                 ("f16", "q8_0", "-ctv"), ("iq4_nl", "f16", "-ctk")])
def test_kv_types_mlx_cannot_hold_are_refused(tiny, type_k, type_v, flag):
    with pytest.raises(UsageError) as err:
        engine(tiny, type_k=type_k, type_v=type_v)
    assert err.value.flag == flag


@needs_mlx
def test_registry_device_dtype_and_close(tiny):
    from localinfer.backends.mlx.engine import MLXEngine

    assert get_backend("mlx") is MLXEngine
    with pytest.raises(BackendUnavailableError, match="Metal"):
        engine(tiny, device="gpu")
    with pytest.raises(UsageError) as err:
        engine(tiny, dtype="int8")
    assert err.value.flag == "--dtype"
    half = logits(tiny, dtype="f16")
    assert rel_diff(half, logits(tiny)) < 2e-2
    e = engine(tiny)
    e.close()
    e.close()
    with pytest.raises(LocalinferError, match="closed"):
        e.eval([1])


@needs_mlx
def test_working_set_limit():
    from localinfer.backends.mlx.engine import check_working_set

    check_working_set(10, None, force=False)
    check_working_set(10, 20, force=False)
    check_working_set(30, 20, force=True)
    with pytest.raises(DoesNotFitError) as err:
        check_working_set(30, 20, force=False)
    assert (err.value.needed, err.value.available) == (30, 20) and "--force" in err.value.hint


@needs_mlx
def test_unsupported_architectures_name_what_is_supported(tmp_path):
    path = write_tiny_llama(tmp_path / "x.gguf", arch="phi3")
    with pytest.raises(UnsupportedModelError) as err:
        engine(path)
    assert "phi3" in str(err.value)
    assert "llama, qwen2 and qwen3" in err.value.hint and "--backend llama.cpp" in err.value.hint


# ---- the embedded model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(default_model):
    if not HAVE_MLX:
        pytest.skip("mlx not installed")
    with engine(default_model, n_ctx=512) as e:
        yield e


@pytest.fixture(scope="module")
def smol_cpp(default_model):
    with engine(default_model, "llama.cpp", n_ctx=512) as e:
        yield e


@needs_mlx
def test_tokenization_is_llamacpps(smol, smol_cpp):
    texts = ["Hello, world!", "  leading spaces and\ttabs\n", "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        for special in (False, True):
            assert smol.tokenize(text, special=special) == smol_cpp.tokenize(text, special=special)
        assert smol.tokenize(text, add_bos=True) == smol_cpp.tokenize(text, add_bos=True)
    assert [smol.token_bytes(t) for t in range(0, 49152, 97)] == [smol_cpp.token_bytes(t) for t in range(0, 49152, 97)]
    assert (smol.bos_id, smol.eos_ids, smol.n_vocab) == (smol_cpp.bos_id, smol_cpp.eos_ids, smol_cpp.n_vocab)
    assert smol.token_text(1) == smol_cpp.token_text(1) == "<|im_start|>"


@needs_mlx
def test_runner_plain_and_lookup_decoding_agree(smol):
    from localinfer.generation.lookup import LookupDecoder
    from localinfer.generation.runner import Runner
    from localinfer.generation.sampling import SamplingParams

    prompt = smol.tokenize("Monday Tuesday Wednesday. Monday Tuesday Wednesday. Monday")
    runner = Runner(smol)
    greedy = SamplingParams(greedy=True)
    plain = runner.generate(prompt, greedy, max_tokens=6)
    runner.reset()
    lookup = runner.generate(prompt, greedy, max_tokens=6, decoder=LookupDecoder(adaptive=False))
    assert lookup.tokens == plain.tokens
    assert lookup.stats.accepted > 0 and lookup.stats.rounds < plain.stats.rounds
    assert plain.text.startswith(" Tuesday Wednesday")


@needs_mlx
def test_cli_run_with_lookup(default_model, capsys):
    from localinfer.cli import main

    rc = main(["run", str(default_model), "--backend", "mlx", "--raw", "--temp", "0", "-n", "4", "--lookup",
               "-p", "1, 2, 3, 4, 5,"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.startswith(" 6,")


@needs_mlx
def test_greedy_equals_llamacpp_on_the_same_weights(smol, tmp_path_factory, default_model):
    """Greedy decoding on the embedded Q4_1 file equals llama.cpp's on an F32 copy of its weights.

    llama.cpp decodes the prompts step by step (batched across sequences); MLX must
    pick the same token at every step, checked in one teacher-forced evaluation per
    prompt.  benchmarks/mlx_backend.py runs all ten prompts for 64 tokens, and the
    Q4_1 file in both engines (where llama.cpp's 8-bit activations move near-ties).
    """
    from localinfer.backends.mlx.reference import write_f32_copy

    f32 = write_f32_copy(default_model, tmp_path_factory.mktemp("smol") / "smol-f32.gguf")
    prompts, n = PROMPTS, 16
    with engine(f32, "llama.cpp", n_ctx=256 * len(prompts), n_seq=len(prompts)) as ref:
        toks = [ref.tokenize(p) for p in prompts]
        outs: list[list[int]] = [[] for _ in prompts]
        rows = ref.eval_batch(dict(enumerate(toks)))
        for step in range(n):
            for i, row in rows.items():
                outs[i].append(int(row.argmax()))
            if step < n - 1:
                rows = ref.eval_batch({i: [out[-1]] for i, out in enumerate(outs)})
    identical = 0
    for t, out in zip(toks, outs):
        smol.trim(0)
        ours = smol.eval(t + out[:-1], logits_at=list(range(len(t) - 1, len(t) + n - 1)))
        identical += [int(x) for x in ours.argmax(axis=1)] == out
    smol.trim(0)
    assert identical == len(prompts)


PROMPTS = ["The capital of France is", "def fibonacci(n):"]
