"""The llama.cpp engine on the embedded model: the engine contract, KV quantization, faults."""

import os
import signal
import threading

import numpy as np
import pytest

from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import get_backend, load_engine
from localinfer.errors import (
    ContextFullError,
    GGUFFormatError,
    ModelNotFoundError,
    UnsupportedModelError,
    UsageError,
)
from localinfer.model.spec import ModelSpec
from localinfer.units import MiB

TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


@pytest.fixture(scope="module")
def engine(default_model):
    with load_engine(LoadPlan(str(default_model), n_ctx=512, n_threads=1)) as e:
        yield e


@pytest.fixture(autouse=True)
def _clean(request):
    yield
    if "engine" in request.fixturenames:
        request.getfixturevalue("engine").trim(0)


def test_registered_as_llama_cpp():
    from localinfer.backends.llamacpp.engine import LlamaCppEngine

    assert get_backend("llama.cpp") is LlamaCppEngine
    assert get_backend("llamacpp") is LlamaCppEngine


def test_model_facts(engine, default_model):
    spec = ModelSpec.from_gguf(default_model)
    assert engine.n_vocab == spec.vocab_size
    assert spec.eos_token_id in engine.eos_ids
    assert engine.bos_id == spec.bos_token_id
    assert engine.n_ctx == 512


def test_special_tokens_are_parsed_only_when_asked(engine):
    assert engine.tokenize("<|im_start|>", special=True) == [1]
    plain = engine.tokenize("<|im_start|>", special=False)
    assert len(plain) > 1 and 1 not in plain
    assert engine.detokenize(plain) == "<|im_start|>"
    assert engine.detokenize(engine.tokenize("héllo wörld ✓")) == "héllo wörld ✓"


def test_logits_only_where_asked_in_the_order_asked(engine):
    toks = engine.tokenize(TEXT)
    none = engine.eval(toks, logits_at=[])
    assert none.shape == (0, engine.n_vocab)
    assert engine.kv_len() == len(toks)
    engine.trim(0)
    a = engine.eval(toks, logits_at=[0, -1])
    engine.trim(0)
    b = engine.eval(toks, logits_at=[-1, 0])
    np.testing.assert_array_equal(a[0], b[1])
    np.testing.assert_array_equal(a[1], b[0])
    assert engine.detokenize([int(a[1].argmax())]).strip() == "Rome"


def test_more_logit_rows_than_one_decode_returns(engine):
    toks = (engine.tokenize(TEXT) * 4)[:70]
    rows = engine.eval(toks, logits_at=list(range(70)))  # > n_outputs_max (64): split into two decodes
    assert rows.shape == (70, engine.n_vocab) and engine.kv_len() == 70
    engine.trim(0)
    last = engine.eval(toks, logits_at=[-1])[0]
    assert int(rows[-1].argmax()) == int(last.argmax())
    assert np.corrcoef(rows[-1], last)[0, 1] > 0.99


def test_trim_rewinds_and_replays_identically(engine):
    toks = engine.tokenize(TEXT)
    first = engine.eval(toks)[0]
    engine.eval([5, 6, 7])
    engine.trim(len(toks) - 3)
    assert engine.kv_len() == len(toks) - 3
    again = engine.eval(toks[-3:])[0]
    np.testing.assert_allclose(again, first, atol=1e-3)
    with pytest.raises(ValueError):
        engine.trim(engine.kv_len() + 1)


def test_context_overflow_is_refused_and_leaves_the_cache(engine):
    engine.eval(list(range(100, 120)), logits_at=[])
    with pytest.raises(ContextFullError) as err:
        engine.eval(list(range(100, 600)))
    assert err.value.needed == 520 and err.value.available == 512
    assert engine.kv_len() == 20


