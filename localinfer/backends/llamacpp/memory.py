"""llama.cpp's memory: KV cells, the logits buffer, every term of a plan, and the command line.

KV: ``-c`` is padded to 256 cells; without ``--kv-unified`` each of ``-np``
sequences gets its own stream of pad(c / np, 256) cells; sliding-window layers
hold pad(min(cells, window + n_ubatch), 256).  Weights follow
:mod:`localinfer.backends.llamacpp.placement`; the compute buffer
:mod:`localinfer.backends.llamacpp.compute_buffer`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gguf_tools.quants import layout, parse_type
from localinfer.backends.llamacpp.aside_plan import aside_terms
from localinfer.backends.llamacpp.compute_buffer import compute_estimate
from localinfer.backends.llamacpp.override_compute import overridden_compute
from localinfer.backends.llamacpp.overrides import CPU, check_overrides, override_flags, request_overrides
from localinfer.backends.llamacpp.placement import device_buffer, gpu_layer_start, weight_placement
from localinfer.backends.memory import FitRequest, MemoryBreakdown, Term, check_tokens
from localinfer.errors import UsageError
from localinfer.model.kv import attention_layers, check_kv_type, kv_rows, recurrent_rows, recurrent_state_bytes
from localinfer.model.spec import ModelSpec
from localinfer.units import pad_to
from localinfer.util.memo import spec_cache

LLAMA_CTX_PAD = 256          # llama.cpp pads n_ctx and n_ctx_seq to multiples of 256
LOGIT_BYTES = 4              # llama.cpp keeps logits as float32
DEFAULT_OUTPUTS_MAX = 64     # logit rows per llama_decode in our engine: drafts + 1 fit easily


@dataclass(frozen=True)
class LlamaCells:
    """How llama.cpp sizes its KV cache for a requested context."""

    n_ctx: int           # total cells (what llama.cpp prints as n_ctx)
    n_ctx_seq: int       # cells each sequence may use
    n_stream: int        # KV streams (n_seq unless kv_unified)
    cells_base: int      # cells per stream in full-attention layers
    cells_swa: int       # cells per stream in sliding-window layers

    @property
    def total_base(self) -> int:
        return self.cells_base * self.n_stream

    @property
    def total_swa(self) -> int:
        return self.cells_swa * self.n_stream


def llama_cells(spec: ModelSpec | None, n_ctx: int, n_seq: int = 1, *, n_ubatch: int = 512,
                kv_unified: bool = False, swa_full: bool = False) -> LlamaCells:
    """llama.cpp's cache geometry for ``-c n_ctx -np n_seq`` (n_ctx is the total, as llama.cpp takes it).

    n_ctx is padded to 256; without a unified cache each sequence gets its own
    stream of pad(n_ctx / n_seq, 256) cells and n_ctx becomes that times n_seq.
    Sliding-window layers get pad(min(cells, window·(n_seq if unified else 1) + n_ubatch), 256).
    """
    if n_ctx <= 0 or n_seq <= 0:
        raise UsageError(f"context {n_ctx} and parallel {n_seq} must be positive", flag="--ctx")
    total = pad_to(n_ctx, LLAMA_CTX_PAD)
    if kv_unified:
        per_seq, n_stream, cells = total, 1, total
    else:
        per_seq = pad_to(total // n_seq, LLAMA_CTX_PAD)
        if per_seq == 0:
            raise UsageError(f"context {n_ctx} is too small for {n_seq} sequences", flag="--ctx")
        total, n_stream, cells = per_seq * n_seq, n_seq, per_seq
    cells_swa = cells
    if spec is not None and spec.has_swa and not swa_full:
        window = spec.sliding_window * (n_seq if kv_unified else 1) + n_ubatch
        cells_swa = pad_to(min(cells, window), LLAMA_CTX_PAD)
    return LlamaCells(total, per_seq, n_stream, cells, cells_swa)


def llama_kv_layer_bytes(spec: ModelSpec, il: int, cells: LlamaCells, type_k: str, type_v: str,
                         align: int = 32) -> tuple[int, int]:
    """(K bytes, V bytes) of layer il's cache tensors in llama.cpp (0 for layers without KV)."""
    k_row, v_row, swa = kv_rows(spec, type_k, type_v)[il]
    n = cells.total_swa if swa else cells.total_base
    return pad_to(k_row * n, align), pad_to(v_row * n, align)


