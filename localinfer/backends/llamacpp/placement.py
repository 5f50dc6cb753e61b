"""Where llama.cpp puts each weight tensor, and the buffers that come out of it.

llama.cpp's layer split (``-ngl N``, llama-model.cpp ``load_tensors``): the
input layer (token embedding) always stays on the CPU; the ``n_layer``
repeating blocks and then the output layer (``output_norm``, ``output``) are
``n_layer + 1`` units, of which the *last* N go to the accelerator — so
``-ngl 1`` offloads the output layer alone, ``-ngl n_layer`` all but block 0,
and ``-ngl n_layer + 1`` (or -1) everything.  Buffers then follow the backend:

* mmap'd host tensors are not copied: ``CPU_Mapped`` (and ``Metal_Mapped``) is
  the file range from the first to the last byte of the tensors in it;
* CUDA copies its tensors into ``CUDA0``, each padded (quantized rows to 512
  values) and aligned to 128 bytes;
* on x86/ARM CPUs llama.cpp repacks some quant types for faster matmuls into a
  ``CPU_REPACK`` buffer *beside* the mapping (e.g. Q4_0/Q4_K/IQ4_NL/MXFP4 with
  AVX2): anonymous memory, while the mapped pages of those tensors are read once,
  at load, and stay only as clean, reclaimable page cache.

What must stay resident of a host mapping (``WeightPlacement.resident``) is
therefore the tensors still read after loading: not the repacked ones, and not
the token embeddings, which are read a row per token (unless a tied output
matrix reads them whole).  With ``mlock`` the whole mapped range is locked.
See docs/memory.md ("Resident and mapped").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from gguf_tools.quants import layout, row_bytes
from localinfer.backends.llamacpp.overrides import CPU, override_of
from localinfer.model.spec import ModelSpec
from localinfer.units import pad_to
from localinfer.util.memo import spec_cache

CPU_ALIGN = 32
CUDA_ALIGN = 128
CUDA_ROW_PADDING = 512      # MATRIX_ROW_PADDING in ggml-cuda
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
_INPUT_PREFIXES = ("token_embd", "pos_embd", "token_types")
_OUTPUT_NORM_AS_EMBD_NORM = ("lfm2", "lfm2moe")   # LLM_TENSOR_OUTPUT_NORM_LFM2 is named "token_embd_norm"


def _input_tensor(spec: ModelSpec, name: str) -> bool:
    """A tensor of the input layer (kept on the host): the embeddings, except LFM2's output norm, which
    llama-arch.cpp names ``token_embd_norm`` and lfm2.cpp loads as the output layer's."""
    if name.startswith("token_embd_norm") and spec.arch in _OUTPUT_NORM_AS_EMBD_NORM:
        return False
    return name.startswith(_INPUT_PREFIXES)

# CPU feature → {GGML type: required multiple of ne[1]}; a tensor is repacked when any rule matches.
REPACK_RULES: dict[str, dict[str, int]] = {
    "avx2": {"Q4_0": 8, "Q4_K": 8, "IQ4_NL": 8, "MXFP4": 8},
    "avx512": {"Q2_K": 8},
    "i8mm": {"Q4_0": 4, "Q4_K": 8, "Q5_K": 8, "Q6_K": 8, "Q8_0": 4},
    "dotprod": {"Q4_0": 4, "Q4_K": 8, "Q5_K": 8, "Q6_K": 8, "MXFP4": 4, "Q8_0": 4},
    "neon": {"IQ4_NL": 4},
}


def offloaded_units(n_layer: int, n_gpu_layers: int) -> range:
    """Units llama.cpp offloads for ``-ngl n_gpu_layers`` (negative: all): layers are 0..n_layer-1, the output
    layer is unit ``n_layer``; the last ``min(ngl, n_layer + 1)`` units (``i_gpu_start = n_layer + 1 − ngl``)."""
    ngl = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    return range(max(n_layer + 1 - ngl, 0), n_layer + 1)


