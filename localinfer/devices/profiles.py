"""Device profiles: the facts `fit` and the planner need about a machine.

Profiles are TOML files (schema in ``profiles/README.md``): the built-ins ship
as the package ``localinfer.profiles``; users add their own in
``~/.config/localinfer/profiles/*.toml`` or in the directories listed in
``$LOCALINFER_PROFILES`` (``os.pathsep``-separated; files allowed too).  A user
profile with the same ``name`` as a built-in replaces it.

``local_device()`` describes the machine localinfer runs on: RAM through
psutil, CUDA devices through torch only when torch is already imported (or
``probe_cuda=True``), and on macOS the GPU working-set cap.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from localinfer.devices.kernels import check_table
from localinfer.errors import ProfileError, UsageError
from localinfer.units import GB, GiB, parse_size
from localinfer.util.files import MISSING, NOT_REGULAR, TOO_LARGE, read_capped

KINDS = ("cuda", "metal", "cpu")
LOCAL_NAME = "local"
USER_DIR = Path("~/.config/localinfer/profiles")
ENV_VAR = "LOCALINFER_PROFILES"
DEFAULT_LOCAL_RESERVE = "10%"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
MAX_SIZE = 1 << 50       # 1 PiB: more memory than any one device or host has
MAX_RATE = 1e18          # per second: above any device's bandwidth (B/s) or dense FLOP/s
MAX_POWER_W = 1e6
MAX_PROFILE_BYTES = 1 << 20
_MEMORY_RE = re.compile(r"^(HBM|GDDR|LPDDR|DDR)[0-9][A-Za-z0-9]{0,3}$", re.IGNORECASE)


@dataclass(frozen=True)
class DeviceProfile:
    """One device.  Bytes are integers; rates are per second (bandwidth in bytes/s).

    ``decode_mbu`` / ``prefill_mfu`` are ``((batch, fraction), ...)`` sorted by
    batch; use :meth:`decode_mbu_at` / :meth:`prefill_mfu_at` to read them.
    """

    name: str
    display_name: str
    kind: str                               # "cuda" | "metal" | "cpu"
    memory_bytes: int
    reserve: str                            # the policy as written: "8GiB" or "10%"
    unified: bool
    working_set_cap_bytes: int | None = None
    bandwidth_bytes_per_s: float | None = None
    bf16_flops: float | None = None         # dense peak, FLOP/s
    fp16_flops: float | None = None         # dense FP16 tensor peak (FP16 accumulate where the chip has it), FLOP/s
    int8_ops: float | None = None           # dense INT8 tensor peak, op/s (llama.cpp's MMQ kernels on CUDA)
    memory_type: str | None = None          # "HBM2e", "GDDR6X", "LPDDR5X", ...: its class sets a kernel share (kernels.py)
    llamacpp: Mapping[str, Any] = field(default_factory=dict, compare=False)   # devices/kernels.py overrides
    link_name: str | None = None
    link_bytes_per_s: float | None = None   # host link, per direction
    power_w: float | None = None
    decode_mbu: tuple[tuple[int, float], ...] = ()
    prefill_mfu: tuple[tuple[int, float], ...] = ()
    host_memory_bytes: int | None = None    # host RAM for offloaded layers, when known
    cpu_features: tuple[str, ...] = ()      # host CPU SIMD level ("avx2", "avx512", "neon", ...)
    host: str | None = None                 # default host profile (profiles/hosts/), localinfer.devices.hosts
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    origin: str = "built-in"                # file path, "built-in:<file>" or "detected"

    @property
    def reserve_bytes(self) -> int:
        """Bytes the reserve policy keeps back for the OS, drivers and work areas."""
        return reserve_bytes(self.reserve, self.memory_bytes)

    @property
    def usable_bytes(self) -> int:
        """Memory a model may use: total minus the reserve, capped by the working set."""
        usable = self.memory_bytes - self.reserve_bytes
        if self.working_set_cap_bytes is not None:
            usable = min(usable, self.working_set_cap_bytes)
        return max(0, usable)

    @property
    def memory_class(self) -> str | None:
        """The memory technology's family: ``hbm``, ``gddr``, ``lpddr`` or ``ddr`` (None when not given)."""
        m = _MEMORY_RE.match(self.memory_type or "")
        return m.group(1).lower() if m else None

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

    def decode_mbu_at(self, batch: int) -> float | None:
        """Decode memory-bandwidth utilisation at this batch (log-linear between table points)."""
        return _interp(self.decode_mbu, batch)

    def prefill_mfu_at(self, batch: int) -> float | None:
        """Prefill FLOP utilisation at this batch (log-linear between table points)."""
        return _interp(self.prefill_mfu, batch)

    def source(self, field_name: str) -> str:
        return self.sources.get(field_name, "")