def kv_bytes_from_layer(spec: ModelSpec, start: int, cells: LlamaCells, type_k: str, type_v: str) -> int:
    """llama.cpp KV bytes of layers start..n_layer-1 (cell counts are multiples of 256, so no padding)."""


    memo = spec_cache(spec)
    key = ("kv_suffix", type_k, type_v)
    if key not in memo:
        base, swa = [0] * (spec.n_layers + 1), [0] * (spec.n_layers + 1)
        for il, (k, v, is_swa) in reversed(list(enumerate(kv_rows(spec, type_k, type_v)))):
            base[il] = base[il + 1] + (0 if is_swa else k + v)
            swa[il] = swa[il + 1] + (k + v if is_swa else 0)
        memo[key] = (base, swa)
    base, swa = memo[key]
    start = min(max(start, 0), spec.n_layers)
    return base[start] * cells.total_base + swa[start] * cells.total_swa


def outputs_cap(plan) -> int:
    """Most logit rows one llama_decode may return (llama.cpp reserves compute memory for them): ours
    (``n_outputs_max``, default DEFAULT_OUTPUTS_MAX, at most n_batch), but never fewer than the sequences, as
    llama.cpp reserves an output row per sequence and aborts when they exceed its ``n_outputs_max``."""
    cap = plan.options.get("n_outputs_max", DEFAULT_OUTPUTS_MAX)
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise UsageError(f"n_outputs_max must be a positive integer, got {cap!r}")
    return max(min(cap, plan.n_batch), plan.n_seq)


def output_bytes(spec: ModelSpec, n_seq: int = 1, n_outputs: int = 0) -> int:
    """llama.cpp's host output buffer: float32 logits for max(n_seq, n_outputs) rows of the vocabulary.

    It is reserved for n_seq rows at context creation and grows when a batch
    asks for more logits (e.g. speculative verification of k drafts asks k + 1).
    """
    return spec.vocab_size * max(n_seq, n_outputs) * LOGIT_BYTES


def llama_kv_bytes(spec: ModelSpec, n_tokens: int, type_k: str = "f16", type_v: str = "f16", *, n_seq: int = 1,
                   n_ubatch: int = 512, kv_unified: bool = False, swa_full: bool = False, layers=None,
                   **_ignored) -> int:
    """KV bytes of ``n_seq`` sequences of ``n_tokens``: llama.cpp gets ``-c n_tokens × n_seq``, cells as in
    :func:`llama_cells`; K and V types separate."""
    check_tokens(n_tokens, n_seq)
    if n_tokens == 0:
        return 0
    type_k, type_v = check_kv_type(type_k, "-ctk"), check_kv_type(type_v, "-ctv")
    cells = llama_cells(spec, n_tokens * n_seq, n_seq, n_ubatch=n_ubatch, kv_unified=kv_unified, swa_full=swa_full)
    if layers is None:
        return kv_bytes_from_layer(spec, 0, cells, type_k, type_v)
    return sum(sum(llama_kv_layer_bytes(spec, il, cells, type_k, type_v)) for il in attention_layers(spec, layers))


def llama_geometry(spec: ModelSpec, req: FitRequest) -> tuple[LlamaCells, tuple[tuple[int, int], ...]]:
    """KV cells, and the (tokens, logit rows) of each worst-case graph llama.cpp reserves compute memory for
    (llama-context.cpp, ``sched_reserve``; the buffers keep the largest of them).

    n_batch is at most n_ctx and n_ubatch at most n_batch (the sliding-window cells follow the n_ubatch it ends
    up with).  The prompt graph has min(n_ubatch, n_outputs_max) logit rows and n_ubatch tokens rounded up to a
    multiple of the sequences (``graph_reserve``: an equal share for each of n_seq_max); the decode graph, a
    token and a logit row per sequence, is listed only when it has more rows than the prompt graph."""
    cells = llama_cells(spec, req.llama_n_ctx, req.n_seq, n_ubatch=req.n_ubatch, kv_unified=req.kv_unified,
                        swa_full=req.swa_full)
    n_batch = min(cells.n_ctx, req.n_batch)
    n_ubatch = min(n_batch, req.n_ubatch)
    if n_ubatch != req.n_ubatch:
        cells = llama_cells(spec, req.llama_n_ctx, req.n_seq, n_ubatch=n_ubatch, kv_unified=req.kv_unified,
                            swa_full=req.swa_full)
    n_outputs = min(n_ubatch, n_batch if req.n_outputs_max is None else req.n_outputs_max)
    graphs = ((pad_to(n_ubatch, req.n_seq), n_outputs),)
    return cells, graphs + (((req.n_seq, req.n_seq),) if req.n_seq > n_outputs else ())