def gpu_layer_start(n_layer: int, n_gpu_layers: int) -> int:
    """First repeating layer on the accelerator (``n_layer``: none) for ``-ngl n_gpu_layers``."""
    return min(offloaded_units(n_layer, n_gpu_layers).start, n_layer)


def output_on_gpu(n_layer: int, n_gpu_layers: int) -> bool:
    """Whether the output layer is offloaded: by every ``-ngl`` but 0 (it is the first unit to go)."""
    return len(offloaded_units(n_layer, n_gpu_layers)) > 0


def rope_once(spec: ModelSpec, kind: str, n_layers_here: int) -> int:
    """Bytes to take back from the sum over a device's layers when it holds ``n_layers_here`` of them.

    Each layer's ``rope_freqs`` is a duplicate of layer 0's, and the loader hands back a duplicate already in
    the same buffer type's context (llama-model-loader.cpp, ``TENSOR_DUPLICATED``): a device allocates it once,
    so every layer but its first gives its copy back."""
    rope = spec.tensor("rope_freqs.weight")
    if rope is None or n_layers_here < 2:
        return 0
    if kind == "cuda":
        return (n_layers_here - 1) * pad_to(cuda_alloc_size(rope.type.name, tuple(rope.shape), rope.n_bytes),
                                            CUDA_ALIGN)
    return (n_layers_here - 1) * pad_to(rope.n_bytes, CPU_ALIGN)


def repack_candidate(name: str, shape: tuple[int, ...]) -> bool:
    """A weight llama.cpp's CPU repack buffer can take: the 2-D weight of a MUL_MAT or the 3-D expert stack of a
    MUL_MAT_ID (ggml-cpu repack.cpp ``supports_op``: ggml_n_dims 2 resp. 3).  Other 3-D weights, such as MLA's
    ``attn_k_b``/``attn_v_b`` (batched per head in a MUL_MAT), are never repacked; nor are norms or embeddings."""
    if name.startswith(_INPUT_PREFIXES) or "norm" in name:
        return False
    return len(shape) == 2 or (len(shape) == 3 and "_exps." in name)


def repackable(type_name: str, shape: tuple[int, ...], cpu_features: tuple[str, ...]) -> bool:
    """Whether llama.cpp's CPU backend repacks a matmul weight of this type and shape."""
    if len(shape) < 2:
        return False
    for feat in cpu_features:
        need = REPACK_RULES.get(feat, {}).get(type_name)
        if need and shape[1] % need == 0:
            return True
    return False


@lru_cache(maxsize=8192)
def cuda_alloc_size(type_name: str, shape: tuple[int, ...], nbytes: int) -> int:
    """ggml-cuda's allocation for a weight: one extra padding of a quantized row to 512 values."""
    if layout(type_name).quantized and shape and shape[0] % CUDA_ROW_PADDING:
        return nbytes + row_bytes(type_name, CUDA_ROW_PADDING - shape[0] % CUDA_ROW_PADDING)
    return nbytes


@dataclass(frozen=True)
class Placed:
    name: str
    nbytes: int
    offset: int            # in the data section (mmap range)
    type_name: str
    shape: tuple[int, ...]
    on_gpu: bool
    matmul: bool           # used as the weight of a matrix multiplication
    duplicate: bool = False  # a second handle to the same file bytes (tied output, rope_freqs)


