"""ModelSpec's norm and RoPE keys: read once for every engine, defaults as llama.cpp applies them."""

import pytest
from gguf import GGUFValueType as V
from gguf import GGUFWriter

from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from localinfer.errors import GGUFFormatError
from localinfer.model.spec import DEFAULT_RMS_EPS, DEFAULT_ROPE_BASE, ModelSpec
from tests.support.ggufgen import write_tiny_model


def _header_only(path, **kv):
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_head_count(4)
    for key, (value, vtype) in kv.items():
        w.add_key_value(f"llama.{key}", value, vtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_keys_a_file_leaves_out_take_the_one_default(tmp_path):
    spec = ModelSpec.from_gguf(_header_only(tmp_path / "bare.gguf"))
    assert spec.rms_eps == DEFAULT_RMS_EPS and spec.rope_base == DEFAULT_ROPE_BASE and spec.rope_freq_base is None
    assert spec.n_rot == spec.head_dim_k == 16 and spec.rope_dim is None
    assert spec.rope_freq_scale == 1.0 and spec.yarn_orig_ctx == spec.n_ctx_train == 128


def test_keys_a_file_sets_are_read(tmp_path):
    spec = ModelSpec.from_gguf(_header_only(
        tmp_path / "set.gguf", **{"attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32),
                                  "rope.dimension_count": (8, V.UINT32),
                                  "rope.scaling.type": ("yarn", V.STRING), "rope.scaling.factor": (4.0, V.FLOAT32),
                                  "rope.scaling.original_context_length": (32, V.UINT32)}))
    assert spec.rms_eps == pytest.approx(1e-5) and spec.n_rot == 8
    assert spec.rope_scaling == "yarn" and spec.rope_freq_scale == 0.25 and spec.yarn_orig_ctx == 32


@pytest.mark.parametrize("value", [("tiny", V.STRING), (0.0, V.FLOAT32), (-1e-6, V.FLOAT32), (True, V.BOOL)])
def test_a_bad_epsilon_is_a_format_error_naming_the_key(tmp_path, value):
    path = _header_only(tmp_path / "bad.gguf", **{"attention.layer_norm_rms_epsilon": value})
    with pytest.raises(GGUFFormatError) as err:
        ModelSpec.from_gguf(path)
    assert err.value.field == "llama.attention.layer_norm_rms_epsilon"


@pytest.mark.parametrize("extra", [{}, {"llama.rope.scale_linear": (2.0, V.FLOAT32)},
                                   {"llama.rope.scaling.factor": (8.0, V.FLOAT32)}])
def test_the_rope_scale_is_the_one_llamacpp_loads(tmp_path, extra):
    """rope.scaling.factor, else the older rope.scale_linear; llama.cpp stores 1 / factor."""
    import llama_cpp

    path = write_tiny_model(tmp_path / "m.gguf", n_embd=64, n_ff=128, extra_kv=extra)
    with load_engine(LoadPlan(str(path), n_ctx=64, n_threads=1, options={"quiet": True}), "llama.cpp") as eng:
        theirs = llama_cpp.llama_model_rope_freq_scale_train(eng.model_handle)
    assert ModelSpec.from_gguf(path).rope_freq_scale == pytest.approx(theirs)
