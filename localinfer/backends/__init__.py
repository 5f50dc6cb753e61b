"""Backends: the Engine contract, the registry of engines by name, and each backend's memory model.

``register``/``load_engine``/``get_backend`` are re-exported from :mod:`localinfer.backends.registry`.
"""

from localinfer.backends.registry import DEFAULT_BACKEND, canonical, get_backend, load_engine, names, register

__all__ = ["DEFAULT_BACKEND", "canonical", "get_backend", "load_engine", "names", "register"]
