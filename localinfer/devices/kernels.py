"""llama.cpp's kernels on one kind of device: the coefficients of its speed model (docs/speed.md).

Each backend llama.cpp runs on (``cuda``, ``metal``, ``vulkan``, ``cpu``) has defaults in
``profiles/kinds/<backend>.toml``; a device profile's ``[llamacpp]`` table replaces any of them for
that device (and ``backend = "vulkan"`` there picks another kind's defaults than the profile's
``kind``).  The keys:

- ``token_us``: fixed time per decode step (graph build and launch, synchronisation, logits copy);
- ``layer_us``: fixed time per layer per decode step (kernel launches that move no weights);
- ``moe_layer_us``: extra fixed time per MoE layer per decode step (router, top-k, the expert kernels);
- ``ubatch_layer_us``: fixed time per layer per prefill micro-batch;
- ``act_passes``: F32 activation passes over memory per layer per prefilled token (norms, RoPE, softmax,
  element-wise ops, quantizing activations for the mat-mats: ``act_passes · 4 · n_embd`` bytes at the
  bandwidth);
- ``[decode_bw]``: the fraction of the memory bandwidth the mat-vec kernels reach, by weight type
  (``q4_0``, ``q4_k``, ``f16``, ...; ``default`` for the rest; ``kv`` for the KV cache reads; ``moe``
  multiplies the share for routed experts, whose many small matrices stream less well);
- ``[prefill]``: the fraction of peak the mat-mat kernels reach, by path: ``quant`` (quantized
  weights), ``f16``, ``bf16``, ``f32`` and ``attn`` (attention);
  (``moe``: the routed experts' mat-mat, as a fraction of their type's path);
- ``[memory_scale]``: a factor on every ``decode_bw`` fraction by the device's memory class (``hbm``,
  ``gddr``, ``lpddr``, ``ddr``: the profile's ``memory_type``); 1 for a class not listed;
- ``decode_scale``, ``prefill_scale`` (a device's own table only): its measured departure from its
  kind, multiplying every ``decode_bw`` and ``prefill`` fraction (capped at 0.95);
- ``[peaks]``: which profile rate each path runs at (``int8_ops``, ``fp16_flops``, ``bf16_flops``);
- ``dequant_fallback``: where the quantized path does not run on INT8 tensor cores (the device has no
  ``int8_ops``, or the kind's ``quant`` peak is another rate), llama.cpp converts each quantized weight
  matrix to F16 per micro-batch and multiplies it with the F16 GEMM (CUDA: ``ggml_cuda_should_use_mmq``
  is false on Volta for 64 or more tokens, and ``ggml_cuda_mul_mat_cublas`` converts quantized weights
  to F16 first): that path costs the conversion's traffic and runs at the ``f16`` fraction;
- ``[error]``: the relative error the published calibration supports, by test (``decode``,
  ``prefill``) and size class (``small`` < 3 B parameters, ``mid`` < 30 B, ``large``);
- ``[eras.<name>]`` (a kind file only): what differed in older llama.cpp builds (any of the keys above, with
  ``prefill`` and ``peaks`` sub-tables); localinfer predicts the current build, the published comparison
  (``benchmarks/speed_published.py``) reads older builds' rows with these;
- ``calibrated_on``: the devices whose published figures set the defaults;
- ``[sources]``: where each figure comes from.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType

from localinfer.errors import ProfileError

BACKENDS = ("cuda", "metal", "vulkan", "rocm", "cpu")
PATHS = ("quant", "f16", "bf16", "f32", "attn", "moe")
PEAK_FIELDS = ("int8_ops", "fp16_flops", "bf16_flops")
MAX_FRACTION = 0.95        # no kernel streams its memory or fills its tensor cores completely; scales stop here
SIZE_CLASSES = (("small", 3e9), ("mid", 30e9), ("large", math.inf))
MEMORY_CLASSES = ("hbm", "gddr", "lpddr", "ddr")
_KNOWN = {"backend", "memory_scale", "token_us", "layer_us", "moe_layer_us", "ubatch_layer_us", "act_passes", "decode_bw", "prefill", "peaks", "error",
          "calibrated_on", "sources", "decode_scale", "prefill_scale", "dequant_fallback", "eras"}


@dataclass(frozen=True)
class KernelCoefficients:
    """The coefficients of llama.cpp's speed model on one device (times in seconds)."""

    backend: str
    token_s: float
    layer_s: float
    ubatch_layer_s: float
    decode_bw: Mapping[str, float]
    prefill: Mapping[str, float]
    peaks: Mapping[str, str]
    act_passes: float = 0.0
    moe_layer_s: float = 0.0
    dequant_fallback: bool = False
    error: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    calibrated_on: tuple[str, ...] = ()
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    origin: str = "built-in"

    def bandwidth_fraction(self, type_name: str) -> float:
        """Fraction of the bandwidth a mat-vec over ``type_name`` weights reaches."""
        return self.decode_bw.get(type_name.lower(), self.decode_bw["default"])

    def path(self, type_name: str) -> str:
        """The prefill kernel path weights of ``type_name`` take: quant, f16, bf16 or f32."""
        t = type_name.lower()
        return t if t in ("f16", "bf16", "f32") else "quant"

    def error_band(self, test: str, n_params: float) -> float | None:
        """Relative error (90th percentile of the calibration) for ``test`` at a model of ``n_params``."""
        by_class = self.error.get(test) or {}
        return by_class.get(size_class(n_params), by_class.get("all"))


