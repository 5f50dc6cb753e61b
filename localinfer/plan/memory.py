"""The memory budgeter: pure functions over (spec, settings) in integer bytes.

Each function answers one question the way a given backend allocates memory:

* KV cache — ``kv_bytes`` for ``"llama.cpp"`` (cells; ``n_ctx`` padded to 256;
  sliding-window layers sized like its iSWA cache), ``"torch"`` (16-token blocks,
  GGUF block layout) and ``"mlx"`` (mlx-lm's caches, grown 256 tokens at a time).
* weights — ``weight_placement``: which tensor lands in which llama.cpp buffer,
  with exact partial offload by layer, the mmap'd host range and the CPU
  repack copy; ``resident_weights`` for the torch engine (dequantized to its
  dtype) and the mlx engine (Q4_0/Q4_1/Q8_0 as affine groups, the rest dequantized).
* output (logits) buffer, reservation for generated tokens, shared prefixes,
  paged-block waste.

The compute buffer lives in :mod:`localinfer.backends.llamacpp.compute_buffer`; the assembly of
all terms for a device in :mod:`localinfer.plan.fit`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from gguf_tools.quants import layout, parse_type

from localinfer.errors import UsageError
from localinfer.model.spec import ModelSpec

BACKENDS = ("llama.cpp", "torch", "mlx")
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
LLAMA_CTX_PAD = 256          # llama.cpp pads n_ctx and n_ctx_seq to multiples of 256
TORCH_BLOCK_TOKENS = 16      # the torch engine's paged-KV block
MLX_STEP = 256               # mlx-lm caches grow in steps of 256 tokens
MLX_GROUP_SIZES = (64, 32)    # KV group sizes tried in order (mlx-lm's default 64, else 32)
MLX_KV_BITS = {"q8_0": 8, "q8": 8, "q4_0": 4, "q4": 4}
FLOAT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
LOGIT_BYTES = 4              # llama.cpp keeps logits as float32


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def check_kv_type(name: str, flag: str = "--kv-type", allowed: tuple[str, ...] = KV_TYPES) -> str:
    """Normalise a KV type name; UsageError naming the flag and the accepted values."""
    t = str(name).strip().lower()
    if t not in allowed:
        raise UsageError(f"{flag}: unknown KV type {name!r}", flag=flag, hint="use one of " + ", ".join(allowed))
    return t


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}", flag="--backend", hint="use one of " + ", ".join(BACKENDS))
    return backend


@lru_cache(maxsize=4096)
def row_bytes(type_name: str, n_values: int) -> int:
    """Bytes of one row of n_values in a GGML type (ggml_row_size): q8_0 is 34 B per 32 values."""
    lay = layout(parse_type(type_name))
    if n_values % lay.block_values:
        raise UsageError(f"a {type_name} KV row needs a multiple of {lay.block_values} values, "
                         f"this model has {n_values}", flag="--kv-type", hint="use f16 or q8_0")
    return n_values // lay.block_values * lay.block_bytes


def attention_layers(spec: ModelSpec, layers=None) -> list[int]:
    """Layers that hold a KV cache (those with KV heads), optionally restricted to ``layers``."""
    chosen = range(spec.n_layers) if layers is None else layers
    return [il for il in chosen if spec.n_head_kv[il] > 0]


def kv_bytes_per_token(spec: ModelSpec, type_k: str = "f16", type_v: str = "f16", *, layers=None) -> int:
    """KV bytes one token adds across all (or the given) attention layers, GGUF block layout.

    Qwen3-8B in f16: 2 × 36 × 8 × 128 × 2 B = 147,456 B (144 KiB).
    """
    type_k, type_v = check_kv_type(type_k, "-ctk"), check_kv_type(type_v, "-ctv")
    total = 0
    for il in attention_layers(spec, layers):
        nk, nv = spec.kv_elements_per_token(il)
        total += row_bytes(type_k, nk) + row_bytes(type_v, nv)
    return total


# ---- llama.cpp cells ------------------------------------------------------------

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
    total = _pad(n_ctx, LLAMA_CTX_PAD)
    if kv_unified:
        per_seq, n_stream, cells = total, 1, total
    else:
        per_seq = _pad(total // n_seq, LLAMA_CTX_PAD)
        if per_seq == 0:
            raise UsageError(f"context {n_ctx} is too small for {n_seq} sequences", flag="--ctx")
        total, n_stream, cells = per_seq * n_seq, n_seq, per_seq
    cells_swa = cells
    if spec is not None and spec.has_swa and not swa_full:
        window = spec.sliding_window * (n_seq if kv_unified else 1) + n_ubatch
        cells_swa = _pad(min(cells, window), LLAMA_CTX_PAD)
    return LlamaCells(total, per_seq, n_stream, cells, cells_swa)


def llama_kv_layer_bytes(spec: ModelSpec, il: int, cells: LlamaCells, type_k: str, type_v: str,
                         align: int = 32) -> tuple[int, int]:
    """(K bytes, V bytes) of layer il's cache tensors in llama.cpp (0 for layers without KV)."""
    k_row, v_row, swa = kv_rows(spec, type_k, type_v)[il]
    n = cells.total_swa if swa else cells.total_base
    return _pad(k_row * n, align), _pad(v_row * n, align)