def check_cache_types(spec: ModelSpec, type_k: str, type_v: str, flash_attn: bool) -> None:
    """UsageError where llama.cpp refuses the cache types for this model (llama-context.cpp,
    llama_init_from_model): an MLA cache (K only) needs K and V of one type; with flash attention a quantized
    K (V) type's blocks must divide the K (V) head size."""
    if spec.mla is not None and spec.rules == "mla" and type_k != type_v:
        raise UsageError(f"this MLA model caches one latent as K, so llama.cpp needs one cache type: -ctk {type_k} "
                         f"and -ctv {type_v} differ", flag="-ctv", hint=f"use -ctk {type_k} -ctv {type_k}")
    if not flash_attn:
        return
    for flag, name, head in (("-ctk", type_k, spec.head_dim_k), ("-ctv", type_v, spec.head_dim_v)):
        block = layout(parse_type(name)).block_values
        if block > 1 and head % block:
            raise UsageError(f"a {name} {flag[-1].upper()} cache with flash attention needs heads of a multiple of "
                             f"{block} values; this model's have {head}", flag=flag, hint=f"use {flag} f16")


def _pool(kind: str, on_device: bool) -> str:
    return "device" if kind == "cpu" or on_device else "host"


def breakdown(spec: ModelSpec, device, req: FitRequest) -> tuple[MemoryBreakdown, LlamaCells]:
    """Every memory term of ``req`` on ``device`` as llama.cpp allocates it, with its formula."""
    kind = device.kind
    check_cache_types(spec, req.type_k, req.type_v, req.flash_attn_on)
    ngl = 0 if kind == "cpu" else req.n_gpu_layers
    cells, graphs = llama_geometry(spec, req)
    terms: list[Term] = []
    unified = device.unified or kind == "cpu"
    overrides = request_overrides(req)
    if overrides:
        check_overrides((t.name for t in spec.tensors), overrides, (CPU,) + ((device_buffer(kind),)
                                                                           if kind != "cpu" else ()))
    wp = weight_placement(spec, kind, ngl, mmap=req.mmap, cpu_features=device.cpu_features, repack=req.repack,
                          mlock=req.mlock, overrides=overrides)
    for name, nbytes in wp.buffers.items():
        on_dev = name in wp.device_buffers
        formula = ("file range from the first to the last byte of the mapped tensors" if "Mapped" in name else
                   "Σ matmul weights repacked for this CPU (anonymous memory)" if "REPACK" in name else
                   "Σ tensor bytes, padded and aligned")
        counted = nbytes
        if not on_dev and not device.unified and kind != "cpu" and wp.tensor_bytes[name] != nbytes:
            counted = wp.tensor_bytes[name]
            formula = "Σ bytes of the tensors kept on the host (the mapping spans more, read once at load)"
        resident = resident_formula = None
        if kind == "cpu" and wp.resident[name] != nbytes:      # the CPU computes from this buffer
            resident = wp.resident[name]
            resident_formula = ("Σ bytes of the mapped tensors read after loading: not the repacked ones (read "
                                "once, at load), not the token embeddings (a row per token)")
        terms.append(Term("weights", f"weights ({name.split()[0]})", counted, _pool(kind, on_dev), formula, name,
                          reported=nbytes if counted != nbytes else None, resident=resident,
                          resident_formula=resident_formula))
    start = spec.n_layers if (kind == "cpu" or ngl == 0) else gpu_layer_start(spec.n_layers, ngl)
    kv_dev = kv_bytes_from_layer(spec, start, cells, req.type_k, req.type_v)
    kv_host = kv_bytes_from_layer(spec, 0, cells, req.type_k, req.type_v) - kv_dev
    kv_formula = (f"Σ layers (row_bytes({req.type_k}, n_head_kv·{spec.head_dim_k}) + row_bytes({req.type_v}, "
                  f"n_head_kv·{spec.head_dim_v})) × cells; cells = pad(n_ctx {req.llama_n_ctx}, 256) → "
                  f"{cells.n_stream} stream(s) × {cells.cells_base}"
                  + (f" ({cells.cells_swa} in sliding-window layers)" if spec.has_swa else ""))
    if spec.mla is not None and spec.kv_dims and not any(v for _, v in spec.kv_dims):
        kv_formula = (f"Σ layers row_bytes({req.type_k}, kv_lora_rank {spec.mla.kv_lora_rank} + rope "
                      f"{spec.mla.n_rot}) × cells (MLA caches one latent, no V); cells = pad(n_ctx "
                      f"{req.llama_n_ctx}, 256) → {cells.n_stream} stream(s) × {cells.cells_base}")
    elif spec.has_recurrent:
        kv_formula += f" (only the {len(attention_layers(spec))} attention layers of {spec.n_layers})"
    dev = {"cuda": "CUDA0", "metal": "Metal"}.get(kind, "CPU")
    if kv_dev:
        terms.append(Term("kv", "KV cache", kv_dev, "device", kv_formula, f"{dev} KV"))
    if kv_host:
        terms.append(Term("kv", "KV cache (CPU layers)", kv_host, _pool(kind, False), kv_formula, "CPU KV"))
    if spec.has_recurrent:
        align = 128 if kind == "cuda" else 32
        on_dev = range(start, spec.n_layers)
        rs_dev = recurrent_state_bytes(spec, req.n_seq, layers=on_dev, align=align)
        rs_host = recurrent_state_bytes(spec, req.n_seq, layers=range(start), align=32)
        r, s_ = spec.rs_dims
        rs_formula = (f"{len(spec.recurrent_layers)} recurrent layers × (r {r} + s {s_} values) × 4 B (F32) × "
                      f"{recurrent_rows(req.n_seq)} rows (one per sequence)")
        if rs_dev:
            terms.append(Term("state", "recurrent state", rs_dev, "device", rs_formula, f"{dev} RS"))
        if rs_host:
            terms.append(Term("state", "recurrent state (CPU layers)", rs_host, _pool(kind, False), rs_formula,
                              "CPU RS"))
    terms.append(Term("output", "output buffer (logits)", output_bytes(spec, req.n_seq), _pool(kind, False),
                      f"n_vocab {spec.vocab_size} × n_seq {req.n_seq} × 4 B (float32 logits)", "CPU output"))
    gpu_layers = 0 if start >= spec.n_layers else spec.n_layers - start
    ces = [compute_estimate(spec, n_kv=cells.cells_base, n_ubatch=tokens, n_outputs=rows,
                            flash_attn=req.flash_attn_on, kind=kind, gpu_layers=gpu_layers,
                            type_k=req.type_k, type_v=req.type_v, n_kv_swa=cells.cells_swa, n_stream=cells.n_stream,
                            n_seqs=req.n_seq)
           for tokens, rows in graphs]
    ce = ces[0]
    if len(ces) > 1:
        ce = replace(ce, device=max(c.device for c in ces), host=max(c.host for c in ces),
                     formula=ce.formula + f"; or the decode graph ({req.n_seq} tokens and logit rows), if larger")
    if overrides and kind != "cpu":
        dev_b, host_b, formula = overridden_compute(spec, kind, req, overrides, cells, graphs, device.cpu_features)
        ce = replace(ce, device=dev_b, host=host_b, formula=formula, host_formula="the same replay: the host's splits")
    terms.append(Term("compute", "compute buffer", ce.device, "device", ce.formula, f"{dev} compute"))
    if ce.host:
        terms.append(Term("compute", "compute buffer (host)", ce.host, "host", ce.host_formula, "CPU compute"))
    terms += aside_terms(spec, device, req, breakdown)
    notes: list[str] = []
    mapped = sum(t.bytes for t in terms if t.key == "weights")
    if unified and mapped > wp.physical_bytes:
        terms.append(Term("weights", "weights mapped twice (counted once)", wp.physical_bytes - mapped, "device",
                          "overlap of the Metal and CPU mapped file ranges", None))
    peak, peak_formula = load_peak(wp, req, unified) if kind == "cpu" else (0, "")
    if wp.repacked:
        if req.mmap and not req.mlock:
            how = ("their mapped pages are read once, at load, and then stay only as clean page cache the kernel "
                   "reclaims: counted in the mapped total, not in the resident memory")
        elif req.mmap:
            how = "with mlock their mapped pages stay locked too: both copies count"
        else:
            how = "without mmap they are read straight into that buffer (one tensor staged at a time)"
        notes.append(f"llama.cpp repacks {len(wp.repacked)} weight tensors for this CPU "
                     f"({', '.join(device.cpu_features)}) into CPU_REPACK; {how}")
    return MemoryBreakdown(tuple(terms), unified, tuple(notes), peak, peak_formula), cells


