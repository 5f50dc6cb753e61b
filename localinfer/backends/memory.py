"""What a backend must say about memory so that ``fit`` and ``plan`` can check a plan for it.

A backend's memory model is a plain object (its module imports no torch,
llama_cpp or mlx) with the attributes and methods of :class:`BackendMemory`.
The registry hands it to the planner by backend name; the planner never
compares backend names.  This module also holds the vocabulary both sides
speak: the request (:class:`FitRequest`), the terms of a breakdown, and the
weights an engine keeps resident.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from localinfer.errors import UsageError
from localinfer.model.kv import check_kv_type
from localinfer.model.spec import ModelSpec

MAX_PARALLEL = 256           # llama.cpp's LLAMA_MAX_SEQ
QUANT_GROUP = 32             # values per q4_x/q8_0 block = per MLX affine group
NOT_RESIDENT = ("rope_freqs.weight",)   # folded into RoPE frequencies by the torch and mlx engines


WEIGHT_DTYPE_BYTES = {"f32": 4, "float32": 4, "fp32": 4, "bf16": 2, "bfloat16": 2, "f16": 2, "float16": 2, "fp16": 2}


def check_weight_dtype(dtype: str | None, flag: str = "--dtype") -> str | None:
    """Normalise a weight dtype name (None: the backend's default); UsageError naming the flag."""
    if dtype is None:
        return None
    t = str(dtype).strip().lower()
    if t not in WEIGHT_DTYPE_BYTES:
        raise UsageError(f"{flag}: unknown weight dtype {dtype!r}", flag=flag, hint="use f32, bf16 or f16")
    return t


@dataclass(frozen=True)
class ResidentWeights:
    """Weight bytes a torch/mlx engine holds after loading, where, in what dtype, and the formula."""

    bytes: int
    runs_on: str        # "cuda", "metal" or "cpu": where the engine computes on a device of that kind
    dtype: str          # compute dtype the dequantized tensors take
    formula: str
    note: str | None = None   # set when the engine cannot use the device itself


@dataclass(frozen=True)
class Term:
    """One line of a memory breakdown: bytes, where they live, and how they were computed."""

    key: str            # "weights", "kv", "output", "compute", ...
    label: str
    bytes: int
    pool: str           # "device" or "host"
    formula: str
    buffer: str | None = None   # the llama.cpp buffer, e.g. "CUDA0 model", "CPU_Mapped model"
    reported: int | None = None  # what llama.cpp prints for that buffer, when it differs from ``bytes``
    resident: int | None = None  # bytes that must stay in memory, when fewer than ``bytes`` (a file mapping
    #                              whose pages are read once at load, or a row at a time); None: all of them
    resident_formula: str | None = None

    @property
    def resident_bytes(self) -> int:
        return self.bytes if self.resident is None else self.resident


@dataclass(frozen=True)
class MemoryBreakdown:
    """Every term of a plan's memory, split by pool.  On unified memory both pools are one.

    Two figures per pool: *mapped* (every buffer as the backend reports it, file
    mappings whole: what a process monitor shows before memory pressure) and
    *resident* (what must stay in memory: mapped pages that are read once at
    load are clean and reclaimable, so they are left out).  The verdict uses the
    resident figure, or the load peak when loading needs more (``load_peak``:
    bytes held at the worst moment of loading, 0 when never more than after it).
    """

    terms: tuple[Term, ...]
    unified: bool
    notes: tuple[str, ...] = field(default=())
    load_peak: int = 0
    load_peak_formula: str = ""

    def sum(self, key: str | None = None, pool: str | None = None, *, resident: bool = False) -> int:
        return sum(t.resident_bytes if resident else t.bytes for t in self.terms
                   if (key is None or t.key == key) and (pool is None or t.pool == pool))

    @property
    def weights(self) -> int:
        return self.sum("weights")

    @property
    def kv(self) -> int:
        return self.sum("kv")

    @property
    def state(self) -> int:
        """Recurrent state (hybrid and recurrent models): r and s rows per sequence."""
        return self.sum("state")

    @property
    def output(self) -> int:
        return self.sum("output")

    @property
    def compute(self) -> int:
        return self.sum("compute")

    @property
    def device_bytes(self) -> int:
        """What the accelerator (or, on unified memory, the whole machine) must hold: the resident bytes, or the
        load peak when it is larger."""
        if self.unified:
            return max(self.sum(resident=True), self.load_peak)
        return self.sum(pool="device", resident=True)

    @property
    def host_bytes(self) -> int:
        return 0 if self.unified else max(self.sum(pool="host", resident=True), self.load_peak)

    @property
    def resident_bytes(self) -> int:
        """Bytes that must stay in memory after loading (device pool, or all on unified memory)."""
        return self.sum(pool=None if self.unified else "device", resident=True)

    @property
    def mapped_bytes(self) -> int:
        """Every buffer as the backend reports it, file mappings whole (device pool, or all on unified memory)."""
        return self.sum(pool=None if self.unified else "device")

    @property
    def total(self) -> int:
        return self.sum()

    def to_dict(self) -> dict:
        return {
            "unified": self.unified,
            "weights": self.weights, "kv": self.kv, "state": self.state, "output": self.output,
            "compute": self.compute,
            "device_bytes": self.device_bytes, "host_bytes": self.host_bytes, "total": self.total,
            "resident_bytes": self.resident_bytes, "mapped_bytes": self.mapped_bytes,
            "weights_resident": self.sum("weights", resident=True),
            "load_peak_bytes": self.load_peak, "load_peak_formula": self.load_peak_formula,
            "terms": [dict(t.__dict__, resident_bytes=t.resident_bytes) for t in self.terms],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class FitRequest:
    """What the user asked for.  ``n_ctx`` is tokens per sequence; llama.cpp gets ``n_ctx × n_seq``."""

    n_ctx: int = 4096
    n_seq: int = 1
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool | None = None      # None: llama.cpp's auto (on where supported)
    n_gpu_layers: int = -1              # -1: every layer on the accelerator
    n_batch: int = 2048
    n_ubatch: int = 512
    n_outputs_max: int | None = None    # None: llama.cpp's default (n_batch)
    backend: str = "llama.cpp"
    mmap: bool = True                   # llama.cpp maps the file (its -lm mmap, the default)
    mlock: bool = False                 # and locks what it maps or allocates (-lm mmap+mlock / mlock)
    repack: bool = True                 # CPU weight repacking (llama.cpp's --no-repack turns it off)
    kv_unified: bool = False
    swa_full: bool = False              # llama.cpp CLI default; its C API (and llama-cpp-python) default to True
    n_ctx_total: int | None = None      # exact llama.cpp -c when it is not n_ctx × n_seq (check_load)
    dtype: str | None = None            # torch/mlx weight dtype; None: the engine's default where it runs
    packed: bool = False                # torch: q8_0/q4_0 matrices kept as GGUF blocks
    # llama.cpp's tensor buffer overrides (backends/llamacpp/overrides.py): -ot (pattern, buffer) pairs in order,
    # --cpu-moe (every layer's experts on the CPU), --n-cpu-moe N (the experts of layers 0..N-1)
    override_tensor: tuple[tuple[str, str], ...] = ()
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    # serve's second context for lone prompts (backends/llamacpp/aside_plan.py)
    prefill_aside: bool = False

    def __post_init__(self):
        if not isinstance(self.n_ctx, int) or isinstance(self.n_ctx, bool) or self.n_ctx <= 0:
            raise UsageError(f"context must be a positive integer, got {self.n_ctx!r}", flag="--ctx",
                             hint="e.g. --ctx 8192")
        if not isinstance(self.n_seq, int) or not 1 <= self.n_seq <= MAX_PARALLEL:
            raise UsageError(f"parallel sequences must be 1..{MAX_PARALLEL}, got {self.n_seq!r}", flag="--parallel")
        check_kv_type(self.type_k, "-ctk")
        check_kv_type(self.type_v, "-ctv")
        if self.flash_attn is False and self.type_v not in ("f32", "f16", "bf16"):
            raise UsageError(f"a {self.type_v} V cache needs flash attention", flag="--flash-attn",
                             hint="use --flash-attn on, or -ctv f16")
        if not isinstance(self.n_gpu_layers, int) or self.n_gpu_layers < -1:
            raise UsageError(f"--gpu-layers must be -1 (all) or a count >= 0, got {self.n_gpu_layers!r}",
                             flag="--gpu-layers")
        from localinfer.backends.registry import canonical

        object.__setattr__(self, "backend", canonical(self.backend))   # aliases (llamacpp, cuda) as run takes them
        if self.n_batch <= 0 or self.n_ubatch <= 0:
            raise UsageError("batch sizes must be positive", flag="--batch")
        check_weight_dtype(self.dtype)
        if not isinstance(self.n_cpu_moe, int) or isinstance(self.n_cpu_moe, bool) or self.n_cpu_moe < 0:
            raise UsageError(f"--n-cpu-moe must be a layer count >= 0, got {self.n_cpu_moe!r}", flag="--n-cpu-moe")
        object.__setattr__(self, "override_tensor", tuple(tuple(p) for p in self.override_tensor))

    @property
    def overridden(self) -> bool:
        """Whether any tensor buffer override is asked for (-ot, --cpu-moe, --n-cpu-moe)."""
        return bool(self.override_tensor or self.cpu_moe or self.n_cpu_moe)

    @property
    def llama_n_ctx(self) -> int:
        return self.n_ctx_total or self.n_ctx * self.n_seq

    @property
    def flash_attn_on(self) -> bool:
        return self.flash_attn is not False


@runtime_checkable
class BackendMemory(Protocol):
    """A backend's memory rules, as the planner asks for them.

    ``breakdown`` returns every term the backend allocates for ``req`` on
    ``device`` (and its cache geometry, or None); ``kv_bytes`` the KV cache of
    ``n_seq`` sequences of ``n_tokens``; ``runs_on`` where it computes on a device
    of a kind ("cuda" | "metal" | "cpu") and why when not there; ``command`` the
    command line that realises a plan ("" when there is none); ``load_request``
    the FitRequest fields a LoadPlan implies; ``probes_cuda`` / ``computes_on_cpu``
    which device ``run`` checks before loading; ``load_variants`` other ways to
    load the same plan that change its memory (label, FitRequest fields), for
    fit to compare (empty when there are none).  ``offload``: it can split layers
    between accelerator and host (``--gpu-layers``).  ``splits``: it can split a model
    across devices and hosts, and then has ``split``, ``fitting_split`` and ``smallest_set``
    (each answering :class:`localinfer.backends.split.SplitBreakdown`).
    """

    name: str
    offload: bool
    splits: bool
    speed_modelled: bool      # the profiles' speed model (roofline × efficiencies) describes its kernels

    def runs_on(self, kind: str) -> tuple[str, str | None]: ...

    def refuses(self, spec: ModelSpec) -> str | None: ...     # why it cannot run this model (None: it can)

    def breakdown(self, spec: ModelSpec, device: Any, req: FitRequest) -> tuple[MemoryBreakdown, Any]: ...

    def kv_bytes(self, spec: ModelSpec, n_tokens: int, type_k: str = "f16", type_v: str = "f16", *,
                 n_seq: int = 1, layers=None, **options) -> int: ...

    def command(self, spec: ModelSpec, req: FitRequest, geometry: Any, device: Any,
                n_gpu_layers: int | None = None) -> str: ...

    def load_request(self, plan: Any) -> dict: ...

    def load_variants(self, spec: ModelSpec, device: Any, req: FitRequest) -> tuple[tuple[str, dict], ...]: ...

    def probes_cuda(self, plan: Any) -> bool: ...

    def host_tensors(self, spec: ModelSpec, device: Any, req: FitRequest) -> frozenset[str]:
        """Weights ``req`` keeps in host RAM on ``device`` (asked only where ``offload`` and ``speed_modelled``)."""

    def computes_on_cpu(self, plan: Any, kind: str) -> bool: ...

    def slot_cells(self, n_tokens: int) -> int:
        """KV positions one sequence of ``n_tokens`` takes as the backend allocates it (its padding)."""


def check_tokens(n_tokens: int, n_seq: int) -> None:
    if n_tokens < 0 or n_seq <= 0:
        raise UsageError(f"tokens {n_tokens} and sequences {n_seq} must be non-negative/positive", flag="--ctx")


def resident_breakdown(rw: ResidentWeights, kv: int, device: Any, backend: str, blocks: str) -> MemoryBreakdown:
    """Two terms for an engine that loads weights into its own tensors: the weights it holds and its KV cache.

    Where the engine cannot use the device it runs on the CPU: in a unified
    machine's memory, or in a discrete device's host.
    """
    pool = "host" if rw.runs_on == "cpu" and device.kind != "cpu" and not device.unified else "device"
    terms = (Term("weights", f"weights ({rw.dtype})", rw.bytes, pool, rw.formula, None),
             Term("kv", "KV cache", kv, pool, f"{backend} KV: n_seq × tokens in {blocks} × bytes/token", None))
    notes = ([rw.note] if rw.note and pool == "device" else []) + [f"{backend}: activations and work areas are not counted"]
    return MemoryBreakdown(terms, device.unified or device.kind == "cpu", tuple(notes))


def refusal(check, spec: ModelSpec) -> str | None:
    """What ``check(spec)`` refuses, as one line with its hint (an UnsupportedModelError), or None: how a memory
    model answers ``refuses`` from its engine's own support check."""
    from localinfer.errors import UnsupportedModelError

    try:
        check(spec)
    except UnsupportedModelError as exc:
        return exc.message + (f"; {exc.hint}" if exc.hint else "")
    return None


class OwnTensorsMemory:
    """Shared rules of engines that load the weights into their own tensors (torch, mlx): two terms, weights
    as held and the KV cache; no layer offload, no command line.  Subclasses give ``name``, ``blocks`` (how
    the KV grows, for the formula), ``runs_on``, ``resident_weights``, ``kv_bytes`` and ``load_request``."""

    offload = False
    splits = False
    speed_modelled = False
    blocks = ""

    def refuses(self, spec: ModelSpec) -> str | None:
        """Why the engine cannot run ``spec``; the default: it runs what it loads (torch and mlx say more)."""
        return None

    def slot_cells(self, n_tokens: int) -> int:
        return n_tokens

    def host_tensors(self, spec: ModelSpec, device: Any, req: FitRequest) -> frozenset[str]:
        """No layer offload: nothing in host RAM beside the device's own tensors."""
        return frozenset()

    def placement(self, spec, kind: str, dtype: str | None) -> tuple[str, str | None, str, int]:
        """(where it computes, why not on the device, weight dtype, bytes per value) on a device of ``kind``."""
        runs_on, note = self.runs_on(kind)
        dt = check_weight_dtype(dtype) or self.default_dtype(spec, runs_on)
        return runs_on, note, dt, WEIGHT_DTYPE_BYTES[dt]

    def breakdown(self, spec, device, req):
        rw = self.resident_weights(spec, device.kind, req.dtype, packed=req.packed)
        kv = self.kv_bytes(spec, req.n_ctx, req.type_k, req.type_v, n_seq=req.n_seq)
        return resident_breakdown(rw, kv, device, self.name, self.blocks), None

    def command(self, spec, req, geometry, device, n_gpu_layers=None) -> str:
        return ""

    def probes_cuda(self, plan) -> bool:
        return False

    def computes_on_cpu(self, plan, kind: str) -> bool:
        return (plan.device or "").lower() == "cpu" or self.runs_on(kind)[0] == "cpu"

    def load_variants(self, spec, device, req) -> tuple:
        return ()