def kv_bytes_from_layer(spec: ModelSpec, start: int, cells: LlamaCells, type_k: str, type_v: str) -> int:
    """llama.cpp KV bytes of layers start..n_layer-1 (cell counts are multiples of 256, so no padding)."""
    from localinfer.backends.llamacpp.placement import spec_cache

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


def kv_rows(spec: ModelSpec, type_k: str, type_v: str) -> tuple[tuple[int, int, bool], ...]:
    """Per layer: (K bytes per cell, V bytes per cell, sliding-window layer?); zeros for layers without KV."""
    from localinfer.backends.llamacpp.placement import spec_cache

    memo = spec_cache(spec)
    key = ("kv_rows", type_k, type_v)
    if key not in memo:
        rows = []
        for il in range(spec.n_layers):
            if spec.n_head_kv[il] == 0:
                rows.append((0, 0, False))
                continue
            nk, nv = spec.kv_elements_per_token(il)
            rows.append((row_bytes(type_k, nk), row_bytes(type_v, nv), bool(spec.swa_layers[il] and spec.sliding_window)))
        memo[key] = tuple(rows)
    return memo[key]


# ---- the public KV function -----------------------------------------------------

def kv_bytes(spec: ModelSpec, n_tokens: int, type_k: str = "f16", type_v: str = "f16", *,
             backend: str = "llama.cpp", n_seq: int = 1, n_ubatch: int = 512, kv_unified: bool = False,
             swa_full: bool = False, layers=None, dtype: str = "f16", group_size: int | None = None,
             block_tokens: int = TORCH_BLOCK_TOKENS) -> int:
    """KV cache bytes for ``n_seq`` sequences of ``n_tokens`` each, as ``backend`` allocates them.

    * ``"llama.cpp"``: the context passed to llama.cpp is ``n_tokens × n_seq``
      (``-c``), rounded as in :func:`llama_cells`; K and V types separate.
    * ``"torch"``: ``ceil(n_tokens / 16)`` blocks of 16 tokens per sequence,
      each token ``row_bytes(type, heads × head_dim)`` per layer (q8_0 34 B and
      q4_0 18 B per 32 values; bf16/f16 2 B).
    * ``"mlx"``: mlx-lm's ``KVCache`` (``type`` f16/bf16/f32) or
      ``QuantizedKVCache`` (``q8_0``/``q4_0`` → 8/4 bits, ``group_size`` by
      default :func:`mlx_quant_group`, a scale and a bias per group in ``dtype``), capacity
      ``ceil(n_tokens / 256) × 256`` (one prefill call, then decode; see
      :func:`mlx_capacity` for other update patterns).
    """
    _check_backend(backend)
    if n_tokens < 0 or n_seq <= 0:
        raise UsageError(f"tokens {n_tokens} and sequences {n_seq} must be non-negative/positive", flag="--ctx")
    if n_tokens == 0:
        return 0
    if backend == "llama.cpp":
        type_k, type_v = check_kv_type(type_k, "-ctk"), check_kv_type(type_v, "-ctv")
        cells = llama_cells(spec, n_tokens * n_seq, n_seq, n_ubatch=n_ubatch, kv_unified=kv_unified,
                            swa_full=swa_full)
        if layers is None:
            return kv_bytes_from_layer(spec, 0, cells, type_k, type_v)
        return sum(sum(llama_kv_layer_bytes(spec, il, cells, type_k, type_v))
                   for il in attention_layers(spec, layers))
    if backend == "torch":
        per_token = kv_bytes_per_token(spec, type_k, type_v, layers=layers)
        return n_seq * _pad(n_tokens, block_tokens) * per_token
    return n_seq * mlx_capacity([n_tokens]) * mlx_bytes_per_token(spec, type_k, type_v, dtype=dtype,
                                                                 group_size=group_size, layers=layers)


