"""The torch backend's llama.cpp emulation (``llamacpp_rounding``) against llama.cpp itself.

With the option on, the torch model computes every step the way llama.cpp's
x86 CPU kernels do (cuda_backend/ggml_numerics.py): 8-bit activation blocks
and ggml's integer dot-product order for q4_0/q4_1/q8_0 weights, its SwiGLU
exp, its RoPE table, its RMS-norm rounding and its flash-attention kernels
(f16 running output for fewer than 64 query rows, the tiled float32 kernel
for more, the split-KV kernel for one token over 512+ cells on several threads).  So the logits are not close to llama.cpp's: they are the same
float32 numbers.  The kernels are checked one by one on tensors captured from
llama.cpp's own graph (tests/support/ggml_capture.py), and the whole model on the
embedded SmolLM2 Q4_1 file (f16 KV cache, flash attention on, the llama.cpp
backend's defaults); generated models of other shapes and prompts past 256
tokens, every row, are in test_torch_llamacpp_exact_models.py.

They run only when the loaded llama.cpp uses the x86 AVX2 kernels the emulation
reproduces (``kernel_mismatch()`` is None).  llama-cpp-python's own wheel is built
for the machine it was built on, AVX-512 where the CPU has it; point it at an
AVX2-only build of its vendored llama.cpp to run them there (how to build one: the
docstring of test_torch_llamacpp_exact_models.py)::

    LLAMA_CPP_LIB_PATH=/path/to/avx2/build/bin pytest tests/cuda_backend/ -k llamacpp_exact
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from cuda_backend import ggml_numerics as G
from gguf_tools import read_header
from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from tests.support.ggml_capture import capture, layout_ok

_MISMATCH = G.kernel_mismatch()
pytestmark = pytest.mark.skipif(_MISMATCH is not None, reason=str(_MISMATCH))

TEXT = "The quick brown fox jumps over the lazy dog near the river bank while the old miller watches. "


def _matrix(path, name: str) -> G.BlockMatrix:
    info = read_header(path).tensor(name)
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=info.file_offset, shape=(info.n_bytes,))
    return G.BlockMatrix.from_blocks(raw, info.type.name, info.n_elements // info.shape[0])


@pytest.fixture(scope="module")
def traces(default_model):
    """llama.cpp's tensors for a 5-token prompt (one-row attention kernel) and a 70-token one (tiled)."""
    with load_engine(LoadPlan(str(default_model), n_ctx=64, options={"quiet": True}), "llama.cpp") as eng:
        ids = eng.tokenize(TEXT * 4)
    out = {n: capture(str(default_model), [ids[:n]])[0] for n in (5, 70)}
    if not all(layout_ok(step, n, 576) for n, step in out.items()):
        pytest.skip("this llama-cpp-python's ggml_tensor layout differs from the one tests/ggml_capture.py reads")
    return out


def _t(a: np.ndarray, *shape: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).reshape(*shape)


@pytest.mark.parametrize("layer", [0, 7, 28])   # layer 29 keeps only the rows that get logits
def test_quantized_matmuls_match_llamacpp_to_the_bit(default_model, traces, layer):
    step = traces[5]
    for src, name, dst in (("attn_norm", "attn_q", "Qcur"), ("ffn_norm", "ffn_gate", "ffn_gate"),
                           ("ffn_swiglu", "ffn_down", "ffn_out")):
        x = _t(step[f"{src}-{layer}"][0], 5, -1)
        got = G.linear(x, _matrix(default_model, f"blk.{layer}.{name}.weight"))
        want = _t(step[f"{dst}-{layer}"][0], 5, -1)
        assert torch.equal(got, want), f"{name}: max |d| {float((got - want).abs().max())}"
        assert not torch.equal(got, torch.nn.functional.linear(x, _matrix(default_model, f"blk.{layer}.{name}.weight")
                                                                .rows(torch.arange(want.shape[1]))))


@pytest.mark.parametrize("layer", [0, 15, 29])
def test_swiglu_matches_llamacpp_to_the_bit(traces, layer):
    step = traces[5]
    gate, up = (_t(step[f"{n}-{layer}"][0], -1) for n in ("ffn_gate", "ffn_up"))
    want = _t(step[f"ffn_swiglu-{layer}"][0], -1)
    assert torch.equal(G.swiglu(gate, up), want)
    assert not torch.equal(torch.nn.functional.silu(gate) * up, want)     # torch's own exp differs


@pytest.mark.parametrize("n", [5, 70], ids=["one-row-kernel", "tiled-kernel"])
@pytest.mark.parametrize("layer", [0, 11, 29])
def test_flash_attention_matches_llamacpp_to_the_bit(traces, n, layer):
    step = traces[n]
    q = _t(step[f"Qcur-{layer}"][-1], n, 9, 64).permute(1, 0, 2)[None]         # after RoPE
    k = _t(step[f"Kcur-{layer}"][-1], n, 3, 64).half().float().permute(1, 0, 2)[None]
    v = _t(step[f"Vcur-{layer}"][-1], n, 3, 64).half().float().permute(1, 0, 2)[None]
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    got = G.flash_attention(q, k, v, mask, 0.125)
    want = _t(step[f"kqv_out-{layer}"][0], n, 9, 64).permute(1, 0, 2)[None]
    assert torch.equal(got, want), f"max |d| {float((got - want).abs().max())}"
    exact = torch.softmax((q @ k.repeat_interleave(3, 1).transpose(-1, -2) * 0.125).masked_fill(~mask, -torch.inf), -1)
    exact = exact @ v.repeat_interleave(3, 1)
    assert (got - exact).abs().max() < 2e-3 * exact.abs().max()               # and it is attention


