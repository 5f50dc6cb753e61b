"""Byte units, one place.  GiB means 2**30 and GB means 10**9, never mixed."""

from __future__ import annotations

import math
import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
KB = 10**3
MB = 10**6
GB = 10**9
TB = 10**12

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "kb": KB,
    "m": MiB, "mib": MiB, "mb": MB,
    "g": GiB, "gib": GiB, "gb": GB,
    "t": TiB, "tib": TiB, "tb": TB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Parse ``"12GiB"``, ``"96 GB"``, ``"512M"`` or a plain number of bytes into bytes.

    Bare ``K``/``M``/``G``/``T`` are binary (as llama.cpp and most tools print them).
    Raises ``ValueError`` naming the accepted forms.
    """
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return int(text)
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"cannot read size {text!r}; use e.g. 12GiB, 96GB, 512MiB or a byte count")
    return int(round(float(match.group(1)) * _SIZE_UNITS[unit]))


def gib(n: int | float) -> float:
    return n / GiB


def mib(n: int | float) -> float:
    return n / MiB


def fmt_bytes(n: int | float, *, binary: bool = True, digits: int = 2) -> str:
    """Human size: ``fmt_bytes(1.5*GiB) == '1.50 GiB'``; ``binary=False`` prints GB/MB."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if binary:
        steps = ((TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"))
    else:
        steps = ((TB, "TB"), (GB, "GB"), (MB, "MB"), (KB, "kB"))
    for size, name in steps:
        if n >= size:
            return f"{sign}{n / size:.{digits}f} {name}"
    return f"{sign}{int(n)} B"


def fmt_mib(n: int | float, digits: int = 1) -> str:
    return f"{n / MiB:,.{digits}f} MiB"


def fmt_rate(bytes_per_s: float) -> str:
    """Bandwidth in decimal GB/s (the unit vendors quote)."""
    return f"{bytes_per_s / GB:,.1f} GB/s"


def fmt_duration(seconds: float | None) -> str:
    """A duration in s, ms or µs (3 significant-ish digits); "—" when unknown or infinite."""
    if seconds is None or not math.isfinite(seconds):
        return "—"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def ceil_div(a: int, b: int) -> int:
    """⌈a / b⌉ in integers."""
    return -(-a // b)


def pad_to(n: int, multiple: int) -> int:
    """n rounded up to a multiple: pad_to(300, 256) = 512."""
    return ceil_div(n, multiple) * multiple