def load_peak(wp, req: FitRequest, unified: bool) -> tuple[int, str]:
    """Host bytes held at the worst moment of loading, when loading holds more than the weights it leaves.

    Without mmap, llama.cpp reads each tensor of a buffer that is not host memory (CPU_REPACK) into a
    staging copy of its size before repacking it, largest first: at most the weights plus the largest
    repacked tensor.  With mmap the source is the mapping itself (clean page cache): no extra bytes.
    """
    if req.mmap or not wp.repacked:
        return 0, ""
    host = sum(v for k, v in wp.resident.items() if unified or k not in wp.device_buffers)
    return host + wp.largest_repacked, (f"weights {host} + one staging copy of the largest repacked tensor "
                                        f"{wp.largest_repacked} (--no-mmap reads it before repacking)")


LOAD_MODES = {(True, False): "mmap", (True, True): "mmap+mlock", (False, False): "none", (False, True): "mlock"}


def load_flags(req: FitRequest) -> list[str]:
    """llama.cpp's flags for the request's load mode and repacking (defaults print nothing)."""
    mode = LOAD_MODES[(req.mmap, req.mlock)]
    return (["-lm", mode] if mode != "mmap" else []) + ([] if req.repack else ["--no-repack"])


def variant_label(c: dict, repack_asked: bool) -> str:
    """A load variant as llama.cpp's flags, the mode always named: ``-lm none --no-repack``."""
    flags = ["-lm", LOAD_MODES[(c["mmap"], c["mlock"])]]
    if c["repack"] != repack_asked or not c["repack"]:
        flags.append("--repack" if c["repack"] else "--no-repack")
    return " ".join(flags)


