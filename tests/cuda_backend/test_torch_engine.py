"""TorchEngine through the registry on the embedded model, against the llama.cpp backend."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from cuda_backend.engine import TorchEngine
from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from localinfer.errors import ContextFullError
from localinfer.plan.memory import kv_bytes

# Chunked or batched evaluation changes matmul blocking, hence summation order; a K or V value
# one float32 ulp away can round to the neighbouring f16 in the cache.  Measured: 3e-5 with an
# f32 cache, up to 5e-3 with f16 (logits of ~16); a wrong mask or position costs whole units.
ATOL = 2e-2
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "My favourite food is"]


def _plan(path, **kw) -> LoadPlan:
    base = {"n_ctx": 4 * 160, "n_seq": 4, "n_threads": 1, "options": {"quiet": True}}
    return LoadPlan(str(path), **{**base, **kw})


@pytest.fixture(scope="module")
def engines(default_model):
    torch_eng = load_engine(_plan(default_model), "torch")
    cpp = load_engine(_plan(default_model, n_seq=1, n_ctx=160), "llama.cpp")
    yield torch_eng, cpp
    torch_eng.close()
    cpp.close()


def test_registry_loads_the_torch_engine(engines, default_model):
    eng, _ = engines
    assert isinstance(eng, TorchEngine) and eng.name == "torch"
    assert eng.n_ctx == 160 and eng.n_vocab == 49152
    mem = eng.memory()
    n_params = sum(t.n_elements for t in eng.spec.tensors)
    assert mem["weights"] == 4 * n_params                  # every tensor in float32 on the CPU
    assert mem["kv"] == kv_bytes(eng.spec, 160, "f16", "f16", backend="torch", n_seq=4)


def test_tokens_and_pieces_equal_llamacpp(engines):
    eng, cpp = engines
    texts = ["Hello, world!", "  leading spaces\tand tabs\n", "naïve café – 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        for special in (False, True):
            assert eng.tokenize(text, special=special) == cpp.tokenize(text, special=special)
        assert eng.tokenize(text, add_bos=True) == cpp.tokenize(text, add_bos=True)
    assert eng.tokenize("<|im_start|>", special=True) != eng.tokenize("<|im_start|>")
    for token in list(range(300)) + [1, 2, 49151]:
        assert eng.token_bytes(token) == cpp.token_bytes(token)
    assert eng.detokenize(eng.tokenize("naïve café")) == "naïve café"
    assert eng.bos_id == cpp.bos_id and eng.eos_ids == cpp.eos_ids


def test_logits_at_chunks_and_batches_agree(engines, monkeypatch):
    eng, _ = engines
    tokens = eng.tokenize("one two three four five six seven eight nine ten")
    eng.trim(0)
    whole = eng.eval(tokens, logits_at=[-1, 0, 4])
    assert whole.shape == (3, eng.n_vocab) and whole.dtype == np.float32
    eng.trim(0)
    assert eng.eval(tokens, logits_at=[]).shape == (0, eng.n_vocab)
    assert eng.kv_len() == len(tokens)
    eng.trim(0)
    with monkeypatch.context() as m:
        m.setattr(eng, "plan", eng.plan.with_(n_batch=3))      # evaluated in chunks of 3 tokens
        np.testing.assert_allclose(eng.eval(tokens, logits_at=[-1, 0, 4]), whole, atol=ATOL, rtol=0)
    # one batched decode step over four sequences == four single steps
    for seq, prompt in enumerate(PROMPTS):
        eng.trim(0, seq)
        eng.eval(eng.tokenize(prompt), seq=seq)
    batched = eng.eval_batch({seq: [42 + seq] for seq in range(4)})
    for seq in range(4):
        assert eng.kv_len(seq) == len(eng.tokenize(PROMPTS[seq])) + 1
        eng.trim(eng.kv_len(seq) - 1, seq)
        np.testing.assert_allclose(batched[seq], eng.eval([42 + seq], seq=seq)[0], atol=ATOL, rtol=0)
    odd = eng.eval_batch({3: [7], 1: [8]})
    assert sorted(odd) == [1, 3]


def test_context_full_and_bad_ids(engines):
    eng, _ = engines
    eng.trim(0, 2)
    with pytest.raises(ContextFullError):
        eng.eval([5] * 161, seq=2)
    assert eng.kv_len(2) == 0
    with pytest.raises(ValueError, match="token ids"):
        eng.eval([eng.n_vocab], seq=2)
    assert eng.kv_len(2) == 0


def test_interrupt_mid_prompt_rolls_back(engines, monkeypatch):
    eng, _ = engines
    eng.trim(0, 1)
    eng.eval([10, 11, 12], seq=1)
    calls = []
    real = eng.model.prefill

    def interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(eng.model, "prefill", interrupted)
    monkeypatch.setattr(eng, "plan", eng.plan.with_(n_batch=4))
    with pytest.raises(KeyboardInterrupt):
        eng.eval(list(range(100, 112)), seq=1)
    assert eng.kv_len(1) == 3


def test_cpu_fallback_notice(default_model, capfd):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    eng = TorchEngine(_plan(default_model, n_seq=1, n_ctx=32, device="cuda"))
    assert eng.device.type == "cpu"
    assert capfd.readouterr().err.count("\n") == 1
    eng.close()
    eng.close()


def _greedy(cpp, prompt: str, n: int) -> list[int]:
    cpp.trim(0)
    logits = cpp.eval(cpp.tokenize(prompt))[0]
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = cpp.eval([out[-1]])[0]
    return out


def test_follows_llamacpp_as_closely_as_llamacpp_follows_itself(engines, default_model):
    """Teacher-forced on llama.cpp's greedy continuations: the torch engine's logits differ
    from llama.cpp's (flash attention on, its default here) by no more than llama.cpp's
    own two attention paths differ from each other, measured in the same run."""
    eng, cpp = engines
    cpp_plain = load_engine(_plan(default_model, n_seq=1, n_ctx=160, flash_attn=False), "llama.cpp")
    worst_ours = worst_cpp = 0.0
    agree = total = 0
    for prompt in PROMPTS:
        prompt_ids = cpp.tokenize(prompt)
        seq = prompt_ids + _greedy(cpp, prompt, 24)
        at = list(range(len(prompt_ids) - 1, len(seq)))
        cpp.trim(0)
        cpp_plain.trim(0)
        eng.trim(0)
        ref = cpp.eval(seq, logits_at=at)
        other = cpp_plain.eval(seq, logits_at=at)
        mine = eng.eval(seq, logits_at=at)
        worst_ours = max(worst_ours, float(np.abs(mine - ref).max()))
        worst_cpp = max(worst_cpp, float(np.abs(other - ref).max()))
        agree += int((mine.argmax(1) == ref.argmax(1)).sum())
        total += len(at)
    cpp_plain.close()
    assert worst_ours <= 1.5 * max(worst_cpp, 0.1), (worst_ours, worst_cpp)
    assert agree >= 0.9 * total