def mlx_group_size(head_dim: int) -> int | None:
    """Values per KV scale/bias group for a head of head_dim values: 64, else 32 (None: not quantizable)."""
    for g in MLX_GROUP_SIZES:
        if head_dim % g == 0:
            return g
    return None


def mlx_quant_group(spec: ModelSpec) -> int | None:
    """The group size K and V share in the mlx engine's quantized cache (one per cache), or None."""
    gk, gv = mlx_group_size(spec.head_dim_k), mlx_group_size(spec.head_dim_v)
    return None if gk is None or gv is None else min(gk, gv)


def mlx_bytes_per_token(spec: ModelSpec, type_k: str = "f16", type_v: str = "f16", *, dtype: str = "f16",
                        group_size: int | None = None, layers=None) -> int:
    """Bytes per cached token in mlx-lm: plain dtype, or packed uint32 codes + per-group scale and bias.

    ``group_size`` defaults to :func:`mlx_quant_group` (64, or 32 for heads
    whose size is not a multiple of 64), the group the mlx engine allocates.
    """
    group = mlx_quant_group(spec) if group_size is None else group_size

    def per_head(type_name: str, dim: int, flag: str) -> int:
        t = str(type_name).lower()
        if t in FLOAT_BYTES:
            return dim * FLOAT_BYTES[t]
        if t not in MLX_KV_BITS:
            raise UsageError(f"mlx-lm has no KV type {type_name!r}", flag=flag,
                             hint="use f16, bf16, f32, q8_0 (8 bits) or q4_0 (4 bits)")
        if not group or dim % group:
            raise UsageError(f"heads of {spec.head_dim_k}/{spec.head_dim_v} values cannot be quantized by MLX "
                             f"(groups of {' or '.join(map(str, MLX_GROUP_SIZES))})", flag=flag,
                             hint="use -ctk f16 -ctv f16")
        return dim * MLX_KV_BITS[t] // 8 + 2 * (dim // group) * FLOAT_BYTES[dtype]

    total = 0
    for il in attention_layers(spec, layers):
        h = spec.n_head_kv[il]
        total += h * (per_head(type_k, spec.head_dim_k, "-ctk") + per_head(type_v, spec.head_dim_v, "-ctv"))
    return total


def mlx_capacity(updates: list[int], step: int = MLX_STEP) -> int:
    """Cells an mlx-lm cache holds after a sequence of ``update_and_fetch`` calls of these sizes.

    The cache grows by ``ceil(n / step) × step`` when an update overflows it; if
    the filled length is not a multiple of ``step`` it is first cut to that length.
    """
    cap = filled = 0
    for n in updates:
        if n <= 0:
            continue
        if cap == 0 or filled + n > cap:
            grow = _pad(n, step)
            cap = (filled if cap and filled % step else cap) + grow
        filled += n
    return cap


# ---- requests, reservations, prefixes, pages -------------------------------------

def tokens_held(n_input: int, n_output: int) -> int:
    """Tokens a finished request keeps in KV: input + output − 1 (the last token is never written back)."""
    if n_input < 0 or n_output < 0:
        raise UsageError("input and output lengths must be non-negative", flag="--ctx")
    return n_input + max(n_output - 1, 0)


