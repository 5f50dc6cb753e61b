"""The torch transformer against llama.cpp on tiny random llama / qwen2 / qwen3 GGUFs.

Both backends read the same file and the same token ids; the last position's
logits are compared as max |Δ| / max |logit|.  llama.cpp runs with a float32
KV cache and flash attention off, so its attention is plain float32 and the
remaining differences come from how its CPU matmuls round activations:

* F32 weights: float32 throughout, only summation order differs → 1e-5.
* F16 / BF16 weights: activations are cast to f16 / bf16 first → 2e-3 / 1e-2.
* quantized weights: activations are quantized to 8 bits per block of 32
  (q8_0/q8_1) or 256 (q8_K), up to amax/254 per value → 3e-2.

With ``llamacpp_rounding`` the torch side rounds the same way; most cases then
agree to float32 precision.  A value that lands within an ulp of a rounding
tie can still round the other way (summation orders differ) and the models
then drift apart by about the plain error, so that is the bound per case, and
exact agreement is required of most cases, not all.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from cuda_backend.engine import TorchEngine
from cuda_backend.rope import ROPE_PAIRING
from cuda_backend.support import SUPPORTED_WEIGHT_TYPES
from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from localinfer.errors import UnsupportedModelError
from tests.support.ggufgen import write_tiny_model

TEXT = "the tiny model reads this"
ARCHS = ("llama", "qwen2", "qwen3")
TOL = {T.F32: 1e-5, T.F16: 2e-3, T.BF16: 1e-2}
TOL_QUANTIZED = 3e-2
EXACT = 1e-5
# The issue's list; llama also runs every other type the backend reads.
REQUIRED = (T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q2_K, T.Q4_K, T.Q6_K)


def _plan(path, kv="f32", **options) -> LoadPlan:
    return LoadPlan(str(path), n_ctx=256, type_k=kv, type_v=kv, n_threads=1,
                    flash_attn=kv.startswith("q"), options={"quiet": True, **options})


def reference(path, text=TEXT, kv="f32") -> tuple[list[int], np.ndarray]:
    with load_engine(_plan(path, kv), "llama.cpp") as eng:
        tokens = eng.tokenize(text)
        return tokens, eng.eval(tokens)[0]


def ours(path, tokens, kv="f32", **options) -> np.ndarray:
    with TorchEngine(_plan(path, kv, **options)) as eng:
        return eng.eval(tokens)[0]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_llamacpp_for_every_weight_type(tmp_path, arch):
    rows, exact, quantized = [], 0, 0
    for qtype in SUPPORTED_WEIGHT_TYPES if arch == "llama" else REQUIRED:
        path = write_tiny_model(tmp_path / f"{qtype.name}.gguf", arch=arch, qtype=qtype, seed=int(qtype))
        tokens, ref = reference(path)
        plain = rel_err(ours(path, tokens), ref)
        emulated = rel_err(ours(path, tokens, llamacpp_rounding=True), ref)
        rows.append(f"{qtype.name:5} plain {plain:.1e} rounded-like-llama.cpp {emulated:.1e}")
        tol = TOL.get(qtype, TOL_QUANTIZED)
        assert plain <= tol and emulated <= tol, "\n".join(rows)
        if qtype not in TOL:
            quantized += 1
            exact += emulated <= EXACT
    assert exact >= 0.6 * quantized, "\n".join(rows)


def test_rope_pairing_is_llamacpps(tiny_models):
    import llama_cpp

    for arch, path in tiny_models.items():
        with load_engine(_plan(path), "llama.cpp") as eng:
            rope_type = llama_cpp.llama_model_rope_type(eng.model_handle)
        assert {0: "norm", 2: "neox"}[rope_type] == ROPE_PAIRING[arch], arch


_LONG = "positions far from zero make rotary scaling matter. " * 3
_ROPE_VARIANTS = {
    "linear": {"extra_kv": {"rope.scaling.type": "linear", "rope.scaling.factor": (4.0, V.FLOAT32)}},
    "yarn": {"extra_kv": {"rope.scaling.type": "yarn", "rope.scaling.factor": (4.0, V.FLOAT32),
                           "rope.scaling.original_context_length": (32, V.UINT32)}},
    "rope_freqs": {"rope_freqs": True},
    "base_1e6": {"rope_base": 1e6},
}


@pytest.mark.parametrize("arch,variant", [(a, v) for a in ("llama", "qwen3") for v in _ROPE_VARIANTS
                                          if (a, v) != ("qwen3", "rope_freqs")])   # llama-only tensor
def test_rope_scaling_matches_llamacpp(tmp_path, arch, variant):
    opts = dict(_ROPE_VARIANTS[variant])
    if "extra_kv" in opts:
        opts["extra_kv"] = {f"{arch}.{k}": v for k, v in opts["extra_kv"].items()}
    path = write_tiny_model(tmp_path / "v.gguf", arch=arch, **opts)
    base = write_tiny_model(tmp_path / "base.gguf", arch=arch)
    tokens, ref = reference(path, _LONG)
    assert len(tokens) > 100
    assert rel_err(ours(path, tokens), ref) <= TOL[T.F32]
    assert rel_err(reference(base, _LONG)[1], ref) > 1e-3      # the variant changes the model


@pytest.mark.parametrize("n_head_kv", [1, 4])
def test_mqa_mha_and_tied_output(tmp_path, n_head_kv):
    path = write_tiny_model(tmp_path / "m.gguf", n_head_kv=n_head_kv, tied=True, qtype=T.Q8_0)
    tokens, ref = reference(path)
    assert rel_err(ours(path, tokens), ref) <= TOL_QUANTIZED


@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kv_types_match_llamacpp(tiny_models, arch, kv):
    """llama.cpp rounds K/V (and Q before Q·Kᵀ) the same way; flash attention on for quantized V."""
    tokens, ref = reference(tiny_models[arch], _LONG, kv)
    err = rel_err(ours(tiny_models[arch], tokens, kv), ref)
    assert err <= {"f16": 2e-3, "q8_0": 1e-2, "q4_0": 5e-2}[kv]


def test_unknown_architecture_is_refused(tmp_path):
    path = write_tiny_model(tmp_path / "g.gguf", arch="gemma2")
    with pytest.raises(UnsupportedModelError, match="llama, qwen2, qwen3") as exc:
        TorchEngine(_plan(path))
    assert "llama.cpp" in exc.value.hint


def test_unsupported_quant_type_is_refused(tmp_path):
    path = write_tiny_model(tmp_path / "iq.gguf", overrides={"ffn_down": T.IQ4_NL})
    with pytest.raises(UnsupportedModelError, match="IQ4_NL.*Q4_K") as exc:
        TorchEngine(_plan(path))
    assert "llama.cpp" in exc.value.hint


def test_mixture_of_experts_is_refused(tmp_path):
    kv = {"llama.expert_count": (4, V.UINT32), "llama.expert_used_count": (2, V.UINT32)}
    path = write_tiny_model(tmp_path / "moe.gguf", extra_kv=kv)
    with pytest.raises(UnsupportedModelError, match="experts"):
        TorchEngine(_plan(path))


def test_static_shape_decode_equals_eval(tiny_models):
    """The CUDA-graph step (attention over the whole cache under a device-built mask), run
    eagerly on the CPU, gives the logits a normal eval gives."""
    from cuda_backend.graphs import GraphDecoder

    eng = TorchEngine(LoadPlan(str(tiny_models["qwen2"]), n_ctx=3 * 64, n_seq=3, n_threads=1,
                               options={"quiet": True}))
    for s, text in enumerate(["a", "bb bb", "ccc ccc ccc"]):
        eng.eval(eng.tokenize(text), seq=s)
    lens = [eng.kv_len(s) for s in range(3)]
    static = GraphDecoder(eng.model, eng.cache, 3)(torch.tensor([7, 8, 9]), torch.tensor(lens)).numpy().copy()
    for s in range(3):
        np.testing.assert_allclose(static[s], eng.eval([7 + s], seq=s)[0], atol=1e-4, rtol=0)
