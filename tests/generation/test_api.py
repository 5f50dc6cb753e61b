"""The one-screen API (`localinfer.fit/load/generate/stream`) on the embedded model, against the layers below."""

from __future__ import annotations

import subprocess
import sys

import pytest

import localinfer
from localinfer.backends.memory import FitRequest
from localinfer.devices.profiles import get_device
from localinfer.errors import UsageError
from localinfer.model.spec import ModelSpec
from localinfer.plan.fit import fit_device

pytest.importorskip("llama_cpp")


def test_import_is_cheap_and_names_load_on_first_use():
    code = ("import sys, localinfer; heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('numpy', 'llama_cpp', 'torch', 'mlx', 'jinja2')]; "
            "r = localinfer.fit(device='h200', ctx=8192); "
            "print(heavy, r.fits, [m for m in sys.modules if m.split('.')[0] in ('llama_cpp', 'torch', 'mlx')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] True []"


def test_fit_is_fit_device_on_the_named_profile(default_model):
    spec = ModelSpec.from_gguf(default_model)
    api = localinfer.fit(device="rtx-4090", ctx=8192, parallel=2, kv_type="q8_0")
    direct = fit_device(spec, get_device("rtx-4090"), FitRequest(n_ctx=8192, n_seq=2, type_k="q8_0", type_v="q8_0"))
    assert api.to_dict() == direct.to_dict()
    assert localinfer.default_model() == default_model


@pytest.fixture(scope="module")
def engine():
    with localinfer.load(ctx=1024, threads=1, flash_attn=True) as e:
        yield e


def test_generate_equals_the_runner_and_stream_equals_generate(engine):
    from localinfer.generation.runner import Runner
    from localinfer.generation.sampling import SamplingParams

    text = localinfer.generate(engine, "The capital of France is", max_tokens=12, temperature=0)
    prompt = engine.tokenize("The capital of France is", add_bos=True)
    assert text == Runner(engine).generate(prompt, SamplingParams(greedy=True), max_tokens=12).text
    chunks = list(localinfer.stream(engine, "The capital of France is", max_tokens=12, temperature=0))
    assert "".join(c.text for c in chunks) == text and chunks[-1].finish_reason in ("stop", "length")
    assert localinfer.generate(engine, "def add(a, b):\n    return a + b\n\ndef add(", max_tokens=16,
                               temperature=0, lookup=True) == localinfer.generate(
        engine, "def add(a, b):\n    return a + b\n\ndef add(", max_tokens=16, temperature=0)


def test_messages_go_through_the_models_chat_template(engine):
    from localinfer.model.templates import template_for

    messages = [{"role": "user", "content": "Name a colour."}]
    spec = ModelSpec.from_gguf(localinfer.default_model())
    tokens = template_for(spec).tokens(engine, messages)
    assert engine.token_text(tokens[0]) == "<|im_start|>"      # SmolLM2's template, special tokens parsed
    reply = localinfer.generate(engine, messages, max_tokens=8, temperature=0)
    assert reply and "<|im_start|>" not in reply


def test_bad_options_are_usage_errors_naming_the_flag():
    with pytest.raises(UsageError) as err:
        localinfer.load(ctx=10**9)
    assert err.value.flag == "--ctx"
    with pytest.raises(UsageError) as err:
        localinfer.load(threads=0)
    assert err.value.flag == "--threads"
    with pytest.raises(AttributeError):
        localinfer.no_such_name  # noqa: B018
