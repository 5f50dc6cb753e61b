"""The torch engine's memory: its paged KV cache and the tensors it holds after loading (no torch import here).

KV: blocks of ``TORCH_BLOCK_TOKENS`` tokens per sequence — the serving engine's
block size, ``localinfer.model.kv.DEFAULT_BLOCK_TOKENS`` (16), one number in one
place —, each token ``row_bytes(type, heads ×
head_dim)`` per layer in GGUF's block layout (q8_0 34 B and q4_0 18 B per 32
values; bf16/f16 2 B).  Weights: dequantized at load to the compute dtype, norms
float32; ``packed`` keeps q8_0/q4_0 matrices as their GGUF blocks.

The serving executor (``cuda_backend/paged_executor.py``) holds the same bytes
as one pool per layer of ``num_blocks`` blocks: a block of p tokens over every
layer is ``p · Σ_layers n_head_kv · (K + V row bytes)`` (nano-vllm's
``2 · layers · p · kv_heads · head_dim · itemsize`` for float types).  On CUDA
it captures decode steps in graphs at the batch sizes of :func:`graph_batches`
(powers of two below the slots, then the slot count itself, at most
``CUDA_GRAPH_MAX_BATCH``; a step pads to the next) and the table widths of
:func:`graph_widths`, counted by :func:`torch_graph_bytes` — the executor and
``fit`` call the same function, so fit counts exactly the graphs captured.
"""

from __future__ import annotations

from dataclasses import replace

from localinfer.backends.memory import (
    NOT_RESIDENT,
    QUANT_GROUP,
    WEIGHT_DTYPE_BYTES,
    OwnTensorsMemory,
    ResidentWeights,
    refusal,
    Term,
    check_tokens,
    check_weight_dtype,
)
from localinfer.model.kv import DEFAULT_BLOCK_TOKENS, kv_bytes_per_token, row_bytes
from localinfer.model.spec import ModelSpec
from localinfer.units import ceil_div, pad_to

TORCH_BLOCK_TOKENS = DEFAULT_BLOCK_TOKENS   # the torch engine's paged-KV block: the serving engine's
TORCH_PACKED = ("Q8_0", "Q4_0")      # kept as GGUF blocks with packed=True (same bytes as in the file)
# llamacpp_rounding keeps these matrices as float32 codes plus float32 per-block scales (and q4_1 mins) ...
TORCH_BLOCK_CODES = {"Q8_0": 1, "Q4_0": 1, "Q4_1": 2}
TORCH_MINS = ("Q5_1",)               # ... and adds per-block mins [rows, ne0 / 32] in the dtype to these


def torch_kv_bytes(spec: ModelSpec, n_tokens: int, type_k: str = "f16", type_v: str = "f16", *, n_seq: int = 1,
                   layers=None, block_tokens: int = TORCH_BLOCK_TOKENS, **_ignored) -> int:
    """``n_seq × pad(n_tokens, p) × bytes per token`` (p = ``block_tokens``, 16)."""
    check_tokens(n_tokens, n_seq)
    if n_tokens == 0:
        return 0
    return n_seq * pad_to(n_tokens, block_tokens) * kv_bytes_per_token(spec, type_k, type_v, layers=layers)


CUDA_GRAPH_MAX_BATCH = 512   # largest decode batch captured in a CUDA graph (nano-vllm's cap); larger steps run eagerly
LOGITS_BYTES = 4                           # logits are float32


def torch_block_bytes(spec: ModelSpec, type_k: str = "f16", type_v: str = "f16",
                      block_tokens: int = TORCH_BLOCK_TOKENS) -> int:
    """One paged-KV block over every layer: ``p × Σ_layers n_head_kv × (K + V row bytes)``."""
    return block_tokens * kv_bytes_per_token(spec, type_k, type_v)