def place_tensors(spec: ModelSpec, n_gpu_layers: int) -> list[Placed]:
    """Every weight with its device, in file order, plus the duplicates llama.cpp creates."""
    n = spec.n_layers
    start = gpu_layer_start(n, n_gpu_layers)
    out_gpu = output_on_gpu(n, n_gpu_layers)
    placed: list[Placed] = []
    for t in spec.tensors:
        m = _LAYER_RE.match(t.name)
        if m:
            gpu = int(m.group(1)) >= start
        elif _input_tensor(spec, t.name):
            gpu = False
        elif t.name.startswith("rope_freqs"):
            gpu = start == 0
        else:
            gpu = out_gpu
        matmul = repack_candidate(t.name, tuple(t.shape))
        placed.append(Placed(t.name, t.n_bytes, t.offset, t.type.name, tuple(t.shape), gpu, matmul))
    embd = spec.tensor("token_embd.weight")
    if spec.tied_embeddings and embd is not None:
        placed.append(Placed("output.weight (tied)", embd.n_bytes, embd.offset, embd.type.name,
                             tuple(embd.shape), out_gpu, True, duplicate=True))
    rope = spec.tensor("rope_freqs.weight")
    if rope is not None:
        for il in range(1, n):
            placed.append(Placed(f"rope_freqs.weight (blk.{il})", rope.n_bytes, rope.offset, rope.type.name,
                                 tuple(rope.shape), il >= start, False, duplicate=True))
    return placed


@dataclass(frozen=True)
class WeightPlacement:
    """llama.cpp's model buffers for one device and ``-ngl``: name → bytes, split by pool."""

    buffers: dict[str, int]
    device_buffers: tuple[str, ...]
    n_gpu_layers: int            # repeating layers on the accelerator
    output_on_device: bool
    physical_bytes: int          # distinct bytes resident (mapped ranges counted once)
    repacked: tuple[str, ...]    # tensors copied into CPU_REPACK
    tensor_bytes: dict[str, int]  # per buffer: bytes of the tensors it holds (a mapping may span more)
    resident: dict[str, int] = field(default_factory=dict)  # per buffer: bytes that must stay in memory
    largest_repacked: int = 0    # bytes of the largest repacked tensor (without mmap it is staged once)

    @property
    def device_bytes(self) -> int:
        return sum(v for k, v in self.buffers.items() if k in self.device_buffers)

    @property
    def host_bytes(self) -> int:
        return sum(v for k, v in self.buffers.items() if k not in self.device_buffers)


def _range(items: list[Placed]) -> tuple[int, int] | None:
    if not items:
        return None
    return min(p.offset for p in items), max(p.offset + p.nbytes for p in items)