def test_the_one_token_decode_step_keeps_the_eval_contract(engine, monkeypatch):
    """Engine.eval's short path for one token: same logits, checks and rollback as the general path."""
    assert "eval" not in type(engine).__dict__            # the base class's short path, no backend copy
    toks = engine.tokenize(TEXT)
    engine.eval(toks[:-1], logits_at=[])
    steps = []
    for logits_at in (None, [0], [-1], [0, -1]):          # [0, -1] takes the general path
        steps.append(engine.eval(toks[-1:], logits_at))
        engine.trim(len(toks) - 1)
    assert all(s.dtype == np.float32 and s.shape[1] == engine.n_vocab for s in steps)
    for s in steps[1:]:
        np.testing.assert_array_equal(s[0], steps[0][0])
    assert engine.eval(toks[-1:], logits_at=[]).shape == (0, engine.n_vocab) and engine.kv_len() == len(toks)
    with pytest.raises(ValueError):
        engine.eval([5], logits_at=[1])

    def interrupted(rows):                                 # after llama_decode wrote the token's KV
        assert engine.kv_len() == len(toks) + 1
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "logit_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.eval([5])
    assert engine.kv_len() == len(toks)
    monkeypatch.undo()
    engine.eval(list(range(100, 100 + 512 - engine.kv_len())), logits_at=[])
    with pytest.raises(ContextFullError):
        engine.eval([5])
    assert engine.kv_len() == 512


def test_ctrl_c_aborts_a_long_prefill_and_rolls_back(default_model):
    with load_engine(LoadPlan(str(default_model), n_ctx=4096, n_batch=4096, n_ubatch=512, n_threads=1)) as e:
        e.eval([100, 101, 102])
        toks = (e.tokenize(TEXT) * 200)[:4000]
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            e.eval(toks, logits_at=[])
        timer.cancel()
        assert e.aborted == 1  # stopped inside llama_decode, not after it
        assert e.kv_len() == 3
        assert e.eval([103]).shape == (1, e.n_vocab)


def test_two_sequences_in_one_batch(default_model):
    with load_engine(LoadPlan(str(default_model), n_ctx=512, n_seq=2, n_threads=1)) as e:
        assert e.n_ctx == 256
        a, b = e.tokenize(TEXT), e.tokenize("One, two, three, four,")
        out = e.eval_batch({0: a, 1: b})
        assert (e.kv_len(0), e.kv_len(1)) == (len(a), len(b))
        e.trim(0, 0)
        e.trim(0, 1)
        np.testing.assert_allclose(e.eval(a, seq=0)[0], out[0], atol=0.5)
        assert int(e.eval(b, seq=1)[0].argmax()) == int(out[1].argmax())


def test_memory_is_what_llama_cpp_reports(engine, default_model):
    mem = engine.memory()
    assert mem["weights"] == ModelSpec.from_gguf(default_model).weight_bytes
    assert mem["kv"] > 0 and mem["compute"] > 0
    assert engine.kv_cells == 512


@pytest.mark.parametrize("kv,n_seq", [("f16", 1), ("q8_0", 1), ("q4_0", 1), ("q8_0", 2)])
def test_kv_bytes_llama_cpp_reports_equal_the_fit_prediction(default_model, kv, n_seq):
    from localinfer.plan.memory import kv_bytes

    spec = ModelSpec.from_gguf(default_model)
    plan = LoadPlan(str(default_model), n_ctx=1000, n_seq=n_seq, type_k=kv, type_v=kv, n_threads=1)
    with load_engine(plan) as e:
        reported = e.memory()["kv"]
        assert e.eval(e.tokenize(TEXT)).shape[0] == 1
    predicted = kv_bytes(spec, 1000 // n_seq, kv, kv, backend="llama.cpp", n_seq=n_seq)
    assert abs(reported - predicted) <= 0.005 * MiB  # llama.cpp logs MiB with two decimals
    assert predicted // e.kv_cells > 0.005 * MiB  # one cell more or less would fail the check above


def test_quantized_v_needs_flash_attention(default_model):
    with pytest.raises(UsageError) as err:
        load_engine(LoadPlan(str(default_model), n_ctx=256, type_v="q8_0", flash_attn=False))
    assert err.value.flag == "-ctv"


def test_quantized_kv_changes_logits_only_a_little(engine, default_model):
    toks = engine.tokenize(TEXT)
    ref = engine.eval(toks)[0]
    with load_engine(LoadPlan(str(default_model), n_ctx=512, type_k="q8_0", type_v="q8_0", n_threads=1)) as q:
        got = q.eval(toks)[0]
    assert int(got.argmax()) == int(ref.argmax())
    assert np.corrcoef(got, ref)[0, 1] > 0.98


def test_bad_model_files(tmp_path, tiny_gguf):
    with pytest.raises(ModelNotFoundError):
        load_engine(LoadPlan(str(tmp_path / "nope.gguf")))
    with pytest.raises(ModelNotFoundError):
        load_engine(LoadPlan(str(tmp_path)))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GGUFFormatError):
        load_engine(LoadPlan(str(junk)))
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFFormatError, match="truncated"):
        load_engine(LoadPlan(str(cut)))
    with pytest.raises(UnsupportedModelError, match="tokenizer merges"):  # the tiny file has no BPE merges
        load_engine(LoadPlan(str(tiny_gguf)))