def blocks_for(n_tokens: int, block_tokens: int = TORCH_BLOCK_TOKENS) -> int:
    """Paged-KV blocks for n_tokens: ⌈L / p⌉."""
    return -(-n_tokens // block_tokens)


@dataclass(frozen=True)
class PageUsage:
    block_tokens: int
    blocks: int            # block-table entries = physical blocks without sharing
    slots: int             # token slots reserved
    used: int              # token slots holding tokens
    physical_blocks: int   # after sharing common prefix blocks

    @property
    def unused(self) -> int:
        return self.slots - self.used


def page_usage(lengths: list[int], block_tokens: int, shared_prefix: int = 0, sharing: list[int] | None = None
               ) -> PageUsage:
    """Blocks, slots and waste when sequences of these lengths are paged in blocks of ``block_tokens``.

    ``shared_prefix`` tokens are common to the sequences listed in ``sharing``
    (indices; all by default); only its whole blocks are shared.
    """
    if block_tokens <= 0:
        raise UsageError("block size must be positive", flag="--block")
    blocks = sum(blocks_for(n, block_tokens) for n in lengths)
    share = list(range(len(lengths))) if sharing is None else sharing
    shared_blocks = min(shared_prefix, *(lengths[i] for i in share)) // block_tokens if share else 0
    saved = shared_blocks * max(len(share) - 1, 0)
    return PageUsage(block_tokens, blocks, blocks * block_tokens, sum(lengths), blocks - saved)


@dataclass(frozen=True)
class SharedPrefixKV:
    prefix_bytes: int        # the common prefix's whole blocks, stored once
    private_bytes: int       # per sequence, its own blocks
    n_seq: int

    @property
    def total(self) -> int:
        return self.prefix_bytes + self.n_seq * self.private_bytes

    def max_sequences(self, budget_bytes: int) -> int:
        """How many sequences fit in budget_bytes next to one copy of the prefix."""
        if self.private_bytes <= 0:
            return 0
        return max(0, (budget_bytes - self.prefix_bytes) // self.private_bytes)


def shared_prefix_kv(spec: ModelSpec, prefix_tokens: int, tokens_per_seq: int, n_seq: int = 1,
                     type_k: str = "f16", type_v: str = "f16", *,
                     block_tokens: int = TORCH_BLOCK_TOKENS) -> SharedPrefixKV:
    """KV with a common prefix stored once (whole blocks) and the rest per sequence (paged).

    16 Qwen3-8B requests of 8447 tokens sharing 6144: 864 + 16 × 324 = 6048 MiB.
    """
    if not 0 <= prefix_tokens <= tokens_per_seq:
        raise UsageError(f"shared prefix {prefix_tokens} must be between 0 and the request length "
                         f"{tokens_per_seq}", flag="--shared-prefix")
    per_token = kv_bytes_per_token(spec, type_k, type_v)
    shared = prefix_tokens // block_tokens * block_tokens
    private = _pad(tokens_per_seq - shared, block_tokens)
    return SharedPrefixKV(shared * per_token, private * per_token, n_seq)


def max_sequences(budget_bytes: int, bytes_per_seq: int, fixed_bytes: int = 0) -> int:
    """⌊(budget − fixed) / per-sequence⌋, never negative: 12 GiB / 324 MiB → 37."""
    if bytes_per_seq <= 0:
        raise ValueError("bytes_per_seq must be positive")
    return max(0, (budget_bytes - fixed_bytes) // bytes_per_seq)


# ---- output buffer and weights read per token ------------------------------------

def output_bytes(spec: ModelSpec, n_seq: int = 1, n_outputs: int = 0) -> int:
    """llama.cpp's host output buffer: float32 logits for max(n_seq, n_outputs) rows of the vocabulary.

    It is reserved for n_seq rows at context creation and grows when a batch
    asks for more logits (e.g. speculative verification of k drafts asks k + 1).
    """
    return spec.vocab_size * max(n_seq, n_outputs) * LOGIT_BYTES


def decode_weight_bytes(spec: ModelSpec, *, active_experts_only: bool = True) -> int:
    """Weight bytes read per decode step: every tensor but the embedding lookup table.

    With tied embeddings the table is also the output projection, so it is read.
    MoE: only the routed experts' share of expert tensors (n_used / n_expert).
    """
    total = 0
    for t in spec.tensors:
        if t.name == "token_embd.weight" and not spec.tied_embeddings:
            continue
        if active_experts_only and spec.n_expert and "_exps." in t.name:
            total += t.n_bytes * spec.n_expert_used // spec.n_expert
        else:
            total += t.n_bytes
    return total


# ---- weights resident in the torch and mlx backends ------------------------------

WEIGHT_DTYPE_BYTES = {"f32": 4, "float32": 4, "fp32": 4, "bf16": 2, "bfloat16": 2, "f16": 2, "float16": 2, "fp16": 2}
TORCH_PACKED = ("Q8_0", "Q4_0")      # kept as GGUF blocks with packed=True (same bytes as in the file)
# llamacpp_rounding keeps these matrices as float32 codes plus float32 per-block scales (and q4_1 mins) ...
TORCH_BLOCK_CODES = {"Q8_0": 1, "Q4_0": 1, "Q4_1": 2}
TORCH_MINS = ("Q5_1",)               # ... and adds per-block mins [rows, ne0 / 32] in the dtype to these
QUANT_GROUP = 32                     # values per q4_x/q8_0 block = per MLX affine group
MLX_AFFINE = {"Q4_0": 16, "Q4_1": 16, "Q8_0": 32}   # code bytes per group
NOT_RESIDENT = ("rope_freqs.weight",)   # folded into RoPE frequencies by both engines, not a weight


@dataclass(frozen=True)
class ResidentWeights:
    """Weight bytes a torch/mlx engine holds after loading, where, in what dtype, and the formula."""

    bytes: int
    runs_on: str        # "cuda", "metal" or "cpu": where the engine computes on a device of that kind
    dtype: str          # compute dtype the dequantized tensors take
    formula: str
    note: str | None = None   # set when the engine cannot use the device itself


def check_weight_dtype(dtype: str | None, flag: str = "--dtype") -> str | None:
    """Normalise a weight dtype name (None: the backend's default); UsageError naming the flag."""
    if dtype is None:
        return None
    t = str(dtype).strip().lower()
    if t not in WEIGHT_DTYPE_BYTES:
        raise UsageError(f"{flag}: unknown weight dtype {dtype!r}", flag=flag, hint="use f32, bf16 or f16")
    return t


def backend_device(backend: str, kind: str) -> tuple[str, str | None]:
    """Where ``backend`` computes on a device of ``kind`` ("cuda" | "metal" | "cpu"), and why when not there.

    torch: CUDA or the CPU; it has no Metal (mps) path, so on a Mac it runs on
    the CPU (the same unified memory).  mlx: Metal or the CPU; MLX's CUDA build
    is not supported by localinfer's mlx backend, which then runs on the host CPU.
    """
    _check_backend(backend)
    if backend == "torch" and kind == "metal":
        return "cpu", "the torch backend has no Metal (mps) path: it runs on the CPU, in the same unified memory"
    if backend == "mlx" and kind == "cuda":
        return "cpu", ("the mlx backend does not use CUDA GPUs (MLX's CUDA build is not supported by "
                       "localinfer's mlx backend): it runs on the host CPU")
    return kind, None


def default_weight_dtype(spec: ModelSpec, backend: str, runs_on: str) -> str:
    """The engines' default compute dtype: torch bf16 on CUDA; mlx f16 on Metal (bf16 for
    files with BF16 tensors); float32 on the CPU for both."""
    if runs_on == "cpu":
        return "f32"
    if backend == "mlx":
        return "bf16" if any(t.type.name == "BF16" for t in spec.tensors) else "f16"
    return "bf16"


def torch_weight_bytes(spec: ModelSpec, dtype: str = "f32", *, packed: bool = False,
                       llamacpp_rounding: bool = False) -> int:
    """Bytes of cuda_backend's loaded tensors: norms (1-D, biases excepted) float32, the rest n × dtype;
    with ``packed`` q8_0/q4_0 matrices keep their GGUF bytes; with ``llamacpp_rounding``
    q8_0/q4_0/q4_1 matrices are float32 codes + float32 block scales (+ mins) and q5_1 ones add
    block mins.  rope_freqs is folded into the RoPE tables, not kept."""
    size = WEIGHT_DTYPE_BYTES[check_weight_dtype(dtype)]
    total = 0
    for t in spec.tensors:
        kind = t.type.name
        if t.name in NOT_RESIDENT:
            continue
        if len(t.shape) == 1 and not t.name.endswith(".bias"):
            total += t.n_elements * 4
        elif llamacpp_rounding and kind in TORCH_BLOCK_CODES and len(t.shape) == 2:
            total += t.n_elements * 4 + t.n_elements // QUANT_GROUP * 4 * TORCH_BLOCK_CODES[kind]
        elif packed and kind in TORCH_PACKED and len(t.shape) == 2:
            total += t.n_bytes
        else:
            total += t.n_elements * size
        if llamacpp_rounding and kind in TORCH_MINS and len(t.shape) == 2:
            total += t.n_elements // QUANT_GROUP * size
    return total


def mlx_weight_bytes(spec: ModelSpec, dtype: str = "f16") -> int:
    """Bytes of the mlx backend's parameters: Q4_0/Q4_1/Q8_0 matrices as affine groups of 32
    (codes + scale + bias in dtype), every other tensor dequantized to n × dtype (rope_freqs
    becomes RoPE frequencies, not a parameter)."""
    size = WEIGHT_DTYPE_BYTES[check_weight_dtype(dtype)]
    total = 0
    for t in spec.tensors:
        if t.name in NOT_RESIDENT:
            continue
        code = MLX_AFFINE.get(t.type.name)
        if code is not None and len(t.shape) > 1:
            total += t.n_elements // QUANT_GROUP * (code + 2 * size)
        else:
            total += t.n_elements * size
    return total


def resident_weights(spec: ModelSpec, backend: str, kind: str, dtype: str | None = None, *,
                     packed: bool = False) -> ResidentWeights:
    """Weights the torch or mlx engine holds on a device of ``kind`` (see :func:`backend_device`).

    ``dtype`` None takes the engine's default for where it runs.  SmolLM2-135M
    Q4_1 (96,576,768 B in the file): mlx 98,275,968 B on Metal, 115,156,224 B on the CPU.
    """
    if backend not in ("torch", "mlx"):
        raise UsageError(f"resident weights are modelled for torch and mlx, not {backend!r}", flag="--backend")
    runs_on, note = backend_device(backend, kind)
    dt = check_weight_dtype(dtype) or default_weight_dtype(spec, backend, runs_on)
    size = WEIGHT_DTYPE_BYTES[dt]
    where = f"{backend} on {runs_on}, {dt}"
    if backend == "torch":
        total = torch_weight_bytes(spec, dt, packed=packed)
        formula = (f"{where}: Σ tensors n × {size} B (dequantized at load), norms n × 4 B (float32)"
                   + (", q8_0/q4_0 matrices their GGUF bytes (packed)" if packed else ""))
    else:
        total = mlx_weight_bytes(spec, dt)
        formula = (f"{where}: Q4_0/Q4_1 n/32 × (16 + 2·{size}) B, Q8_0 n/32 × (32 + 2·{size}) B "
                   f"(affine groups of 32, scale and bias in {dt}); other tensors n × {size} B (dequantized)")
    if spec.tied_embeddings:
        formula += "; tied output: token_embd counted once"
    return ResidentWeights(total, runs_on, dt, formula, note)


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


@dataclass(frozen=True)
class MemoryBreakdown:
    """Every term of a plan's memory, split by pool.  On unified memory both pools are one."""

    terms: tuple[Term, ...]
    unified: bool
    notes: tuple[str, ...] = field(default=())

    def sum(self, key: str | None = None, pool: str | None = None) -> int:
        return sum(t.bytes for t in self.terms
                   if (key is None or t.key == key) and (pool is None or t.pool == pool))

    @property
    def weights(self) -> int:
        return self.sum("weights")

    @property
    def kv(self) -> int:
        return self.sum("kv")

    @property
    def output(self) -> int:
        return self.sum("output")

    @property
    def compute(self) -> int:
        return self.sum("compute")

    @property
    def device_bytes(self) -> int:
        """What the accelerator (or, on unified memory, the whole machine) must hold."""
        return self.total if self.unified else self.sum(pool="device")

    @property
    def host_bytes(self) -> int:
        return 0 if self.unified else self.sum(pool="host")

    @property
    def total(self) -> int:
        return self.sum()

    def to_dict(self) -> dict:
        return {
            "unified": self.unified,
            "weights": self.weights, "kv": self.kv, "output": self.output, "compute": self.compute,
            "device_bytes": self.device_bytes, "host_bytes": self.host_bytes, "total": self.total,
            "terms": [t.__dict__ for t in self.terms], "notes": list(self.notes),
        }