def _union(ranges: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for lo, hi in sorted(ranges):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def weight_placement(spec: ModelSpec, kind: str, n_gpu_layers: int = -1, *, mmap: bool = True,
                     cpu_features: tuple[str, ...] = (), repack: bool = True, mlock: bool = False,
                     overrides: tuple = ()) -> WeightPlacement:
    """llama.cpp's model buffers on a device of ``kind`` ("cuda", "metal", "cpu").

    ``cpu_features`` is the host CPU's SIMD level (it decides CPU_REPACK);
    ``repack=False`` is llama.cpp's ``--no-repack``; ``mlock`` locks the mapped range.
    A CPU device has no accelerator: every layer is on the CPU whatever ``n_gpu_layers`` says.
    ``overrides``: llama.cpp's tensor buffer overrides (:mod:`.overrides`), placed per tensor.
    """
    ngl = 0 if kind == "cpu" else n_gpu_layers
    if ngl >= 0 and ngl > spec.n_layers:
        ngl = -1
    memo = spec_cache(spec)
    overrides = tuple(overrides) if kind != "cpu" else ()   # on a CPU alone every buffer is the CPU's already
    key = ("placement", kind, ngl, mmap, tuple(cpu_features), repack, mlock, overrides)
    if key not in memo:
        feats = tuple(cpu_features) if repack else ()
        memo[key] = (_overridden_placement(spec, kind, ngl, mmap, feats, mlock, overrides) if overrides else
                     _weight_placement(spec, kind, ngl, mmap, feats, mlock))
    return memo[key]


def source_name(placed_name: str) -> str:
    """The name the loader matches overrides against: a duplicate is created under its original's name."""
    if placed_name.startswith("output.weight (tied)"):
        return "token_embd.weight"
    return placed_name.split(" (", 1)[0]


def device_buffer(kind: str) -> str:
    """The default buffer type of the first device of ``kind`` (``ggml_backend_buft_name``), as -ot names it."""
    return {"cuda": "CUDA0", "metal": "MTL0"}.get(kind, "CPU")


def tensor_on_device(p: Placed, kind: str, overrides) -> bool:
    """Whether tensor ``p`` lands in the device's buffer: its layer's place, unless an override names a buffer
    (CPU: the host; the device's own: the device)."""
    buft = override_of(source_name(p.name), overrides) if overrides else None
    if kind == "cpu":
        return False
    return p.on_gpu if buft is None else buft != CPU


def _overridden_placement(spec: ModelSpec, kind: str, ngl: int, mmap: bool, feats: tuple[str, ...], mlock: bool,
                          overrides) -> WeightPlacement:
    """The placement tensor by tensor when overrides apply: each tensor on the device or the host; a host tensor
    in CPU_REPACK where this CPU repacks it (the CPU list's extra buffer, select_weight_buft), else CPU."""
    n = spec.n_layers
    gpu, plain, rep = _Group(), _Group(), _Group()
    rope_here = 0
    for p in place_tensors(spec, ngl):
        if tensor_on_device(p, kind, overrides):
            gpu.add(p)
            rope_here += p.name.startswith("rope_freqs")
        elif p.matmul and repackable(p.type_name, p.shape, feats):
            rep.add(p)
        else:
            plain.add(p)
    start = gpu_layer_start(n, ngl)
    return _assemble(spec, kind, [g for g in (gpu,) if g.names], [g for g in (plain,) if g.names],
                     [g for g in (rep,) if g.names], rope_here, mmap, mlock, n - start,
                     output_on_gpu(n, ngl))


@dataclass
class _Group:
    """Aggregates of one placement unit (a layer, the input or the output layer)."""

    lo: int = 1 << 62          # mapped file range (a duplicate maps its original's bytes)
    hi: int = -1
    held: int = 0              # Σ bytes of the original tensors
    cpu_alloc: int = 0         # Σ padded bytes of the originals (no mmap)
    dup_alloc: int = 0         # Σ padded bytes of duplicates (real copies outside a mapping)
    cuda_alloc: int = 0        # Σ CUDA allocation, duplicates included
    largest: int = 0           # bytes of the largest tensor
    names: list[str] = field(default_factory=list)
    read: list[tuple[int, int]] = field(default_factory=list)  # mapped extents read whole after loading

    def add(self, p: Placed) -> None:
        self.cuda_alloc += pad_to(cuda_alloc_size(p.type_name, p.shape, p.nbytes), CUDA_ALIGN)
        self.names.append(p.name)
        self.lo, self.hi = min(self.lo, p.offset), max(self.hi, p.offset + p.nbytes)
        self.largest = max(self.largest, p.nbytes)
        if p.duplicate:
            self.dup_alloc += pad_to(p.nbytes, CPU_ALIGN)
        else:
            self.held += p.nbytes
            self.cpu_alloc += pad_to(p.nbytes, CPU_ALIGN)
        if p.matmul or not (p.duplicate or p.name.startswith(_INPUT_PREFIXES)):
            self.read.append((p.offset, p.offset + p.nbytes))     # embeddings: a row per token


def _groups(spec: ModelSpec, feats: tuple[str, ...]) -> dict:
    """Per unit ("in", "out", or layer index): (all tensors, CPU-plain tensors, repacked tensors) aggregates."""
    memo = spec_cache(spec)
    key = ("groups", feats)
    if key in memo:
        return memo[key]
    units: dict = {}
    if ("placed",) not in memo:
        memo[("placed",)] = place_tensors(spec, -1)
    for p in memo[("placed",)]:
        m = _LAYER_RE.match(p.name)
        if m:
            unit = int(m.group(1))
        elif p.name.startswith("rope_freqs"):
            unit = int(p.name.split("blk.")[1].rstrip(")")) if "blk." in p.name else 0
        elif _input_tensor(spec, p.name):
            unit = "in"
        else:
            unit = "out"
        every, plain, rep = units.setdefault(unit, (_Group(), _Group(), _Group()))
        every.add(p)
        (rep if p.matmul and repackable(p.type_name, p.shape, feats) else plain).add(p)
    memo[key] = units
    return units


def _weight_placement(spec: ModelSpec, kind: str, ngl: int, mmap: bool, feats: tuple[str, ...],
                      mlock: bool = False) -> WeightPlacement:
    n = spec.n_layers
    start = gpu_layer_start(n, ngl)
    out_gpu = kind != "cpu" and output_on_gpu(n, ngl)
    units = _groups(spec, feats)

    def on_gpu(unit) -> bool:
        if unit == "in":
            return False
        if unit == "out":
            return out_gpu
        return kind != "cpu" and unit >= start

    gpu = [units[u][0] for u in units if on_gpu(u)]
    plain = [units[u][1] for u in units if not on_gpu(u) and units[u][1].names]
    rep = [units[u][2] for u in units if not on_gpu(u) and units[u][2].names]
    return _assemble(spec, kind, gpu, plain, rep, n - start, mmap, mlock, n - start, out_gpu)


def _assemble(spec: ModelSpec, kind: str, gpu: list[_Group], plain: list[_Group], rep: list[_Group], rope_here: int,
              mmap: bool, mlock: bool, n_dev_layers: int, out_gpu: bool) -> WeightPlacement:
    """The buffers of the device, CPU (mapped or not) and CPU_REPACK from the groups each holds."""
    buffers: dict[str, int] = {}
    held: dict[str, int] = {}
    resident: dict[str, int] = {}
    device: list[str] = []
    ranges: list[tuple[int, int]] = []
    allocated = 0

    def mapped(name: str, groups: list[_Group], whole: bool) -> None:
        lo, hi = min(g.lo for g in groups), max(g.hi for g in groups)
        if hi < 0:
            buffers[name] = held[name] = resident[name] = 0
            return
        buffers[name], held[name] = hi - lo, sum(g.held for g in groups)
        ranges.append((lo, hi))
        extents = [(lo, hi)] if whole else [e for g in groups for e in g.read]
        resident[name] = _union(extents)

    if gpu:
        if kind == "cuda":
            name = "CUDA0 model"
            buffers[name] = sum(g.cuda_alloc for g in gpu) - rope_once(spec, kind, rope_here)
            allocated += buffers[name]
        elif mmap:
            name = "Metal_Mapped model"
            mapped(name, gpu, whole=True)
        else:
            name = "Metal model"
            buffers[name] = sum(g.cpu_alloc + g.dup_alloc for g in gpu) - rope_once(spec, kind, rope_here)
            allocated += buffers[name]
        device.append(name)
    if plain:
        if mmap:
            mapped("CPU_Mapped model", plain, whole=mlock)
        else:
            buffers["CPU model"] = sum(g.cpu_alloc for g in plain)
            allocated += buffers["CPU model"]
    repacked = tuple(name for g in rep for name in g.names)
    if rep:
        buffers["CPU_REPACK model"] = sum(g.cpu_alloc + g.dup_alloc for g in rep)
        allocated += buffers["CPU_REPACK model"]
    if kind == "cpu":
        device = list(buffers)
    return WeightPlacement(buffers, tuple(device), 0 if kind == "cpu" else n_dev_layers, out_gpu,
                           _union(ranges) + allocated, repacked, {k: held.get(k, v) for k, v in buffers.items()},
                           {k: resident.get(k, v) for k, v in buffers.items()}, max((g.largest for g in rep), default=0))

