"""llama.cpp's layer split across devices (``-sm layer``: RPC workers and local GPUs): where every byte lands.

The split (llama-model.cpp, ``load_tensors``): the devices are the RPC
workers' devices first, then local GPUs; each gets a share (``--tensor-split``,
or by default its free memory), the shares become cumulative split points
normalised to 1 (in float32), and of the ``act = min(ngl, n_layer + 1)``
offloaded units (the repeating layers, then the output layer counted as one
more) unit ``j`` goes to the first device whose split point exceeds
``j / act``.  The input layer (token embedding) always stays on the host CPU,
as do the layers below ``n_layer + 1 − ngl``.

Each device holds its layers' weights (copied into its own buffer: padded to
its alignment, quantized rows padded on CUDA), their KV cache, and a compute
buffer (:mod:`.split_compute`); the host holds the mapped input layer, any
layers left on the CPU, the logits buffer and its own compute buffer.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

import numpy as np

from localinfer.backends.llamacpp.compute_buffer import ALIGN
from localinfer.backends.llamacpp.memory import llama_geometry, llama_kv_layer_bytes, output_bytes
from localinfer.backends.llamacpp.placement import _groups, offloaded_units, rope_once, source_name
from localinfer.backends.llamacpp.overrides import CPU, check_overrides, request_overrides
from localinfer.backends.llamacpp.split_compute import split_compute
from localinfer.backends.llamacpp.tensor_homes import (device_weight_bytes, expert_home, host_weight_buffers,
                                                       placed, tensor_homes, unit_bytes_kept, unit_of)
from localinfer.backends.memory import FitRequest
from localinfer.backends.split import HOST, DeviceShare, SplitBreakdown
from localinfer.errors import UsageError
from localinfer.model.kv import recurrent_state_bytes
from localinfer.model.spec import ModelSpec


def unit_devices(n_layer: int, n_gpu_layers: int, shares) -> tuple[int, ...]:
    """Device of layers 0..n_layer-1 and of the output layer (index n_layer), HOST for the CPU (float32 as llama.cpp):
    unit ``j`` of the offloaded ones (:func:`offloaded_units`) goes to the first device whose split point exceeds
    ``j / len(offloaded)``."""
    if not len(shares):
        return (HOST,) * (n_layer + 1)
    points = np.cumsum(np.asarray(shares, dtype=np.float32), dtype=np.float32)
    if not points[-1] > 0:
        raise UsageError("--tensor-split shares must not all be zero", flag="--tensor-split")
    points = (points / points[-1]).astype(np.float32)
    units = offloaded_units(n_layer, n_gpu_layers)
    out = [HOST] * (n_layer + 1)
    for j, il in enumerate(units):
        x = np.float32(j) / np.float32(len(units))
        out[il] = min(int(np.searchsorted(points, x, side="right")), len(shares) - 1)
    return tuple(out)


def _unit_bytes(spec: ModelSpec, kind: str) -> dict:
    """Weight bytes each unit ("in", layer index, "out") takes in a device buffer of this kind (each layer's
    ``rope_freqs`` duplicate included: :func:`rope_once` takes back all but one per device)."""
    out = {}
    for unit, (every, _, _) in _groups(spec, ()).items():
        out[unit] = every.cuda_alloc if kind == "cuda" else every.cpu_alloc + every.dup_alloc
    return out


def _host_weights(spec: ModelSpec, host_units: set, mmap: bool, feats: tuple[str, ...]) -> dict[str, int]:
    units = _groups(spec, tuple(feats))
    plain = [units[u][1] for u in units if u in host_units and units[u][1].names]
    rep = [units[u][2] for u in units if u in host_units and units[u][2].names]
    out: dict[str, int] = {}
    if plain:
        if mmap:
            out["CPU_Mapped model"] = max(g.hi for g in plain) - min(g.lo for g in plain)
        else:
            out["CPU model"] = sum(g.cpu_alloc for g in plain)
    if rep:
        out["CPU_REPACK model"] = sum(g.cpu_alloc + g.dup_alloc for g in rep)
    return out


def split_breakdown(spec: ModelSpec, devices, req: FitRequest, shares=None, *, cpu_features: tuple[str, ...] = (),
                    compute: bool = True, dry_run: bool = False) -> SplitBreakdown:
    """Every byte of ``req`` split across ``devices`` (SplitDevice, in llama.cpp's order) and the host.

    ``shares`` None: llama.cpp's default, proportional to each device's free memory.  ``compute=False``
    skips the compute-buffer replay (zeros), for searches.  ``dry_run``: the compute buffers as llama.cpp's
    dry run (``no_alloc``: llama-fit-params, ``--fit``) measures them: from the prompt graph only, sized by
    ``ggml_backend_sched_reserve_size``, whose scheduler reset wipes the norms pinned to their layer's device
    (so with pipeline parallelism the next layer's norm and its input both cross to a device)."""
    devices = tuple(devices)
    if not devices:
        raise UsageError("a split needs at least one device", flag="--rpc")
    if shares is not None and len(shares) != len(devices):
        raise UsageError(f"--tensor-split has {len(shares)} shares for {len(devices)} devices "
                         f"({', '.join(d.name for d in devices)})", flag="--tensor-split",
                         hint="give one share per device, RPC workers first")
    if shares is not None and any(s < 0 for s in shares):
        raise UsageError("--tensor-split shares must be >= 0", flag="--tensor-split")
    used = tuple(float(s) for s in shares) if shares is not None and any(shares) else \
        tuple(float(d.free) for d in devices)
    n = spec.n_layers
    units = unit_devices(n, req.n_gpu_layers, used)
    cells, graphs = llama_geometry(spec, req)
    full = len(offloaded_units(n, req.n_gpu_layers)) > n
    overrides = request_overrides(req)
    # llama-context.cpp: no pipeline parallelism with tensor overrides (model.has_tensor_overrides())
    pipeline = len(devices) > 1 and full and all(d.async_events for d in devices) and not overrides

    def backend(unit) -> int:
        d = HOST if unit == "in" else units[n if unit == "out" else unit]
        return len(devices) if d == HOST else d

    homes = None
    if overrides:
        names = {d.name: i for i, d in enumerate(devices)}
        check_overrides((t.name for t in spec.tensors), overrides, (CPU, *names))
        homes = tensor_homes(spec, lambda u: units[n if u == "out" else u], overrides, names, cpu_features)

    computes = [0] * (len(devices) + 1)
    if compute:
        each = [split_compute(spec, backend, [d.kind for d in devices], n_kv=cells.cells_base, n_ubatch=tokens,
                              n_outputs=rows, flash_attn=req.flash_attn_on, n_kv_swa=cells.cells_swa,
                              type_k=req.type_k, type_v=req.type_v, pipeline=pipeline, pin_norms=full,
                              n_seqs=req.n_seq, pins=not dry_run,
                              tensor_home=None if homes is None else expert_home(homes, len(devices)))
                for tokens, rows in (graphs[:1] if dry_run else graphs)]
        computes = [max(sizes) for sizes in zip(*each)]          # each backend's buffer keeps the largest
    kv = [0] * (len(devices) + 1)      # KV and, for hybrids, the recurrent state of each device's layers
    for il in range(n):
        kv[backend(il)] += sum(llama_kv_layer_bytes(spec, il, cells, req.type_k, req.type_v))
        if spec.has_recurrent:                  # the recurrent state lives beside the KV of its layer
            kind = devices[backend(il)].kind if backend(il) < len(devices) else "cpu"
            kv[backend(il)] += recurrent_state_bytes(spec, req.n_seq, layers=(il,), align=ALIGN.get(kind, 32))
    shares_out = []
    for i, d in enumerate(devices):
        ub = _unit_bytes(spec, d.kind)
        mine = [u for u in ub if u != "in" and backend(u) == i]
        layers = tuple(sorted(u for u in mine if u != "out"))
        weights = sum(ub[u] for u in mine) - rope_once(spec, d.kind, len(layers))
        if homes is not None:
            weights = device_weight_bytes(spec, homes, i, d.kind)
        shares_out.append(DeviceShare(d.name, d.kind, layers, "out" in mine, weights, kv[i], computes[i], d.usable))
    host_units = {"in"} | {il for il in range(n) if units[il] == HOST} | ({"out"} if units[n] == HOST else set())
    notes = []
    if pipeline:
        notes.append("pipeline parallelism: llama.cpp keeps 4 copies of every graph input and every tensor "
                     "passed between devices")
    host_weights = (_host_weights(spec, host_units, req.mmap, cpu_features) if homes is None else
                    host_weight_buffers(homes, req.mmap))
    if homes is not None:
        on_host = frozenset(source_name(h.tensor.name) for h in homes
                            if h.backend == HOST and not h.tensor.duplicate and unit_of(h.tensor.name) != "in")
    elif host_units == {"in"}:     # every layer on a device (most of a search's calls)
        on_host = frozenset()
    else:     # no override: a weight is on the host where its unit is (tensor_homes, without building homes)
        on_host = frozenset(source_name(p.name) for p in placed(spec)
                            if not p.duplicate and unit_of(p.name) != "in" and unit_of(p.name) in host_units)
    return SplitBreakdown(tuple(shares_out), host_weights,
                          kv[len(devices)], output_bytes(spec, req.n_seq), computes[len(devices)], units, used,
                          pipeline, cells.n_ctx, tuple(notes), on_host)


# ---- splits that fit --------------------------------------------------------------------------

def _greedy_counts(spec: ModelSpec, devices, req: FitRequest, reserve: list[int]) -> tuple[int, ...] | None:
    """Most units each device takes in order, each within usable − ``reserve`` (its compute buffer); None if
    the last device cannot take the rest."""
    n = spec.n_layers
    order = [u if u < n else "out" for u in offloaded_units(n, req.n_gpu_layers)]
    cells, _ = llama_geometry(spec, req)
    kv = {il: sum(llama_kv_layer_bytes(spec, il, cells, req.type_k, req.type_v))
          + recurrent_state_bytes(spec, req.n_seq, layers=(il,), align=32) for il in range(n)}
    counts, pos = [], 0
    overrides = request_overrides(req)
    for i, d in enumerate(devices):
        ub = _unit_bytes(spec, d.kind) if not overrides else unit_bytes_kept(spec, d.kind, overrides)
        room, c = d.usable - reserve[i], 0
        while pos + c < len(order):
            u = order[pos + c]
            need = ub[u] + kv.get(u, 0)
            if need > room:
                break
            room -= need
            c += 1
        if i == len(devices) - 1 and pos + c < len(order):
            return None
        counts.append(c)
        pos += c
    return tuple(counts)


def fitting_split(spec: ModelSpec, devices, req: FitRequest, *, cpu_features=()) -> SplitBreakdown | None:
    """A split of ``devices`` that fits: by usable memory when that fits, else filling devices in order."""
    devices = tuple(devices)
    if not devices:
        return None
    by_usable = split_breakdown(spec, devices, req, [max(d.usable, 0) for d in devices], cpu_features=cpu_features)
    if by_usable.fits:
        return by_usable
    reserve = [s.compute for s in by_usable.devices]       # the last device holds the output (logits rows)
    reserve[-1] = max(reserve)
    for _ in range(2 * len(devices) + 2):     # the exact replay corrects the compute estimates
        counts = _greedy_counts(spec, devices, req, reserve)
        if counts is None or not any(counts):
            return None
        sb = split_breakdown(spec, devices, req, counts, cpu_features=cpu_features)
        if sb.fits:
            return sb
        for i, d in enumerate(sb.devices):
            if not d.fits:
                reserve[i] += d.total - d.usable
    return None


def smallest_set(spec: ModelSpec, devices, req: FitRequest, *, cpu_features=()) -> tuple[tuple[int, ...],
                                                                                     SplitBreakdown] | None:
    """The fewest of ``devices`` (order kept) that hold the model; among equals the fewest remote ones, then the
    most usable memory."""
    devices = tuple(devices)
    for k in range(1, len(devices) + 1):
        sets = sorted(combinations(range(len(devices)), k),
                      key=lambda c: (sum(devices[i].remote for i in c), -sum(devices[i].usable for i in c)))
        for chosen in sets:
            sb = fitting_split(spec, [devices[i] for i in chosen], req, cpu_features=cpu_features)
            if sb is not None:
                return chosen, sb
    return None


def with_usable(devices, usable: list[int]):
    return tuple(replace(d, usable=u) for d, u in zip(devices, usable))