def reserve_bytes(policy: str, memory_bytes: int) -> int:
    """Bytes a reserve policy keeps back: ``"10%"`` of memory, or a size like ``"8GiB"``."""
    text = str(policy).strip()
    if text.endswith("%"):
        pct = float(text[:-1])
        if not 0 <= pct < 100:
            raise ValueError(f"reserve {policy!r} must be between 0% and 100%")
        return math.ceil(memory_bytes * pct / 100)
    return parse_size(text)


def _interp(table: tuple[tuple[int, float], ...], batch: int) -> float | None:
    if not table:
        return None
    if batch <= table[0][0]:
        return table[0][1]
    for (b0, v0), (b1, v1) in itertools.pairwise(table):
        if batch <= b1:
            t = (math.log2(batch) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return v0 + t * (v1 - v0)
    return table[-1][1]


# ---- parsing -----------------------------------------------------------------

def _bad(origin: str, key: str, message: str) -> ProfileError:
    return ProfileError(f"profile {origin}: {key}: {message}", field=key, path=origin,
                        hint="fix the file (schema: localinfer/profiles/README.md) or remove it")


def _size(data: dict, key: str, origin: str, *, required: bool = False) -> int | None:
    value = data.get(key)
    if value is None:
        if required:
            raise _bad(origin, key, "is required (a size such as \"96GB\" or \"81920MiB\")")
        return None
    if isinstance(value, bool):
        raise _bad(origin, key, f"expected a size, got {value!r}")
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise _bad(origin, key, str(exc)) from None
    if n <= 0:
        raise _bad(origin, key, "must be positive")
    if n > MAX_SIZE:
        raise _bad(origin, key, f"{value!r} is more than 1 PiB, beyond any device")
    return n


def _rate(data: dict, key: str, origin: str) -> float | None:
    """A rate: a number (per second) or a string like ``"1792GB/s"`` / ``"503.8T"``."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool):
        raise _bad(origin, key, f"expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        rate = float(value)
    else:
        text = str(value).strip().removesuffix("/s").removesuffix("FLOP").removesuffix("FLOPS").strip()
        scale = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
        m = re.match(r"^([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kKmMgGtTpP]?)(B|iB)?$", text)
        if not m:
            raise _bad(origin, key, f"cannot read {value!r}; use a number or e.g. \"1792GB/s\"")
        unit = m.group(2).lower()
        if m.group(3) == "iB":
            rate = float(m.group(1)) * (1 << (10 * " kmgtp".index(unit)) if unit else 1)
        else:
            rate = float(m.group(1)) * scale.get(unit, 1.0)
    if not math.isfinite(rate) or rate <= 0:
        raise _bad(origin, key, "must be a positive number")
    if rate > MAX_RATE:
        raise _bad(origin, key, f"{value!r} is more than {MAX_RATE:.0e} per second, beyond any device")
    return rate


def _table(data: Any, key: str, origin: str) -> tuple[tuple[int, float], ...]:
    if data is None:
        return ()
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        data = {"1": data}
    if not isinstance(data, dict):
        raise _bad(origin, key, "expected a number or a table of batch = fraction")
    rows = []
    for b, v in data.items():
        try:
            batch = int(b)
        except ValueError:
            raise _bad(origin, key, f"batch {b!r} is not an integer") from None
        if batch < 1 or isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise _bad(origin, key, f"entry {b} = {v!r}: batch must be >= 1 and the fraction in (0, 1]")
        rows.append((batch, float(v)))
    return tuple(sorted(rows))


def profile_from_dict(data: dict, origin: str = "<dict>") -> DeviceProfile:
    """Build a profile from parsed TOML; raises ProfileError naming the bad key."""
    if not isinstance(data, dict):
        raise _bad(origin, "(top)", "not a table")
    name = data.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise _bad(origin, "name", "required: lowercase letters, digits, '.', '_' or '-' (e.g. \"rtx-4090\")")
    kind = data.get("kind")
    if kind not in KINDS:
        raise _bad(origin, "kind", f"must be one of {', '.join(KINDS)}")
    unified = data.get("unified", kind == "metal")
    if not isinstance(unified, bool):
        raise _bad(origin, "unified", "must be true or false")
    memory = _size(data, "memory", origin, required=True)
    reserve = str(data.get("reserve", "0"))
    try:
        if reserve_bytes(reserve, memory) >= memory:
            raise _bad(origin, "reserve", "leaves no usable memory")
    except ValueError as exc:
        raise _bad(origin, "reserve", f"{exc}; use a size (\"8GiB\") or a percentage (\"10%\")") from None
    link = data.get("link") or {}
    if not isinstance(link, dict):
        raise _bad(origin, "link", "must be a table: { name = \"PCIe Gen5 x16\", per_direction = \"64GB/s\" }")
    eff = data.get("efficiency") or {}
    if not isinstance(eff, dict):
        raise _bad(origin, "efficiency", "must be a table with decode_mbu and prefill_mfu")
    sources = data.get("sources") or {}
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise _bad(origin, "sources", "must be a table of field = \"source text\"")
    power = data.get("power_w")
    if power is not None and (isinstance(power, bool) or not isinstance(power, (int, float))
                              or not 0 < power <= MAX_POWER_W):
        raise _bad(origin, "power_w", f"must be a positive number of watts, at most {MAX_POWER_W:.0e}")
    features = data.get("cpu_features", [])
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise _bad(origin, "cpu_features", "must be a list of strings such as [\"avx2\"]")
    memory_type = data.get("memory_type")
    if memory_type is not None and (not isinstance(memory_type, str) or not _MEMORY_RE.match(memory_type)):
        raise _bad(origin, "memory_type", "must name the memory technology: HBM2e, HBM3, GDDR6X, GDDR7, LPDDR5X, DDR5, ...")
    known = {"name", "display_name", "kind", "unified", "memory", "memory_type", "reserve", "working_set_cap", "bandwidth",
             "bf16_flops", "fp16_flops", "int8_ops", "link", "power_w", "efficiency", "host_memory", "cpu_features", "host", "sources", "llamacpp"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise _bad(origin, unknown[0], f"unknown key; known keys: {', '.join(sorted(known))}")
    host = data.get("host")
    if host is not None and (not isinstance(host, str) or not _NAME_RE.match(host)):
        raise _bad(origin, "host", "must name a host profile, e.g. \"ddr5-5600-2ch\"")
    return DeviceProfile(
        name=name,
        display_name=str(data.get("display_name") or name),
        kind=kind,
        memory_bytes=memory,
        reserve=reserve,
        unified=unified,
        working_set_cap_bytes=_size(data, "working_set_cap", origin),
        bandwidth_bytes_per_s=_rate(data, "bandwidth", origin),
        bf16_flops=_rate(data, "bf16_flops", origin),
        fp16_flops=_rate(data, "fp16_flops", origin),
        int8_ops=_rate(data, "int8_ops", origin),
        memory_type=memory_type,
        llamacpp=MappingProxyType(check_table(data.get("llamacpp") or {}, origin)),
        link_name=link.get("name"),
        link_bytes_per_s=_rate(link, "per_direction", origin),
        power_w=float(power) if power is not None else None,
        decode_mbu=_table(eff.get("decode_mbu"), "efficiency.decode_mbu", origin),
        prefill_mfu=_table(eff.get("prefill_mfu"), "efficiency.prefill_mfu", origin),
        host_memory_bytes=_size(data, "host_memory", origin),
        cpu_features=tuple(features),
        host=host,
        sources=MappingProxyType(dict(sources)),
        origin=origin,
    )


def load_profile_file(path: str | os.PathLike) -> DeviceProfile:
    """Parse one TOML profile file."""
    path = Path(path)

    def refuse(problem: str, exc: OSError | None) -> ProfileError:
        if problem in (MISSING, NOT_REGULAR):   # a FIFO named *.toml would block, /dev/zero never end
            return ProfileError(f"profile {path}: not a regular file", path=str(path), hint="remove it")
        if problem == TOO_LARGE:
            return ProfileError(f"profile {path}: over {MAX_PROFILE_BYTES >> 10} KiB; a profile is a few keys",
                                path=str(path), hint="fix the file (schema: localinfer/profiles/README.md) or remove it")
        return ProfileError(f"profile {path}: cannot read: {exc}", path=str(path))

    try:
        data = tomllib.loads(read_capped(path, MAX_PROFILE_BYTES, refuse).decode("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profile {path}: not valid TOML: {exc}", path=str(path),
                           hint="fix the file (schema: localinfer/profiles/README.md) or remove it") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"profile {path}: cannot read: {exc}", path=str(path)) from None
    return profile_from_dict(data, str(path))


def builtin_dir():
    """Where the built-in profiles are: the ``profiles/`` of the checkout this package was imported from, when
    there is one (a worktree beside another editable install maps ``localinfer.profiles`` elsewhere), else the
    installed ``localinfer.profiles``."""
    checkout = Path(__file__).resolve().parents[2] / "profiles"
    if (checkout / "__init__.py").is_file():
        return checkout
    return resources.files("localinfer.profiles")


@lru_cache(maxsize=1)
def builtin_profiles() -> tuple[DeviceProfile, ...]:
    """The profiles shipped in ``localinfer.profiles``, in file-name order."""
    out = []
    for entry in sorted(builtin_dir().iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            data = tomllib.loads(entry.read_text(encoding="utf-8"))
            out.append(profile_from_dict(data, f"built-in:{entry.name}"))
    return tuple(out)


def user_profile_dirs() -> list[Path]:
    """Where user profiles are read from: ``$LOCALINFER_PROFILES`` or ``~/.config/localinfer/profiles``."""
    env = os.environ.get(ENV_VAR)
    if env is not None:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    return [USER_DIR.expanduser()]


def _toml_files(paths: Iterable[Path], *, named: bool) -> list[Path]:
    """The TOML files in these directories (or the files themselves); ``named`` paths must exist."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(p.glob("*.toml")))
        elif p.is_file():
            files.append(p)
        elif named:
            raise ProfileError(f"profile path {p} does not exist", path=str(p),
                               hint=f"fix ${ENV_VAR} (directories or .toml files, {os.pathsep!r}-separated), "
                                    "or unset it")
    return files


def load_profiles(extra_dirs: Iterable[str | os.PathLike] | None = None) -> dict[str, DeviceProfile]:
    """Built-in profiles, then user profiles (user files replace built-ins of the same name).

    ``extra_dirs`` (directories or files) are read after the user directories.
    The local machine is not included; see :func:`local_device`.
    """
    profiles = {p.name: p for p in builtin_profiles()}
    named = os.environ.get(ENV_VAR) is not None
    files = _toml_files(user_profile_dirs(), named=named)
    files += _toml_files([Path(d).expanduser() for d in (extra_dirs or ())], named=True)
    user: dict[str, Path] = {}
    for path in files:
        prof = load_profile_file(path)
        if prof.name == LOCAL_NAME:
            raise _bad(str(path), "name", f"{LOCAL_NAME!r} is reserved for the detected machine")
        if prof.name in user and user[prof.name].resolve() != path.resolve():
            raise _bad(str(path), "name", f"{prof.name!r} is also the name of {user[prof.name]}; "
                                          "two user profiles cannot share a name (rename or remove one)")
        user[prof.name] = path
        profiles[prof.name] = prof
    return profiles


def get_device(name: str, profiles: Mapping[str, DeviceProfile] | None = None) -> DeviceProfile:
    """A profile by name (case-insensitive; ``"local"`` is this machine).

    Raises UsageError listing the known names.
    """
    key = str(name).strip().lower()
    if key in (LOCAL_NAME, "this", "localhost"):
        return local_device()
    profiles = load_profiles() if profiles is None else profiles
    if key in profiles:
        return profiles[key]
    for prof in profiles.values():
        if prof.display_name.lower() == key:
            return prof
    names = ", ".join([LOCAL_NAME, *sorted(profiles)])
    raise UsageError(f"--device: unknown device {name!r}", flag="--device", hint=f"use one of: {names}")


# ---- the local machine ----------------------------------------------------------

def _cpu_features() -> tuple[str, ...]:
    """The SIMD level llama.cpp's CPU backend keys its weight repacking on."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    out = []
    if "avx2" in flags:
        out.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl"} <= flags or "avx512f" in flags:
        out.append("avx512")
    import platform
    machine = platform.machine().lower()
    if machine in ("arm64", "aarch64"):
        out.append("neon")
        if "asimddp" in flags or sys.platform == "darwin":
            out.append("dotprod")
        if "i8mm" in flags:
            out.append("i8mm")
    return tuple(out)


def _macos_working_set_cap(ram: int) -> tuple[int, str]:
    """The GPU wired-memory cap on macOS: ``iogpu.wired_limit_mb`` if set, else the default rule."""
    import subprocess

    try:
        out = subprocess.run(["sysctl", "-n", "iogpu.wired_limit_mb"], capture_output=True, text=True, timeout=2,
                             check=False)
        mb = int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.SubprocessError):
        mb = 0
    if mb > 0:
        return mb * (1 << 20), f"sysctl iogpu.wired_limit_mb = {mb}"
    frac = 0.75 if ram > 36 * GiB else 2 / 3
    return int(ram * frac), (f"macOS default recommendedMaxWorkingSetSize ≈ {frac:.0%} of RAM "
                             "(raise with sudo sysctl iogpu.wired_limit_mb=N)")


def _cuda_devices(probe: bool) -> list[tuple[str, int]]:
    if "torch" not in sys.modules and not probe:
        return []
    try:
        import torch
        if not torch.cuda.is_available():
            return []
        return [(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
                for i in range(torch.cuda.device_count())]
    except (ImportError, RuntimeError, AttributeError, OSError):   # a broken torch must not break `fit`
        return []


def local_device(*, probe_cuda: bool = False) -> DeviceProfile:
    """This machine as a profile named ``"local"``.

    CPU-only: RAM from psutil, reserve 10%.  With a CUDA device visible to an
    already-imported torch (or ``probe_cuda=True``), the first GPU.  On macOS
    (Apple silicon) a unified Metal device capped by the GPU working set.
    """
    import platform

    import psutil

    ram = int(psutil.virtual_memory().total)
    sources = {"memory": "psutil.virtual_memory().total"}
    cpu = platform.processor() or platform.machine()
    gpus = _cuda_devices(probe_cuda)
    if gpus:
        gname, gmem = gpus[0]
        sources.update(memory="torch.cuda.get_device_properties(0).total_memory", host_memory="psutil")
        return DeviceProfile(
            name=LOCAL_NAME, display_name=f"this machine: {gname}", kind="cuda", memory_bytes=gmem,
            reserve="1GiB", unified=False, host_memory_bytes=ram, cpu_features=_cpu_features(),
            sources=MappingProxyType(sources), origin="detected")
    if sys.platform == "darwin" and platform.machine() == "arm64":
        cap, why = _macos_working_set_cap(ram)
        sources["working_set_cap"] = why
        return DeviceProfile(
            name=LOCAL_NAME, display_name="this machine: Apple silicon (Metal)", kind="metal",
            memory_bytes=ram, reserve="8GiB" if ram > 32 * GiB else "4GiB", unified=True,
            working_set_cap_bytes=cap, cpu_features=_cpu_features(),
            sources=MappingProxyType(sources), origin="detected")
    n_cpu = os.cpu_count() or 1
    return DeviceProfile(
        name=LOCAL_NAME, display_name=f"this machine: CPU ({n_cpu} threads, {ram / GB:.0f} GB RAM)",
        kind="cpu", memory_bytes=ram, reserve=DEFAULT_LOCAL_RESERVE, unified=True,
        cpu_features=_cpu_features(), sources=MappingProxyType({**sources, "cpu": cpu or "unknown"}),
        origin="detected")


def all_devices(names: Iterable[str] | None = None, *, include_local: bool = True,
                extra_dirs: Iterable[str | os.PathLike] | None = None) -> list[DeviceProfile]:
    """Profiles to report on: the named ones, or this machine plus every profile."""
    profiles = load_profiles(extra_dirs)
    if names:
        return [get_device(n, profiles) for n in names]
    return ([local_device()] if include_local else []) + list(profiles.values())
