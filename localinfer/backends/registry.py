"""Backends by name, imported lazily.

The runner and the CLI ask for an engine by name; nothing here imports torch,
llama_cpp or mlx until that backend is requested.  Third-party backends can
register through the ``localinfer.backends`` entry-point group (value
``module:Class``) or by calling :func:`register`.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from localinfer.backends.engine import Engine, LoadPlan
from localinfer.errors import BackendUnavailableError, UsageError

# name -> ("module:Class" or the class itself, pip hint)
_REGISTRY: dict[str, tuple[str | type[Engine], str]] = {
    "llama.cpp": ("localinfer.backends.llamacpp.engine:LlamaCppEngine", "pip install llama-cpp-python (see README for build flags)"),
    "torch": ("cuda_backend.engine:TorchEngine", "pip install 'localinfer[torch]'"),
    "mlx": ("localinfer.backends.mlx:MLXEngine", "pip install 'localinfer[mlx]'"),
}
_ALIASES = {"llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "cpp": "llama.cpp", "pytorch": "torch", "cuda": "torch"}
_entry_points_loaded = False

DEFAULT_BACKEND = "llama.cpp"


def register(name: str, target: str | type[Engine], hint: str = "") -> None:
    """Make a backend available by name; target is an Engine subclass or ``"module:Class"``."""
    _REGISTRY[name] = (target, hint)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group="localinfer.backends"):
        _REGISTRY.setdefault(ep.name, (ep.value, f"reinstall the package providing {ep.name}"))


def names() -> list[str]:
    _load_entry_points()
    return list(_REGISTRY)


def canonical(name: str) -> str:
    _load_entry_points()
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        raise UsageError(f"unknown backend {name!r}", flag="--backend", hint="use one of " + ", ".join(_REGISTRY))
    return name


def get_backend(name: str = DEFAULT_BACKEND) -> type[Engine]:
    """The engine class for a backend name, importing its module now."""
    name = canonical(name)
    target, hint = _REGISTRY[name]
    if isinstance(target, type):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the {name} backend cannot be imported ({exc})", hint=hint, backend=name
        ) from None
    cls = module
    for part in attr.split("."):
        cls = getattr(cls, part)
    return cls


def load_engine(plan: LoadPlan, backend: str = DEFAULT_BACKEND) -> Engine:
    """Load a model with the named backend."""
    return get_backend(backend)(plan)
