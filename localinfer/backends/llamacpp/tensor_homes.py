"""Where each weight tensor lands when buffer overrides apply, across devices and the host.

Without overrides a tensor follows its layer (llama-model.cpp ``load_tensors``: the layer's device, the
input layer on the CPU).  With them (:mod:`.overrides`) the first matching entry decides: CPU sends it to
the host, where llama.cpp picks from the CPU buffer list (llama-model-loader.cpp, ``select_weight_buft``
over ``buft_list_cpu``): CPU_REPACK when this CPU repacks the type (:func:`.placement.repackable`), else
the plain CPU buffer (a mapped file range under mmap); a device's buffer name sends it to that device.
"""

from __future__ import annotations

from dataclasses import dataclass

from localinfer.backends.llamacpp.overrides import CPU, override_of
from localinfer.backends.llamacpp.placement import (_LAYER_RE, _INPUT_PREFIXES, CPU_ALIGN, CUDA_ALIGN, Placed,
                                                    cuda_alloc_size, place_tensors, repackable, rope_once,
                                                    source_name)
from localinfer.model.spec import ModelSpec
from localinfer.units import pad_to
from localinfer.util.memo import spec_cache

HOST = -1


def unit_of(name: str):
    """The placement unit of a placed tensor: a layer index, "in" or "out" (rope duplicates: their layer)."""
    m = _LAYER_RE.match(name)
    if m:
        return int(m.group(1))
    if name.startswith("rope_freqs"):
        return int(name.split("blk.")[1].rstrip(")")) if "blk." in name else 0
    if name.startswith(_INPUT_PREFIXES):
        return "in"
    return "out"


@dataclass(frozen=True)
class Home:
    tensor: Placed
    backend: int             # a device index, or HOST
    repacked: bool = False   # on the host, in CPU_REPACK (not a host buffer: never offloaded)


def placed(spec: ModelSpec):
    """Every weight as llama.cpp creates it (:func:`place_tensors`), memoised on the spec."""
    memo = spec_cache(spec)
    if ("placed",) not in memo:
        memo[("placed",)] = place_tensors(spec, -1)
    return memo[("placed",)]


def tensor_homes(spec: ModelSpec, unit_backend, overrides, buffers: dict[str, int],
                 cpu_features: tuple[str, ...] = ()) -> tuple[Home, ...]:
    """Every weight's backend: ``unit_backend(unit)`` for its layer (HOST for the CPU), unless an override's
    buffer (``buffers``: name → device index; CPU is the host) says otherwise."""
    out = []
    for p in placed(spec):
        unit = unit_of(p.name)
        b = HOST if unit == "in" else unit_backend(unit)
        buft = override_of(source_name(p.name), overrides) if overrides else None
        if buft is not None:
            b = HOST if buft == CPU else buffers[buft]
        rep = b == HOST and p.matmul and repackable(p.type_name, p.shape, cpu_features)
        out.append(Home(p, b, rep))
    return tuple(out)


def device_weight_bytes(spec: ModelSpec, homes, backend: int, kind: str) -> int:
    """Bytes of ``backend``'s model buffer: its tensors padded and aligned for ``kind`` (CUDA pads quantized
    rows to 512 values, 128-byte aligned; others 32), ``rope_freqs`` once (:func:`.placement.rope_once`)."""
    total = ropes = 0
    for h in homes:
        if h.backend != backend:
            continue
        p = h.tensor
        total += (pad_to(cuda_alloc_size(p.type_name, p.shape, p.nbytes), CUDA_ALIGN) if kind == "cuda"
                  else pad_to(p.nbytes, CPU_ALIGN))
        ropes += p.name.startswith("rope_freqs")
    return total - rope_once(spec, kind, ropes)


def host_weight_buffers(homes, mmap: bool) -> dict[str, int]:
    """The host's model buffers: CPU_Mapped (first to last byte of its tensors in the file) or CPU without
    mmap, and CPU_REPACK; duplicates are copies only outside a mapping."""
    plain = [h.tensor for h in homes if h.backend == HOST and not h.repacked]
    rep = [h.tensor for h in homes if h.backend == HOST and h.repacked]
    out: dict[str, int] = {}
    if plain:
        if mmap:
            out["CPU_Mapped model"] = max(p.offset + p.nbytes for p in plain) - min(p.offset for p in plain)
        else:
            out["CPU model"] = sum(pad_to(p.nbytes, CPU_ALIGN) for p in plain if not p.duplicate)
    if rep:
        out["CPU_REPACK model"] = sum(pad_to(p.nbytes, CPU_ALIGN) for p in rep)
    return out


def expert_home(homes, host: int):
    """``tensor_home(name)`` for :func:`.split_compute.split_compute`: (backend, in a host buffer, bytes) of each
    expert tensor and router (``host``: the host's backend index there), None for other tensors."""
    table = {h.tensor.name: (host if h.backend == HOST else h.backend, h.backend == HOST and not h.repacked,
                             h.tensor.nbytes)
             for h in homes if ("_exps." in h.tensor.name or ".ffn_gate_inp." in h.tensor.name)
             and not h.tensor.duplicate}
    return table.get


def unit_bytes_kept(spec: ModelSpec, kind: str, overrides) -> dict:
    """Weight bytes each unit ("in", layer index, "out") keeps on a device of ``kind`` when the overrides send
    some of its tensors to the CPU (a split search's per-layer cost; an override to another device counts as kept)."""
    out: dict = {}
    for h in tensor_homes(spec, lambda u: 0, overrides, _AnyDevice()):
        unit = unit_of(h.tensor.name)
        p = h.tensor
        kept = 0 if h.backend == HOST else (pad_to(cuda_alloc_size(p.type_name, p.shape, p.nbytes), CUDA_ALIGN)
                                            if kind == "cuda" else pad_to(p.nbytes, CPU_ALIGN))
        out[unit] = out.get(unit, 0) + kept
    return out


class _AnyDevice(dict):
    def __missing__(self, key):
        return 0
