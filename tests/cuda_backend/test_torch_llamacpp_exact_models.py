"""``llamacpp_rounding`` against llama.cpp on generated models of several shapes, all rows.

Random-weight GGUFs (tests/support/ggufgen.py) in the emulated weight types and
shapes the embedded model does not have: Q4_0 matrices that llama.cpp repacks
(its q4_0x8 gemm/gemv kernels, a different sum order than vec_dot), an untied
and a tied output matrix, qwen3's per-head Q/K norms, qwen2's biases, head
sizes 16, 32, 64, 80 (not a multiple of the 32-wide f16 loop), 96 (whose
1/sqrt(d) rounds an ulp apart in double and in float32), 128 and 256, grouped
and ungrouped KV heads, Llama 3's rope_freqs.  Each runs a 300-token prompt in one eval with logits at
every position (n_ctx 1024, flash attention on, f16 KV cache, as the llama.cpp
backend runs it: the later llama_decode calls see a 512-cell KV view and the
last one has fewer than 64 rows, so the one-row attention kernel), then decode
steps; every logit must equal llama.cpp's.

Like tests/cuda_backend/test_torch_llamacpp_exact.py these run only when the
loaded llama.cpp uses the x86 AVX2 kernels the emulation reproduces
(``ggml_numerics.kernel_mismatch()`` is None).  On an AVX-512 machine, build an
AVX2-only libllama from llama-cpp-python's vendored llama.cpp (cmake -DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF
-DBUILD_SHARED_LIBS=ON, target ``llama``) and point llama-cpp-python at it::

    LLAMA_CPP_LIB_PATH=/path/to/build/bin pytest tests/cuda_backend/ -k llamacpp_exact
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")
from gguf import GGMLQuantizationType as Q

from cuda_backend import ggml_numerics as G
from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from tests.support.ggufgen import write_tiny_model

_MISMATCH = G.kernel_mismatch()
needs_avx2 = pytest.mark.skipif(_MISMATCH is not None, reason=str(_MISMATCH))

TEXT = "The quick brown fox jumps over the lazy dog near the river bank while the old miller watches. "

# name: write_tiny_model arguments (head size = n_embd / n_head)
SHAPES = {
    # Q4_0 everywhere, 264-token vocabulary: every matrix, the output one included, is repacked
    "llama-q4_0-hd64": {"arch": "llama", "qtype": Q.Q4_0, "n_embd": 256, "n_head": 4, "n_head_kv": 2,
                        "n_extra_tokens": 5},
    # tied: llama.cpp loads token_embd again as the output matrix, and repacks that copy
    "llama-q4_0-tied-hd64": {"arch": "llama", "qtype": Q.Q4_0, "n_embd": 256, "n_head": 4, "n_head_kv": 2,
                             "n_extra_tokens": 5, "tied": True},
    "qwen3-q8_0-hd128": {"arch": "qwen3", "qtype": Q.Q8_0, "n_embd": 256, "n_head": 2, "n_head_kv": 1},
    "qwen3-q4_0-hd96": {"arch": "qwen3", "qtype": Q.Q4_0, "n_embd": 384, "n_head": 4, "n_head_kv": 2, "n_ff": 768},
    "qwen2-q8_0-hd32": {"arch": "qwen2", "qtype": Q.Q8_0, "n_embd": 256, "n_head": 8, "n_head_kv": 2},
    "llama-q4_1-hd80": {"arch": "llama", "qtype": Q.Q4_1, "n_embd": 320, "n_head": 4, "n_head_kv": 4, "n_ff": 640},
    "qwen3-q8_0-hd256": {"arch": "qwen3", "qtype": Q.Q8_0, "n_embd": 512, "n_head": 2, "n_head_kv": 1, "n_ff": 512},
    # Llama 3's per-frequency RoPE factors and a large base
    "llama-q8_0-hd16-ropefreqs": {"arch": "llama", "qtype": Q.Q8_0, "n_embd": 128, "n_head": 8, "n_head_kv": 2,
                                  "n_ff": 256, "rope_freqs": True, "rope_base": 500000.0},
    # mixed types in one model, a 259-token vocabulary (output not repacked)
    "llama-mixed-hd64": {"arch": "llama", "qtype": Q.Q4_0, "n_embd": 256, "n_head": 4, "n_head_kv": 1,
                         "output_qtype": Q.Q8_0,
                         "overrides": {"attn_v": Q.Q8_0, "ffn_down": Q.Q4_1, "token_embd": Q.Q4_1}},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact-models")
    return {name: write_tiny_model(root / f"{name}.gguf", ctx=2048, seed=i, **kw)
            for i, (name, kw) in enumerate(SHAPES.items())}


def _pair(path, **kw):
    kw = {"n_ctx": 1024, "n_threads": 1, "flash_attn": True, **kw}
    ours = load_engine(LoadPlan(str(path), options={"quiet": True, "llamacpp_rounding": True}, **kw), "torch")
    ref = load_engine(LoadPlan(str(path), options={"quiet": True}, **kw), "llama.cpp")
    return ours, ref


def _assert_equal(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if not np.array_equal(a, b):
        rows = np.nonzero((a != b).reshape(len(a), -1).any(-1))[0]
        raise AssertionError(f"{what}: {len(rows)} rows differ (first {rows[:5].tolist()}), "
                             f"max |d| {np.abs(a - b).max():.3g}")


def _prefill_and_decode(ours, ref, n_prompt: int, steps: int) -> None:
    ids = ref.tokenize(TEXT * (n_prompt // 40 + 1))[:n_prompt]
    assert len(ids) == n_prompt
    every = list(range(n_prompt))
    b = ref.eval(ids, logits_at=every)
    _assert_equal(ours.eval(ids, logits_at=every), b, f"{n_prompt}-token prefill")
    token = int(b[-1].argmax())
    for _ in range(steps):
        a, b = ours.eval([token])[0], ref.eval([token])[0]
        _assert_equal(a[None], b[None], f"decode at {ref.kv_len()}")
        token = int(b.argmax())


@needs_avx2
@pytest.mark.parametrize("name", list(SHAPES))
def test_every_row_equals_llamacpp_past_256_tokens(models, name):
    ours, ref = _pair(models[name])
    with ours, ref:
        _prefill_and_decode(ours, ref, 300, steps=3)


@needs_avx2
@pytest.mark.parametrize("name", ["llama-q4_0-hd64", "qwen3-q8_0-hd128"])
def test_two_threads_and_a_split_kv_decode_equal_llamacpp(models, name):
    """2 threads: a 600-token prompt, then decode steps over a 768-cell KV view (the split-KV kernel)."""
    ours, ref = _pair(models[name], n_threads=2)
    with ours, ref:
        _prefill_and_decode(ours, ref, 600, steps=2)


@needs_avx2
def test_a_1100_token_prompt_on_three_threads_equals_llamacpp(models):
    """KV views up to 1280 cells; the split-KV decode in three chunks."""
    ours, ref = _pair(models["llama-q4_0-hd64"], n_ctx=2048, n_threads=3)
    with ours, ref:
        _prefill_and_decode(ours, ref, 1100, steps=2)


@needs_avx2
@pytest.mark.parametrize("n_batch", [100, 37])
def test_eval_chunks_not_a_multiple_of_64_equal_llamacpp(models, n_batch):
    """n_batch chunks of the eval, each cut again after 64 logit rows, as the llama.cpp backend cuts them."""
    ours, ref = _pair(models["qwen3-q4_0-hd96"], n_batch=n_batch, n_ubatch=n_batch)
    with ours, ref:
        _prefill_and_decode(ours, ref, 290, steps=1)


@needs_avx2
def test_ubatch_smaller_than_batch_equals_llamacpp(models):
    """llama_decode runs a batch in n_ubatch-token graphs: 250 tokens in ubatches of 96 end
    in a 58-row graph, the one-row attention kernel.  The torch engine hands the plan's
    n_ubatch to the model, which cuts its forward there too (one 250-row graph would not do)."""
    ours, ref = _pair(models["llama-q4_0-hd64"], n_batch=512, n_ubatch=96)
    with ours, ref:
        assert ours.model.ggml_ubatch == 96
        ids = ref.tokenize(TEXT * 8)[:250]
        at = [5, 200, 249]
        want = ref.eval(ids, logits_at=at)
        _assert_equal(ours.eval(ids, logits_at=at), want, "250 tokens in ubatches of 96")
        ours.trim(0)
        ours.model.ggml_ubatch = 512
        assert not np.array_equal(ours.eval(ids, logits_at=at), want)      # one 250-row graph: tiled throughout


@needs_avx2
def test_n_outputs_max_option_equals_llamacpp_once_the_model_knows_it(models):
    """The llama.cpp backend's n_outputs_max option (logit rows per llama_decode) moves the
    graph boundaries; the torch engine hands the same option to the model."""
    path = models["qwen3-q8_0-hd128"]
    kw = {"n_ctx": 1024, "n_threads": 1, "flash_attn": True}
    opts = {"quiet": True, "n_outputs_max": 16}
    ours = load_engine(LoadPlan(str(path), options={**opts, "llamacpp_rounding": True}, **kw), "torch")
    ref = load_engine(LoadPlan(str(path), options=opts, **kw), "llama.cpp")
    with ours, ref:
        assert ours.model.ggml_outputs_max == 16
        ids = ref.tokenize(TEXT * 4)[:150]
        every = list(range(150))
        _assert_equal(ours.eval(ids, logits_at=every), ref.eval(ids, logits_at=every), "16 rows per llama_decode")


@needs_avx2
def test_repacked_q4_0_matmul_matches_llamacpp_to_the_bit(models):
    """The repacked q4_0x8 kernel (whole-block integer dot, one FMA per block, no lane sum)
    on tensors captured from llama.cpp's graph, against vec_dot's order, which it is not."""
    from gguf_tools import read_header
    from tests.support.ggml_capture import capture

    path = models["llama-q4_0-hd64"]
    with load_engine(LoadPlan(str(path), n_ctx=64, options={"quiet": True}), "llama.cpp") as eng:
        ids = eng.tokenize(TEXT * 3)[:70]
    step = capture(str(path), [ids], n_ctx=256, names=("attn_norm-0", "Qcur-0", "ffn_swiglu-0", "ffn_out-0"))[0]
    for src, name, dst in (("attn_norm", "attn_q", "Qcur"), ("ffn_swiglu", "ffn_down", "ffn_out")):
        info = read_header(path).tensor(f"blk.0.{name}.weight")
        raw = np.memmap(path, dtype=np.uint8, mode="r", offset=info.file_offset, shape=(info.n_bytes,))
        rows = info.n_elements // info.shape[0]
        x = torch.from_numpy(np.ascontiguousarray(step[f"{src}-0"][0])).reshape(70, -1)
        want = torch.from_numpy(np.ascontiguousarray(step[f"{dst}-0"][0])).reshape(70, -1)
        assert G.repacked_by_llamacpp(info.name, "Q4_0", rows)
        got = G.linear(x, G.BlockMatrix.from_blocks(raw, "Q4_0", rows, repacked=True))
        assert torch.equal(got, want), f"{name}: max |d| {float((got - want).abs().max())}"
        assert not torch.equal(G.linear(x, G.BlockMatrix.from_blocks(raw, "Q4_0", rows)), want)


def test_prefill_pieces_follow_the_llamacpp_backend():
    """Where a chunk is cut: after the 64th logit row (that row included), then into ubatches."""
    from cuda_backend.model import Transformer

    m = Transformer.__new__(Transformer)
    m.ggml_outputs_max, m.ggml_ubatch = 64, 512
    assert [(lo, hi) for lo, hi, _ in m._ggml_pieces(289, list(range(289)))] == [
        (0, 64), (64, 128), (128, 192), (192, 256), (256, 289)]
    assert m._ggml_pieces(300, [299]) == [(0, 300, [299])]
    assert m._ggml_pieces(10, []) == [(0, 10, [])]
    m.ggml_outputs_max = 2
    assert m._ggml_pieces(10, [7, 1, 3, 1]) == [(0, 4, [1, 3]), (4, 10, [7])]
    m.ggml_outputs_max, m.ggml_ubatch = 64, 96
    assert [(lo, hi) for lo, hi, _ in m._ggml_pieces(250, [5, 200, 249])] == [(0, 96), (96, 192), (192, 250)]
