"""The torch backend on CUDA (skipped without a CUDA device): bf16 logits against float32 on
the CPU, CUDA-graph decode against eager decode, quantized KV on the device."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from gguf import GGMLQuantizationType as T

from cuda_backend.engine import TorchEngine
from cuda_backend.graphs import GraphDecoder
from localinfer.backends.engine import LoadPlan
from tests.support.ggufgen import write_tiny_model

TEXT = "the tiny model runs on the device"


def _engine(path, device, **kw) -> TorchEngine:
    return TorchEngine(LoadPlan(str(path), n_ctx=4 * 128, n_seq=4, device=device, options={"quiet": True}, **kw))


@pytest.mark.parametrize("qtype", [T.F16, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_cuda_bf16_matches_cpu_f32(tmp_path, qtype):
    path = write_tiny_model(tmp_path / "m.gguf", arch="qwen3", qtype=qtype)
    cpu, gpu = _engine(path, "cpu"), _engine(path, "cuda")
    assert gpu.device.type == "cuda" and gpu.dtype == torch.bfloat16
    tokens = cpu.tokenize(TEXT)
    ref = cpu.eval(tokens)[0]
    got = gpu.eval(tokens)[0]
    assert np.abs(got - ref).max() / np.abs(ref).max() < 3e-2       # bf16 weights and activations
    assert gpu.memory()["weights"] < 0.6 * cpu.memory()["weights"]   # bf16 matrices (norms stay f32)
    cpu.close()
    gpu.close()


@pytest.mark.parametrize("kv", ["bf16", "q8_0", "q4_0"])
def test_graph_decode_equals_eager(tmp_path, kv):
    path = write_tiny_model(tmp_path / "m.gguf", arch="llama")
    eng = _engine(path, "cuda", type_k=kv, type_v=kv)
    prompts = ["one", "two words", "three words here", "and a fourth one"]
    for s, p in enumerate(prompts):
        eng.eval(eng.tokenize(p), seq=s)
    lens = torch.tensor([eng.kv_len(s) for s in range(4)], device="cuda")
    tokens = torch.tensor([5, 6, 7, 8], device="cuda")
    with torch.inference_mode():
        eager = eng.model.decode(tokens, lens, eng.cache, n_attn=int(lens.max()) + 1).clone()
        graph = GraphDecoder(eng.model, eng.cache, 4)
        replay = graph(tokens, lens).clone()
        torch.testing.assert_close(replay, eager, atol=2e-2, rtol=0)
        again = graph(tokens + 1, lens)
        assert not torch.equal(again, replay)
    eng.close()
