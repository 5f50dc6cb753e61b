"""Fixtures every test folder shares: tiny generated GGUFs and the embedded model."""

import signal
from pathlib import Path

import pytest

from tests.support.ggufgen import write_tiny_llama, write_tiny_model

# Tests that send SIGINT to themselves expect Python's KeyboardInterrupt; a runner started with SIGINT ignored
# (nohup, some CI shells) passes SIG_IGN on, and they would wait for an interrupt that never comes.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def default_model() -> Path:
    from localinfer.model.sources import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Random-weight F32 llama, qwen2 and qwen3 models that llama.cpp loads and tokenizes."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: write_tiny_model(root / f"{arch}.gguf", arch=arch) for arch in ("llama", "qwen2", "qwen3")}