def llama_command(spec: ModelSpec, req: FitRequest, cells: LlamaCells | None, device,
                  n_gpu_layers: int | None = None) -> str:
    """The llama.cpp command line that realises this plan."""
    path = spec.path if " " not in spec.path else f'"{spec.path}"'
    tool = "llama-server" if req.n_seq > 1 else "llama-cli"
    parts = [tool, "-m", path, "-c", str(cells.n_ctx if cells else req.llama_n_ctx)]
    if req.n_seq > 1:
        parts += ["-np", str(req.n_seq)]
    if device.kind != "cpu":
        ngl = req.n_gpu_layers if n_gpu_layers is None else n_gpu_layers
        parts += ["-ngl", "999" if ngl < 0 else str(ngl)]
    else:
        parts += ["-ngl", "0"]
    if (req.type_k, req.type_v) != ("f16", "f16"):
        parts += ["-ctk", req.type_k, "-ctv", req.type_v]
    parts += ["-fa", "on" if req.flash_attn_on else "off"]
    if req.n_batch != 2048:
        parts += ["-b", str(req.n_batch)]
    if req.n_ubatch != 512:
        parts += ["-ub", str(req.n_ubatch)]
    if req.kv_unified:
        parts.append("-kvu")
    if req.swa_full and spec.has_swa:
        parts.append("--swa-full")
    parts += load_flags(req)
    parts += override_flags(req.override_tensor, req.cpu_moe, req.n_cpu_moe)
    return " ".join(parts)


