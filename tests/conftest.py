import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from ggufgen import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def default_model() -> Path:
    from localinfer.models import default_model_path

    return default_model_path()
