"""Per-architecture GGUF layouts: the metadata and tensors llama.cpp's converter writes for each architecture.

One module per architecture family (``attention``: llama-style decoders; ``mla``, ``interleaved`` and others register beside it), each
naming the llama.cpp sources it follows (``src/models/<arch>.cpp``: ``load_arch_hparams`` for the keys,
``load_arch_tensors`` for the names and shapes).  A layout turns a normalized spec dict (``gguf_tools.skeleton``)
into GGUF metadata and a tensor table; ``skeleton`` writes them header-only, the tests' tiny-model writer
writes them with random weights, and llama.cpp loads both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from gguf import GGUFValueType

# spec field -> (python type, default or None when required, meaning)
Fields = dict[str, tuple[type | tuple, Any, str]]
Metadata = list[tuple[str, Any, GGUFValueType]]     # (key without the "{arch}." prefix or with "general."), value, type
Tensors = list[tuple[str, tuple[int, ...]]]         # (name, GGUF shape: row length first)


@dataclass(frozen=True)
class Layout:
    """What one architecture family writes."""

    archs: tuple[str, ...]
    normalize: Callable[[dict[str, Any]], None]     # check and complete the family's fields in place (ValueError)
    metadata: Callable[[dict[str, Any]], Metadata]  # keys relative to "{arch}." unless they contain a dot prefix
    tensors: Callable[[dict[str, Any]], Tensors]
    fields: Fields = field(default_factory=dict)   # spec fields the family adds
    source: str = ""                               # the llama.cpp sources it follows
    # KV heads per layer where they vary (hybrids: 0 on recurrent layers); None: n_head_kv on every layer
    head_kv_layers: Callable[[dict[str, Any]], list[int]] | None = None


_LAYOUTS: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    for arch in layout.archs:
        _LAYOUTS[arch] = layout
    return layout


_FAMILIES = ("attention", "mla", "interleaved", "hybrid")
_loaded = False


def _load() -> None:
    """Import every family module once (each registers its layouts), whichever was imported first."""
    global _loaded
    if not _loaded:
        import importlib

        for name in _FAMILIES:
            importlib.import_module(f"{__name__}.{name}")
        _loaded = True


def archs() -> tuple[str, ...]:
    """Every architecture a skeleton can be written for."""
    _load()
    return tuple(_LAYOUTS)


def layout_for(arch: str) -> Layout:
    """The layout of ``arch``; ValueError naming the supported architectures."""
    _load()
    if arch not in _LAYOUTS:
        raise ValueError(f"spec field 'arch' is {arch!r}; skeletons support {', '.join(_LAYOUTS)}")
    return _LAYOUTS[arch]


def all_fields() -> Fields:
    """The spec fields every family adds, merged."""
    _load()
    out: Fields = {}
    for layout in _LAYOUTS.values():
        out.update(layout.fields)
    return out