class LlamaCppMemory:
    """The memory model the registry hands out for ``llama.cpp``."""

    name = "llama.cpp"
    offload = True
    speed_modelled = True       # the device profiles' efficiencies describe llama.cpp's kernels

    def runs_on(self, kind: str) -> tuple[str, str | None]:
        return kind, None

    def refuses(self, spec) -> str | None:
        return None             # llama.cpp runs every architecture its loader knows

    def breakdown(self, spec, device, req):
        return breakdown(spec, device, req)

    def kv_bytes(self, spec, n_tokens, type_k="f16", type_v="f16", **options) -> int:
        return llama_kv_bytes(spec, n_tokens, type_k, type_v, **options)

    def command(self, spec, req, geometry, device, n_gpu_layers=None) -> str:
        return llama_command(spec, req, geometry, device, n_gpu_layers)

    def load_request(self, plan) -> dict:
        """FitRequest fields a LoadPlan implies: logit rows per decode, load mode, repacking, llama-cpp-python's
        swa_full, one KV stream for all sequences (serve's unified cache), tensor buffer overrides, serve's second
        context for lone prompts."""
        o = plan.options
        return {"n_outputs_max": outputs_cap(plan), "mmap": bool(o.get("mmap", True)), "mlock": bool(o.get("mlock")),
                "repack": bool(o.get("repack", True)), "swa_full": bool(o.get("swa_full", True)),
                "kv_unified": bool(o.get("kv_unified")),
                "override_tensor": tuple(tuple(x) for x in o.get("override_tensor", ())),
                "cpu_moe": bool(o.get("cpu_moe")), "n_cpu_moe": int(o.get("n_cpu_moe") or 0),
                "prefill_aside": bool(o.get("prefill_aside"))}

    def load_variants(self, spec, device, req) -> tuple[tuple[str, dict], ...]:
        """On a CPU device: the four load modes, and repacking switched, where llama.cpp repacks."""
        if device.kind != "cpu":
            return ()
        out = [{"mmap": m, "mlock": lk, "repack": req.repack} for m, lk in LOAD_MODES]
        if weight_placement(spec, device.kind, req.n_gpu_layers, cpu_features=device.cpu_features).repacked:
            out.append({"mmap": req.mmap, "mlock": req.mlock, "repack": not req.repack})
        return tuple((variant_label(c, req.repack), c) for c in out)

    def host_tensors(self, spec, device, req) -> frozenset[str]:
        """Names of the weights ``req`` keeps in host memory on ``device`` (the layers -ngl leaves and the tensors
        the overrides send to CPU), for the speed of a split; empty on a CPU or unified device."""
        if device.kind == "cpu" or device.unified:
            return frozenset()
        from localinfer.backends.llamacpp.placement import place_tensors, source_name, tensor_on_device

        overrides = request_overrides(req)
        ngl = -1 if req.n_gpu_layers > spec.n_layers else req.n_gpu_layers
        return frozenset(source_name(p.name) for p in place_tensors(spec, ngl)
                         if not tensor_on_device(p, device.kind, overrides))

    def probes_cuda(self, plan) -> bool:
        return False

    def computes_on_cpu(self, plan, kind: str) -> bool:
        return kind == "cpu"

    def slot_cells(self, n_tokens: int) -> int:
        """KV cells a sequence of ``n_tokens`` takes in a context (llama.cpp pads n_ctx_seq to 256)."""
        return pad_to(n_tokens, LLAMA_CTX_PAD)

    splits = True               # layers across devices: RPC workers and local GPUs (-sm layer)

    def split(self, spec, devices, req, shares=None, *, cpu_features=()):
        from localinfer.backends.llamacpp.split import split_breakdown

        return split_breakdown(spec, devices, req, shares, cpu_features=cpu_features)

    def fitting_split(self, spec, devices, req, *, cpu_features=()):
        from localinfer.backends.llamacpp.split import fitting_split

        return fitting_split(spec, devices, req, cpu_features=cpu_features)

    def smallest_set(self, spec, devices, req, *, cpu_features=()):
        from localinfer.backends.llamacpp.split import smallest_set

        return smallest_set(spec, devices, req, cpu_features=cpu_features)


MEMORY = LlamaCppMemory()
