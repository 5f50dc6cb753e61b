"""GGUFs that are valid but not complete models: the spec says precisely what each one is."""

from __future__ import annotations

import pytest

from gguf_tools import GGUFFormatError
from localinfer.errors import UnsupportedModelError
from localinfer.model.spec import ModelSpec
from tests.support.ggufgen import write_not_a_model


@pytest.mark.parametrize("kind, says", [("vocab", "vocab-only file: no weights"),
                                        ("adapter", "LoRA adapter: not a model"),
                                        ("mmproj", "multimodal projector: not a model")])
def test_general_type_says_what_the_file_is(tmp_path, kind, says):
    # was: "this GGUF is a adapter file"; vocab-only files were told to re-download
    err = pytest.raises(GGUFFormatError, ModelSpec.from_gguf, write_not_a_model(tmp_path / "f.gguf", kind)).value
    assert err.message == says and err.field == "general.type" and "re-download" not in err.hint


@pytest.mark.parametrize("kind, says", [("vocab-untyped", "vocab-only file: no weights"),
                                        ("no-tensors", "the file holds no tensors: no weights")])
def test_a_spec_without_tensors_has_no_weights_to_run(tmp_path, kind, says):
    # was: a file with every key and zero tensors "fits" with 0 weights
    spec = ModelSpec.from_gguf(write_not_a_model(tmp_path / "f.gguf", kind))   # header-only specs still build
    err = pytest.raises(UnsupportedModelError, spec.require_weights).value
    assert str(err).endswith(says) and err.hint
