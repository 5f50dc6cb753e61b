"""Backends by name, imported lazily: each name has an engine, usually a memory model, and maybe an executor.

The runner and the CLI ask for an engine by name; ``fit`` and ``plan`` ask for
the same name's memory model (:class:`localinfer.backends.memory.BackendMemory`),
whose module imports no torch, llama_cpp or mlx.  Nothing here imports a
backend until it is requested.  The built-in backends are registered exactly as
third-party ones: through :func:`register`, or the ``localinfer.backends``
entry-point group (value ``module:Class``; a memory model, if any, under the
same name in ``localinfer.backend_memory``, value ``module:object``).

A backend that serves (the step engine's :class:`~localinfer.backends.executor.Executor`)
registers an executor factory ``open(plan, *, running) -> Executor``: ``plan.n_seq``
sequence slots over ``plan.n_ctx`` KV cells in all, of which ``running`` run at once
(the rest may park finished requests' KV, where the backend does that).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from importlib import metadata

from localinfer.backends.engine import Engine, LoadPlan
from localinfer.errors import BackendUnavailableError, UsageError

DEFAULT_BACKEND = "llama.cpp"
ENGINE_GROUP = "localinfer.backends"
MEMORY_GROUP = "localinfer.backend_memory"


@dataclass(frozen=True)
class Backend:
    """One registered backend: its engine, its memory model (None: unmodelled) and how to install it."""

    name: str
    engine: str | type[Engine]          # "module:Class" or the class
    memory: str | object | None = None  # "module:object" or the object
    hint: str = ""
    executor: str | object | None = None  # "module:function" or the function: open(plan, *, running) -> Executor


_REGISTRY: dict[str, Backend] = {}
_ALIASES = {"llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "cpp": "llama.cpp", "pytorch": "torch", "cuda": "torch"}
_entry_points_loaded = False


def register(name: str, target: str | type[Engine], hint: str = "", *, memory: str | object | None = None,
             executor: str | object | None = None) -> None:
    """Make a backend available by name; target is an Engine subclass or ``"module:Class"``, memory a
    :class:`~localinfer.backends.memory.BackendMemory` or ``"module:object"`` (None: fit shows llama.cpp's),
    executor a serving executor factory or ``"module:function"`` (None: it does not serve)."""
    _REGISTRY[name] = Backend(name, target, memory, hint, executor)


register("llama.cpp", "localinfer.backends.llamacpp.engine:LlamaCppEngine",
         "pip install llama-cpp-python (see README for build flags)",
         memory="localinfer.backends.llamacpp.memory:MEMORY",
         executor="localinfer.backends.llamacpp.executor:open_serving")
register("torch", "cuda_backend.engine:TorchEngine", "pip install 'localinfer[torch]'",
         memory="cuda_backend.memory:MEMORY", executor="cuda_backend.serving:open_serving")
register("mlx", "localinfer.backends.mlx.engine:MLXEngine", "pip install 'localinfer[mlx]'",
         memory="localinfer.backends.mlx.memory:MEMORY")


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    memories = {ep.name: ep.value for ep in metadata.entry_points(group=MEMORY_GROUP)}
    for ep in metadata.entry_points(group=ENGINE_GROUP):
        if ep.name not in _REGISTRY:
            register(ep.name, ep.value, f"reinstall the package providing {ep.name}", memory=memories.get(ep.name))


def names() -> list[str]:
    _load_entry_points()
    return list(_REGISTRY)


def canonical(name: str) -> str:
    _load_entry_points()
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        raise UsageError(f"unknown backend {name!r}", flag="--backend", hint="use one of " + ", ".join(_REGISTRY))
    return name


def _resolve(target: str, name: str, hint: str):
    module_name, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(f"the {name} backend cannot be imported ({exc})", hint=hint,
                                      backend=name) from None
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def get_backend(name: str = DEFAULT_BACKEND) -> type[Engine]:
    """The engine class for a backend name, importing its module now."""
    entry = _REGISTRY[canonical(name)]
    if isinstance(entry.engine, type):
        return entry.engine
    return _resolve(entry.engine, entry.name, entry.hint)


def memory_model(name: str = DEFAULT_BACKEND):
    """The backend's memory model, or None when it registered none (its module imports no engine runtime).

    Resolved once: fit's searches ask for it on every candidate plan."""
    entry = _REGISTRY[canonical(name)]
    if entry.memory is None or not isinstance(entry.memory, str):
        return entry.memory
    model = _resolve(entry.memory, entry.name, entry.hint)
    _REGISTRY[entry.name] = replace(entry, memory=model)
    return model


def load_engine(plan: LoadPlan, backend: str = DEFAULT_BACKEND) -> Engine:
    """Load a model with the named backend."""
    return get_backend(backend)(plan)


def serving_backends() -> list[str]:
    """The backends with a serving executor."""
    _load_entry_points()
    return [name for name, b in _REGISTRY.items() if b.executor is not None]


def open_executor(plan: LoadPlan, backend: str = DEFAULT_BACKEND, *, running: int | None = None):
    """The named backend's serving executor over ``plan`` (``running``: slots that run at once, default all)."""
    entry = _REGISTRY[canonical(backend)]
    if entry.executor is None:
        raise UsageError(f"the {entry.name} backend has no serving executor", flag="--backend",
                         hint="use one of " + ", ".join(serving_backends()))
    factory = entry.executor if not isinstance(entry.executor, str) else _resolve(entry.executor, entry.name,
                                                                                 entry.hint)
    return factory(plan, running=plan.n_seq if running is None else running)