def size_class(n_params: float) -> str:
    return next(name for name, below in SIZE_CLASSES if n_params < below)


def _bad(origin: str, key: str, problem: str) -> ProfileError:
    return ProfileError(f"profile {origin}: llamacpp.{key}: {problem}", path=origin, field=f"llamacpp.{key}",
                        hint="fix the file (schema: localinfer/profiles/README.md, 'llama.cpp kernels') or remove it")


def _fractions(data, key: str, origin: str, allowed: tuple[str, ...] | None = None) -> dict[str, float]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise _bad(origin, key, "must be a table of name = fraction")
    out = {}
    for name, v in data.items():
        if allowed is not None and name not in allowed:
            raise _bad(origin, f"{key}.{name}", f"unknown; known: {', '.join(allowed)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise _bad(origin, f"{key}.{name}", f"{v!r} must be a fraction in (0, 1]")
        out[str(name).lower()] = float(v)
    return out


def _micros(data: dict, key: str, origin: str) -> float | None:
    v = data.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e6:
        raise _bad(origin, key, f"{v!r} must be microseconds, 0 to 1e6")
    return float(v) * 1e-6


def check_table(data, origin: str) -> dict:
    """Validate a ``[llamacpp]`` table (a profile's, or a kind file's); returns it unchanged."""
    if not isinstance(data, dict):
        raise _bad(origin, "(table)", "must be a table")
    unknown = sorted(set(data) - _KNOWN)
    if unknown:
        raise _bad(origin, unknown[0], f"unknown key; known keys: {', '.join(sorted(_KNOWN))}")
    if "backend" in data and data["backend"] not in BACKENDS:
        raise _bad(origin, "backend", f"must be one of {', '.join(BACKENDS)}")
    for key in ("token_us", "layer_us", "moe_layer_us", "ubatch_layer_us"):
        _micros(data, key, origin)
    v = data.get("act_passes")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1000):
        raise _bad(origin, "act_passes", f"{v!r} must be a number from 0 to 1000")
    for key in ("decode_scale", "prefill_scale"):
        v = data.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.1 <= v <= 10):
            raise _bad(origin, key, f"{v!r} must be a factor from 0.1 to 10")
    _fractions(data.get("decode_bw"), "decode_bw", origin)
    scales = data.get("memory_scale") or {}
    if not isinstance(scales, dict) or any(k not in MEMORY_CLASSES or isinstance(v, bool)
                                           or not isinstance(v, (int, float)) or not 0.1 <= v <= 10
                                           for k, v in scales.items()):
        raise _bad(origin, "memory_scale", f"must map memory classes ({', '.join(MEMORY_CLASSES)}) to factors from 0.1 to 10")
    _fractions(data.get("prefill"), "prefill", origin, PATHS)
    peaks = data.get("peaks") or {}
    if not isinstance(peaks, dict) or any(k not in PATHS or v not in PEAK_FIELDS for k, v in peaks.items()):
        raise _bad(origin, "peaks", f"must map paths ({', '.join(PATHS)}) to {', '.join(PEAK_FIELDS)}")
    for test, by_class in (data.get("error") or {}).items():
        _fractions(by_class, f"error.{test}", origin, (*(n for n, _ in SIZE_CLASSES), "all"))
    if not isinstance(data.get("dequant_fallback", False), bool):
        raise _bad(origin, "dequant_fallback", "must be true or false")
    eras = data.get("eras") or {}
    if not isinstance(eras, dict) or not all(isinstance(v, dict) for v in eras.values()):
        raise _bad(origin, "eras", "must be a table of era name = table of coefficients")
    for name, table in eras.items():
        check_table(table, f"{origin} (eras.{name})")
    cal = data.get("calibrated_on", [])
    if not isinstance(cal, list) or not all(isinstance(x, str) for x in cal):
        raise _bad(origin, "calibrated_on", "must be a list of device names")
    src = data.get("sources") or {}
    if not isinstance(src, dict) or not all(isinstance(v, str) for v in src.values()):
        raise _bad(origin, "sources", "must be a table of field = \"source text\"")
    return data


