"""Network link profiles for planning a split across hosts: bandwidth per direction and round-trip time.

Facts live in ``profiles/links/*.toml`` (``name``, ``display_name``, ``bandwidth``, ``rtt`` and a
``[sources]`` table citing where each number comes from), shipped as ``localinfer.profiles/links``.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from localinfer.errors import ProfileError, UsageError

_RTT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|µs|ms|s)\s*$")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kMGT]?)B/s\s*$")
_SCALE = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_TIME = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Link:
    name: str
    display_name: str
    bandwidth: float          # bytes/s, each direction
    rtt_s: float              # TCP round trip
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def transfer_s(self, nbytes: float, round_trips: float = 0) -> float:
        return round_trips * self.rtt_s + nbytes / self.bandwidth


def _parse(data: dict, origin: str) -> Link:
    def need(key):
        if key not in data:
            raise ProfileError(f"link profile {origin}: missing {key!r}", path=origin)
        return data[key]

    m, r = _RATE.match(str(need("bandwidth"))), _RTT.match(str(need("rtt")))
    if not m or not r:
        raise ProfileError(f"link profile {origin}: bandwidth like '117.6MB/s' and rtt like '0.2ms' expected",
                           path=origin)
    return Link(str(need("name")), str(data.get("display_name", data["name"])),
                float(m.group(1)) * _SCALE[m.group(2)], float(r.group(1)) * _TIME[r.group(2)],
                dict(data.get("sources", {})))


@lru_cache(maxsize=1)
def builtin_links() -> dict[str, Link]:
    out = {}
    folder = resources.files("localinfer.profiles").joinpath("links")
    if not folder.is_dir():   # a source checkout beside another editable install
        folder = Path(__file__).resolve().parents[2] / "profiles" / "links"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            link = _parse(tomllib.loads(entry.read_text(encoding="utf-8")), f"built-in:links/{entry.name}")
            out[link.name] = link
    return out


def get_link(name: str) -> Link:
    """A link profile by name (UsageError naming --link and the choices)."""
    links = builtin_links()
    key = name.strip().lower()
    if key not in links:
        raise UsageError(f"--link: unknown link {name!r}", flag="--link", hint="use one of " + ", ".join(links))
    return links[key]