def test_unknown_architecture_names_the_cause(tmp_path):
    from tests.support.ggufgen import write_tiny_llama

    path = write_tiny_llama(tmp_path / "foo.gguf", arch="foo")
    with pytest.raises(UnsupportedModelError, match="unknown model architecture"):
        load_engine(LoadPlan(str(path)))


def test_a_header_only_skeleton_is_refused_not_crashed(tmp_path):
    from gguf_tools.skeleton import write_skeleton

    path = write_skeleton("smollm2-135m", tmp_path / "skel.gguf")
    with pytest.raises(UnsupportedModelError, match="no tokenizer"):
        load_engine(LoadPlan(str(path), n_ctx=256))


def test_closed_engine_refuses_calls(default_model):
    e = load_engine(LoadPlan(str(default_model), n_ctx=256, n_threads=1))
    e.close()
    e.close()
    with pytest.raises(Exception, match="closed"):
        e.kv_len()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_other_architectures_kv_bytes_and_rewind(tiny_models, arch):
    from localinfer.generation.runner import Runner
    from localinfer.generation.sampling import SamplingParams
    from localinfer.plan.memory import kv_bytes

    spec = ModelSpec.from_gguf(tiny_models[arch])
    with load_engine(LoadPlan(str(tiny_models[arch]), n_ctx=256, type_k="q8_0", type_v="q4_0", n_threads=1)) as e:
        assert abs(e.memory()["kv"] - kv_bytes(spec, 256, "q8_0", "q4_0", backend="llama.cpp")) <= 0.005 * MiB
        runner = Runner(e)
        prompt = e.tokenize("hello world, hello")
        first = runner.generate(prompt, SamplingParams(temperature=0), max_tokens=6, ignore_eos=True).tokens
        runner.reset()
        again = runner.generate(prompt, SamplingParams(temperature=0), max_tokens=6, ignore_eos=True).tokens
        assert first == again and len(first) == 6


def test_a_stop_event_ends_a_load_or_a_context_in_any_thread(default_model):
    """A server's engine thread told to stop (``signals.stops_on``): the load stops at its first progress callback,
    and a context created as the event is set is freed and raised, never handed back (it was used after free)."""
    import llama_cpp as _L

    from localinfer.backends.llamacpp import native
    from localinfer.backends.vocab import VocabOnly
    from localinfer.util import signals

    plan = LoadPlan(str(default_model), n_ctx=256, n_seq=1, n_threads=1)
    got = {}

    def engine_thread():
        stop = threading.Event()
        model = native.load_model(str(default_model), plan)
        try:
            with signals.stops_on(stop):
                stop.set()                   # the signal arrives once the weights are in
                for name, make in (("context", lambda: native.new_context(model, plan)),
                                   ("load", lambda: native.load_model(str(default_model), plan)),
                                   ("vocab", lambda: VocabOnly(str(default_model)))):
                    try:
                        got[name] = make()
                    except KeyboardInterrupt:
                        got[name] = "stopped"
            got["after"] = signals.pending()  # the event is this block's only
        finally:
            _L.llama_model_free(model)

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join(60)
    assert got == {"context": "stopped", "load": "stopped", "vocab": "stopped", "after": None}