def torch_pool_blocks(n_ctx: int, n_seq: int = 1, block_tokens: int = TORCH_BLOCK_TOKENS) -> int:
    """Blocks of the pool for a plan of n_seq sequences of n_ctx tokens: ``n_seq × ⌈n_ctx / p⌉``, so the
    pool's bytes equal :func:`torch_kv_bytes` for the same plan."""
    check_tokens(n_ctx, n_seq)
    return n_seq * ceil_div(n_ctx, block_tokens)


def torch_budget_blocks(spec: ModelSpec, budget_bytes: int, type_k: str = "f16", type_v: str = "f16",
                        block_tokens: int = TORCH_BLOCK_TOKENS) -> int:
    """Blocks that ``budget_bytes`` (memory left after weights and graphs) hold: ``⌊budget / block bytes⌋``."""
    return max(0, int(budget_bytes)) // torch_block_bytes(spec, type_k, type_v, block_tokens)


def graph_batches(n_slots: int) -> tuple[int, ...]:
    """Captured decode batch sizes for n_slots sequences: the powers of two below n_slots, then n_slots itself
    (a step never holds more decodes than slots, so none pads past it), capped at ``CUDA_GRAPH_MAX_BATCH``:
    1, 2, 4, …, 32, 64 for 64 slots; 1, 2, 4, 5 for 5; 1, 2, …, 32, 48 for 48."""
    top = max(1, min(int(n_slots), CUDA_GRAPH_MAX_BATCH))
    out, b = [], 1
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)


GRAPH_WIDTH_SPLITS = 4   # per batch size, graphs for block tables of the full width, 1/2, 1/4 and 1/8 of it


