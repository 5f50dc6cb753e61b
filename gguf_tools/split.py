"""Split GGUF models: ``name-00001-of-00003.gguf`` ... read as one model.

llama.cpp's gguf-split (and GGUFWriter with ``split_max_size``) writes the
metadata into the first shard and marks every shard with ``split.no``
(0-based), ``split.count`` and ``split.tensors.count``.  This module finds the
sibling shards, checks that each exists and agrees, and merges their tensor
tables; a missing or mismatched shard is a GGUFFormatError naming it.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from .errors import GGUFFormatError
from .reader import GGUFHeader, read_header

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_SHARDS = 9999


def shard_name(prefix: str, no: int, count: int) -> str:
    """File name of shard ``no`` (0-based) of ``count``, as llama.cpp names them."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def _count(h: GGUFHeader) -> int:
    n = h.kv.get(SPLIT_COUNT, 0)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_SHARDS:
        raise GGUFFormatError(f"{SPLIT_COUNT} is {n!r}; expected 1..{MAX_SHARDS}", field=SPLIT_COUNT, path=h.path)
    return n


def read_shards(path: str | os.PathLike) -> list[GGUFHeader]:
    """The headers of every shard of the model ``path`` belongs to ([one] for an unsplit file)."""
    first = read_header(path)
    count = _count(first)
    if count <= 1:
        return [first]
    p = Path(first.path)
    m = _NAME.match(p.name)
    if not m or int(m["count"]) != count:
        raise GGUFFormatError(
            f"this is shard {first.kv.get(SPLIT_NO, 0)} of a {count}-part split model but its name is not "
            "PREFIX-0000N-of-0000M.gguf, so the other shards cannot be found",
            field=SPLIT_COUNT, path=first.path, hint="keep the shard file names llama.cpp's gguf-split gave them",
        )
    prefix = str(p.with_name(m["prefix"]))
    paths = [Path(shard_name(prefix, i, count)) for i in range(count)]
    missing = [q.name for q in paths if not q.exists()]
    if missing:
        raise GGUFFormatError(
            f"split model shard {missing[0]} is missing ({len(missing)} of {count} shards absent)",
            field=SPLIT_COUNT, path=first.path, hint="download every shard into the same directory",
            missing=missing,
        )
    headers = [first if q == p else read_header(q) for q in paths]
    names: set[str] = set()
    for i, h in enumerate(headers):
        if h.kv.get(SPLIT_NO) != i or _count(h) != count:
            raise GGUFFormatError(
                f"{Path(h.path).name} says it is shard {h.kv.get(SPLIT_NO)} of {h.kv.get(SPLIT_COUNT)}; "
                f"expected shard {i} of {count}", field=SPLIT_NO, path=h.path,
                hint="the shards come from different downloads; fetch them again",
            )
        for t in h.tensors:
            if t.name in names:
                raise GGUFFormatError(f"tensor {t.name} appears in two shards", field="tensor.name", path=h.path)
            names.add(t.name)
    declared = headers[0].kv.get(SPLIT_TENSORS)
    if isinstance(declared, int) and declared != len(names):
        raise GGUFFormatError(
            f"{SPLIT_TENSORS} is {declared} but the {count} shards hold {len(names)} tensors",
            field=SPLIT_TENSORS, path=headers[0].path, hint="a shard is from another download; fetch them again",
        )
    return headers


def merge(headers: list[GGUFHeader]) -> GGUFHeader:
    """One header for a whole split model: the first shard's metadata, every shard's tensors.

    ``file_size`` and ``bytes_read`` are summed; offsets stay relative to each shard's own file.
    """
    if len(headers) == 1:
        return headers[0]
    first = headers[0]
    tensors = [t for h in headers for t in h.tensors]
    return replace(first, tensors=tensors, file_size=sum(h.file_size for h in headers),
                   bytes_read=sum(h.bytes_read for h in headers), _by_name={})


def read_model_header(path: str | os.PathLike) -> GGUFHeader:
    """read_header for a model that may be split: every shard checked, tensors merged."""
    return merge(read_shards(path))
