"""Where a GGUF file's bytes go: value codes, quantization metadata, header, padding.

Every byte of the file lands in exactly one bucket::

    file_size = codes            value codes of quantized tensors
              + floats           tensors stored unquantized (F32/F16/BF16/int)
              + meta             per-block scales, mins, super-block scales
              + header           magic .. end of the tensor infos (metadata, vocabulary)
              + padding          alignment before the data section and between tensors
              + trailing         bytes after the last tensor's padded end

The summary reports ``codes + floats`` as one figure and ``header + padding +
trailing`` as another.  Bits per weight divide bytes × 8 by parameter count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .quants import layout
from .reader import GGUFHeader
from .text import safe_text


@dataclass(frozen=True)
class TypeBytes:
    """The tensors of one GGML type."""

    type: str
    n_tensors: int
    n_elements: int
    n_bytes: int
    code_bytes: int
    meta_bytes: int
    quantized: bool

    @property
    def bits_per_weight(self) -> float:
        return self.n_bytes * 8 / self.n_elements if self.n_elements else 0.0


@dataclass(frozen=True)
class Accounting:
    """The byte split of one GGUF file (all integers are bytes unless named n_*)."""

    file_size: int
    n_params: int
    codes: int
    floats: int
    meta: int
    header: int
    padding: int
    trailing: int
    by_type: tuple[TypeBytes, ...]

    @property
    def tensor_bytes(self) -> int:
        return self.codes + self.floats + self.meta

    @property
    def codes_and_floats(self) -> int:
        return self.codes + self.floats

    @property
    def header_and_padding(self) -> int:
        return self.header + self.padding + self.trailing

    @property
    def meta_fraction(self) -> float:
        """Share of the quantized tensors' bytes that is scales/mins."""
        q = self.codes + self.meta
        return self.meta / q if q else 0.0

    def bits_per_weight(self, n_bytes: int | None = None) -> float:
        """bytes × 8 / parameters; the whole file by default."""
        n = self.file_size if n_bytes is None else n_bytes
        return n * 8 / self.n_params if self.n_params else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["by_type"] = [{**asdict(t), "bits_per_weight": t.bits_per_weight} for t in self.by_type]
        d.update(tensor_bytes=self.tensor_bytes, codes_and_floats=self.codes_and_floats,
                 header_and_padding=self.header_and_padding, meta_fraction=self.meta_fraction,
                 bits_per_weight=self.bits_per_weight(), tensor_bits_per_weight=self.bits_per_weight(self.tensor_bytes))
        return d


def account(headers: GGUFHeader | list[GGUFHeader]) -> Accounting:
    """Split every byte of a file (or of every shard of a split model) into the buckets above."""
    shards = headers if isinstance(headers, list) else [headers]
    groups: dict[str, list[int]] = {}
    codes = floats = meta = head = padding = trailing = n_params = size = 0
    for h in shards:
        tensor_bytes = 0
        for t in h.tensors:
            lay = layout(t.type)
            c, m = lay.split(t.n_bytes)
            if lay.quantized:
                codes += c
            else:
                floats += c
            meta += m
            tensor_bytes += t.n_bytes
            n_params += t.n_elements
            g = groups.setdefault(t.type.name, [0, 0, 0, 0, 0, int(lay.quantized)])
            for i, v in enumerate((1, t.n_elements, t.n_bytes, c, m)):
                g[i] += v
        head += h.header_size
        data_start = min(h.data_offset, h.file_size)      # a file without tensors may end unpadded
        padding += (data_start - h.header_size) + (h.data_size - tensor_bytes)
        trailing += max(0, h.file_size - (data_start + h.data_size))
        size += h.file_size
    by_type = tuple(sorted((TypeBytes(name, *g[:5], bool(g[5])) for name, g in groups.items()),
                           key=lambda tb: -tb.n_bytes))
    return Accounting(file_size=size, n_params=n_params, codes=codes, floats=floats, meta=meta,
                      header=head, padding=padding, trailing=trailing, by_type=by_type)


def describe_value(value: Any, limit: int = 120) -> str:
    """A metadata value for a terminal: arrays summarised, strings escaped and cut."""
    if isinstance(value, list):
        head = ", ".join(safe_text(v, 24) for v in value[:4])
        more = ", …" if len(value) > 4 else ""
        return safe_text(f"[{len(value):,} items: {head}{more}]", limit)
    if isinstance(value, float):
        return f"{value:.7g}"
    return safe_text(value, limit)


def json_value(value: Any, limit: int = 4096) -> Any:
    """A metadata value for JSON: long strings cut, long arrays reduced to a count and a head."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + f"…[+{len(value) - limit} chars]"
    if isinstance(value, list):
        if len(value) <= 16:
            return [json_value(v, 256) for v in value]
        return {"count": len(value), "head": [json_value(v, 256) for v in value[:8]]}
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    return value


def active_parameters(header: GGUFHeader) -> int | None:
    """Parameters one token touches in an MoE model (experts scaled by used/total); None if dense."""
    arch = header.architecture or ""
    n_expert = header.get(f"{arch}.expert_count")
    n_used = header.get(f"{arch}.expert_used_count")
    if not (isinstance(n_expert, int) and isinstance(n_used, int) and 0 < n_used <= n_expert):
        return None
    total = 0
    for t in header.tensors:
        if "_exps." in t.name:
            total += t.n_elements // n_expert * n_used
        else:
            total += t.n_elements
    return total
