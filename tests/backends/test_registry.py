"""The registry hands fit a backend's memory model by name: built-ins and plugins through the same hook."""

from __future__ import annotations

import json

import pytest

from localinfer.backends import registry
from localinfer.backends.memory import BackendMemory, OwnTensorsMemory, ResidentWeights
from localinfer.cli import main
from localinfer.devices.profiles import get_device
from localinfer.model.kv import kv_bytes_per_token
from localinfer.model.spec import ModelSpec
from localinfer.plan.fit import FitRequest, fit_device
from tests.support.fakes import ScriptedEngine


class ToyMemory(OwnTensorsMemory):
    """A plugin's memory rules: weights as in the file, KV exactly n_seq × n_tokens × bytes per token."""

    name = "toy"
    blocks = "single tokens"

    def runs_on(self, kind):
        return kind, None

    def resident_weights(self, spec, kind, dtype=None, *, packed=False):
        return ResidentWeights(spec.weight_bytes, kind, "file", "the file's tensor bytes")

    def kv_bytes(self, spec, n_tokens, type_k="f16", type_v="f16", *, n_seq=1, **_):
        return n_seq * n_tokens * kv_bytes_per_token(spec, type_k, type_v)

    def load_request(self, plan):
        return {}


@pytest.fixture
def plugins():
    added = []

    def add(name, memory):
        registry.register(name, ScriptedEngine, "pip install toy", memory=memory)
        added.append(name)

    yield add
    for name in added:
        registry._REGISTRY.pop(name, None)


@pytest.mark.parametrize("name", ["llama.cpp", "torch", "mlx"])
def test_built_in_backends_have_memory_models_without_their_runtime(name):
    model = registry.memory_model(name)
    assert isinstance(model, BackendMemory) and model.name == name


def test_a_plugin_with_a_memory_model_gets_its_own_fit(plugins, default_model, capsys):
    plugins("toy", ToyMemory())
    spec = ModelSpec.from_gguf(default_model)
    result = fit_device(spec, get_device("h200"), FitRequest(n_ctx=1000, n_seq=3, backend="toy"))
    assert result.breakdown.kv == 3 * 1000 * kv_bytes_per_token(spec)       # its rule, not llama.cpp's cells
    assert result.breakdown.weights == spec.weight_bytes and result.command == "" and result.fits
    assert main(["fit", str(default_model), "--backend", "toy", "--ctx", "1000", "--json", "--device", "h200"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["devices"][0]["breakdown"]["kv"] == 1000 * kv_bytes_per_token(spec)


def test_a_plugin_without_one_is_shown_llama_cpps_with_a_note(plugins, default_model):
    plugins("bare", None)
    spec = ModelSpec.from_gguf(default_model)
    dev = get_device("rtx-4090")
    bare = fit_device(spec, dev, FitRequest(n_ctx=2048, backend="bare"))
    llama = fit_device(spec, dev, FitRequest(n_ctx=2048))
    assert bare.breakdown.to_dict() == llama.breakdown.to_dict()
    assert any("bare: no memory model; fit shows llama.cpp's" in w for w in bare.warnings)
    assert not any("no memory model" in w for w in llama.warnings)


def test_an_unknown_backend_is_a_usage_error_naming_the_flag():
    from localinfer.errors import UsageError

    with pytest.raises(UsageError) as err:
        FitRequest(backend="vllm")
    assert err.value.flag == "--backend" and "llama.cpp" in err.value.hint