@lru_cache(maxsize=None)
def kind_defaults(backend: str) -> Mapping:
    """The ``profiles/kinds/<backend>.toml`` table (validated), or an empty table where none ships."""
    if backend not in BACKENDS:
        return MappingProxyType({})
    from localinfer.devices.profiles import builtin_dir   # profiles imports this module

    f = builtin_dir() / "kinds" / f"{backend}.toml"
    if not f.is_file():
        return MappingProxyType({})
    origin = f"profiles/kinds/{backend}.toml"
    data = check_table(tomllib.loads(f.read_text(encoding="utf-8")), origin)
    return MappingProxyType(data)


def coefficients(device, era: str | None = None) -> KernelCoefficients | None:
    """llama.cpp's kernel coefficients on ``device``: its kind's defaults under its own ``[llamacpp]`` table
    (``era``: an older build's, from the kind file's ``[eras]``; the current build's by default).

    ``None`` where neither gives the decode figures (no kind file for that backend)."""
    own = dict(getattr(device, "llamacpp", None) or {})
    backend = own.get("backend", device.kind)
    base = dict(kind_defaults(backend))
    older = (base.pop("eras", None) or {}).get(era) or {}
    for key, v in older.items():
        base[key] = {**(base.get(key) or {}), **v} if isinstance(v, dict) else v
    if not base and not own:
        return None
    merged = {**base, **own}
    for key in ("decode_bw", "prefill", "peaks", "memory_scale", "sources"):
        merged[key] = {**(base.get(key) or {}), **(own.get(key) or {})}
    if "default" not in merged["decode_bw"] or "token_us" not in merged or "layer_us" not in merged:
        return None
    err = {t: dict(v) for t, v in (base.get("error") or {}).items()}
    if own:
        # a device's own figures are not what the kind's calibration measured: its band does not carry over
        err = {t: dict(v) for t, v in (own.get("error") or {}).items()} or err
    ds, ps = float(own.get("decode_scale", 1.0)), float(own.get("prefill_scale", 1.0))
    ds *= float(merged["memory_scale"].get(getattr(device, "memory_class", None), 1.0))
    merged["decode_bw"] = {k: v if k == "moe" else min(MAX_FRACTION, v * ds) for k, v in merged["decode_bw"].items()}
    merged["prefill"] = {k: v if k == "moe" else min(MAX_FRACTION, v * ps) for k, v in merged["prefill"].items()}
    return KernelCoefficients(
        backend=backend,
        token_s=merged["token_us"] * 1e-6,
        layer_s=merged["layer_us"] * 1e-6,
        ubatch_layer_s=merged.get("ubatch_layer_us", 0.0) * 1e-6,
        act_passes=float(merged.get("act_passes", 0.0)),
        moe_layer_s=merged.get("moe_layer_us", 0.0) * 1e-6,
        dequant_fallback=bool(merged.get("dequant_fallback", False)),
        decode_bw=MappingProxyType({k.lower(): float(v) for k, v in merged["decode_bw"].items()}),
        prefill=MappingProxyType({k: float(v) for k, v in merged["prefill"].items()}),
        peaks=MappingProxyType(dict(merged["peaks"])),
        error=MappingProxyType({t: MappingProxyType(v) for t, v in err.items()}),
        calibrated_on=tuple(own.get("calibrated_on", base.get("calibrated_on", ()))),
        sources=MappingProxyType(dict(merged["sources"])),
        origin=("profile" if own else "kind") + f":{backend}",
    )