def graph_widths(max_blocks: int) -> tuple[int, ...]:
    """Block-table widths captured per batch size: ``⌈m / 2^k⌉`` for k < GRAPH_WIDTH_SPLITS, so a decode
    step attends at most twice the keys its longest request holds (or m / 8), not always m."""
    return tuple(sorted({-(-max_blocks // (1 << k)) for k in range(GRAPH_WIDTH_SPLITS)}))


def torch_graph_bytes(spec: ModelSpec, n_ctx: int, n_seq: int = 1, dtype: str = "bf16", type_k: str = "f16",
                      type_v: str = "f16", *, packed: bool = False, block_tokens: int = TORCH_BLOCK_TOKENS) -> int:
    """Memory of the decode graphs (an estimate; the CUDA test measures it): one private pool that every
    captured batch size shares (captured largest first), holding the largest batch B's live tensors at its
    peak layer, plus one scratch block that padded rows write to:

        B × s × (2·E + (H + 2·H_kv)·d + 3·F + 2·H_kv·L·d + 2·H·L) + B × V × s  [+ B·L mask bytes]
        + Σ_graphs b × V × 4   (each graph's float32 logits stay allocated: every batch size × table width)
        + the largest matrix n × s when q8_0/q4_0 matrices are dequantized per call (packed)
        + one KV block

    with s the compute dtype's bytes, L = ⌈n_ctx / p⌉·p the keys a row attends, E/F/V the embedding, FFN
    and vocabulary sizes, H/H_kv/d the heads, KV heads and head size; quantized K/V add their raw gather.
    """
    B = graph_batches(n_seq)[-1]
    s = WEIGHT_DTYPE_BYTES[check_weight_dtype(dtype) or "bf16"]
    E, F, V = spec.n_embd, max(spec.n_ff), spec.vocab_size
    H, Hkv, d = max(spec.n_head), max(spec.n_head_kv), spec.head_dim_k
    L = pad_to(max(n_ctx, 1), block_tokens)
    per_row = s * (2 * E + (H + 2 * Hkv) * d + 3 * F + 2 * Hkv * L * d + 2 * H * L) + L
    raw = sum(0 if t in ("f32", "f16", "bf16") else Hkv * L * row_bytes(t, d) for t in (type_k, type_v))
    widths = len(graph_widths(ceil_div(L, block_tokens)))
    total = B * (per_row + raw) + B * V * s + widths * sum(graph_batches(n_seq)) * V * LOGITS_BYTES
    if packed:
        total += max((t.n_elements for t in spec.tensors if len(t.shape) == 2 and t.type.name in TORCH_PACKED),
                     default=0) * s
    return total + torch_block_bytes(spec, type_k, type_v, block_tokens)


def default_dtype(spec: ModelSpec, runs_on: str) -> str:
    """bf16 on CUDA, float32 on the CPU."""
    return "f32" if runs_on == "cpu" else "bf16"


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


class TorchMemory(OwnTensorsMemory):
    """The memory model the registry hands out for ``torch``."""

    name = "torch"
    blocks = f"{TORCH_BLOCK_TOKENS}-token blocks"
    default_dtype = staticmethod(default_dtype)

    def refuses(self, spec: ModelSpec) -> str | None:
        """Why the torch engine cannot run ``spec`` (cuda_backend.support's checks), or None."""
        from cuda_backend.support import check_model

        return refusal(check_model, spec)

    def runs_on(self, kind: str) -> tuple[str, str | None]:
        """CUDA or the CPU: there is no Metal (mps) path, so on a Mac it runs on the CPU (same unified memory)."""
        if kind == "metal":
            return "cpu", "the torch backend has no Metal (mps) path: it runs on the CPU, in the same unified memory"
        return kind, None

    def resident_weights(self, spec: ModelSpec, kind: str, dtype: str | None = None, *, packed: bool = False
                         ) -> ResidentWeights:
        runs_on, note, dt, size = self.placement(spec, kind, dtype)
        formula = (f"torch on {runs_on}, {dt}: Σ tensors n × {size} B (dequantized at load), norms n × 4 B (float32)"
                   + (", q8_0/q4_0 matrices their GGUF bytes (packed)" if packed else ""))
        if spec.tied_embeddings:
            formula += "; tied output: token_embd counted once"
        return ResidentWeights(torch_weight_bytes(spec, dt, packed=packed), runs_on, dt, formula, note)

    def breakdown(self, spec, device, req):
        """Weights and the KV pool; on CUDA also the decode graphs (:func:`torch_graph_bytes`), whose rows attend
        the most positions one sequence may hold: ``n_ctx`` per sequence, or the whole context when the plan
        shares one (``n_ctx_total``: ``run``/``serve``'s check, where ``serving.open_plan`` lets one request
        hold all of it)."""
        bd, geometry = super().breakdown(spec, device, req)
        rw = self.resident_weights(spec, device.kind, req.dtype, packed=req.packed)
        if rw.runs_on != "cuda":
            return bd, geometry
        pool = bd.terms[0].pool
        sizes, p = graph_batches(req.n_seq), TORCH_BLOCK_TOKENS
        keys = req.n_ctx_total or req.n_ctx
        graphs = torch_graph_bytes(spec, keys, req.n_seq, rw.dtype, req.type_k, req.type_v, packed=req.packed)
        term = Term("compute", f"CUDA graphs (decode, batch {'/'.join(map(str, sizes))})", graphs, pool,
                    f"one graph pool: batch {sizes[-1]} × activations over ⌈ctx/{p}⌉·{p} keys + every graph's "
                    "logits, + 1 scratch KV block (estimate)", None)
        return replace(bd, terms=bd.terms + (term,)), geometry

    def kv_bytes(self, spec, n_tokens, type_k="f16", type_v="f16", **options) -> int:
        return torch_kv_bytes(spec, n_tokens, type_k, type_v, **options)

    def load_request(self, plan) -> dict:
        return {"dtype": plan.dtype, "packed": bool(plan.options.get("packed"))}

    def probes_cuda(self, plan) -> bool:
        return not self._cpu_asked(plan)

    def computes_on_cpu(self, plan, kind: str) -> bool:
        return self._cpu_asked(plan) or self.runs_on(kind)[0] == "cpu"

    @staticmethod
    def _cpu_asked(plan) -> bool:
        return (plan.device or "").lower() == "cpu" or plan.n_gpu_layers == 0


MEMORY = TorchMemory()
