"""A memo that lives as long as the object it describes (a ModelSpec hashes all its tensors, which is slow)."""

from __future__ import annotations

import weakref

_SPEC_CACHES: dict[int, tuple[weakref.ref, dict]] = {}


def spec_cache(spec) -> dict:
    """A memo dict that lives as long as ``spec`` (ModelSpec hashes all its tensors, which is slow)."""
    key = id(spec)
    hit = _SPEC_CACHES.get(key)
    if hit is not None and hit[0]() is spec:
        return hit[1]
    if len(_SPEC_CACHES) > 64:
        for k in [k for k, (ref, _) in _SPEC_CACHES.items() if ref() is None]:
            del _SPEC_CACHES[k]
    memo: dict = {}
    _SPEC_CACHES[key] = (weakref.ref(spec), memo)
    return memo