def test_split_kv_decode_attention_matches_llamacpp_to_the_bit(default_model):
    """From a 512-cell KV view on, llama.cpp splits one-token attention over its threads
    and merges the partial results; at 2 threads that changes the numbers."""
    with load_engine(LoadPlan(str(default_model), n_ctx=64, options={"quiet": True}), "llama.cpp") as eng:
        ids = eng.tokenize(TEXT * 40)[:600]
    names = tuple(f"{n}-{layer}" for n in ("Qcur", "Kcur", "Vcur", "kqv_out") for layer in (0, 5))
    pre, dec = capture(str(default_model), [ids, [42]], n_ctx=1024, threads=2, names=names)
    for layer in (0, 5):
        k, v = (torch.cat([_t(pre[f"{n}-{layer}"][-1], 600, 3, 64), _t(dec[f"{n}-{layer}"][-1], 1, 3, 64)])
                .half().float().permute(1, 0, 2)[None] for n in ("Kcur", "Vcur"))
        q = _t(dec[f"Qcur-{layer}"][-1], 1, 9, 64).permute(1, 0, 2)[None]
        want = _t(dec[f"kqv_out-{layer}"][0], 1, 9, 64).permute(1, 0, 2)[None]
        # 601 cells used -> a 768-cell view (padded to 256) -> two chunks of 384
        assert torch.equal(G.flash_attention(q, k, v, None, 0.125, n_view=768, n_threads=2), want)
        assert not torch.equal(G.flash_attention(q, k, v, None, 0.125), want)


def test_rope_table_and_rotation_match_llamacpp_to_the_bit(traces):
    step = traces[5]
    cos, sin = G.rope_tables(64, 100000.0, 1.0, 5)
    pre = _t(step["Qcur-0"][0], 5, 9, 64)[None]
    got = G.rope_apply(pre, cos[None], sin[None], "norm")
    assert torch.equal(got, _t(step["Qcur-0"][-1], 1, 5, 9, 64))


def _engines(path, threads, n_batch):
    kw = {"n_ctx": 128, "n_threads": threads, "n_batch": n_batch, "n_ubatch": n_batch}
    ours = load_engine(LoadPlan(str(path), options={"quiet": True, "llamacpp_rounding": True}, **kw), "torch")
    ref = load_engine(LoadPlan(str(path), options={"quiet": True}, **kw), "llama.cpp")
    return ours, ref


@pytest.mark.parametrize("threads,n_batch", [(1, 512), (2, 4)])   # 4: the prompt in chunks, the first without logits
def test_logits_equal_llamacpp_through_prefill_and_decode(default_model, threads, n_batch):
    ours, ref = _engines(default_model, threads, n_batch)
    with ours, ref:
        ids = ref.tokenize("Water boils at a temperature of")
        at = [0, len(ids) - 1]
        a, b = ours.eval(ids, logits_at=at), ref.eval(ids, logits_at=at)
        assert np.array_equal(a, b), f"prefill: max |d| {np.abs(a - b).max()}"
        token = int(b[-1].argmax())
        for _ in range(4):
            a, b = ours.eval([token])[0], ref.eval([token])[0]
            assert np.array_equal(a, b), f"decode at {ours.kv_len()}: max |d| {np.abs(a - b).max()}"
            token = int(b.argmax())


@pytest.mark.slow
def test_every_row_of_a_289_token_prompt_equals_llamacpp(default_model):
    """The case that once failed: logits at every position of a 289-token prompt in one eval
    (1 thread, n_ctx 1024).  The llama.cpp backend asks at most 64 rows per llama_decode, so
    rows 256-288 run as a 33-row graph, the one-row attention kernel; the torch model used to
    run all 289 rows through the tiled one (rows 256 on differed by up to 1.0)."""
    kw = {"n_ctx": 1024, "n_threads": 1, "flash_attn": True}
    ours = load_engine(LoadPlan(str(default_model), options={"quiet": True, "llamacpp_rounding": True}, **kw), "torch")
    ref = load_engine(LoadPlan(str(default_model), options={"quiet": True}, **kw), "llama.cpp")
    with ours, ref:
        ids = ref.tokenize(TEXT * 20)[:289]
        assert len(ids) == 289
        every = list(range(289))
        a, b = ours.eval(ids, logits_at=every), ref.eval(ids, logits_at=every)
        assert np.array_equal(a, b), f"rows {np.nonzero((a != b).any(-1))[0][:5].tolist()}...: max |d| {np.abs(a - b).max()}"
