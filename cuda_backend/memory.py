"""The torch engine's memory: its paged KV cache and the tensors it holds after loading (no torch import here).

KV: blocks of 16 tokens per sequence, each token ``row_bytes(type, heads ×
head_dim)`` per layer in GGUF's block layout (q8_0 34 B and q4_0 18 B per 32
values; bf16/f16 2 B).  Weights: dequantized at load to the compute dtype, norms
float32; ``packed`` keeps q8_0/q4_0 matrices as their GGUF blocks.
"""

from __future__ import annotations

from localinfer.backends.memory import (
    NOT_RESIDENT,
    QUANT_GROUP,
    WEIGHT_DTYPE_BYTES,
    OwnTensorsMemory,
    ResidentWeights,
    check_tokens,
    check_weight_dtype,
)
from localinfer.model.kv import kv_bytes_per_token
from localinfer.model.spec import ModelSpec
from localinfer.units import pad_to

TORCH_BLOCK_TOKENS = 16              # the torch engine's paged-KV block
TORCH_PACKED = ("Q8_0", "Q4_0")      # kept as GGUF blocks with packed=True (same bytes as in the file)
# llamacpp_rounding keeps these matrices as float32 codes plus float32 per-block scales (and q4_1 mins) ...
TORCH_BLOCK_CODES = {"Q8_0": 1, "Q4_0": 1, "Q4_1": 2}
TORCH_MINS = ("Q5_1",)               # ... and adds per-block mins [rows, ne0 / 32] in the dtype to these


def torch_kv_bytes(spec: ModelSpec, n_tokens: int, type_k: str = "f16", type_v: str = "f16", *, n_seq: int = 1,
                   layers=None, block_tokens: int = TORCH_BLOCK_TOKENS, **_ignored) -> int:
    """``n_seq × pad(n_tokens, 16) × bytes per token``."""
    check_tokens(n_tokens, n_seq)
    if n_tokens == 0:
        return 0
    return n_seq * pad_to(n_tokens, block_tokens) * kv_bytes_per_token(spec, type_k, type_v, layers=layers)


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
    blocks = "16-token blocks"

    def runs_on(self, kind: str) -> tuple[str, str | None]:
        """CUDA or the CPU: there is no Metal (mps) path, so on a Mac it runs on the CPU (same unified memory)."""
        if kind == "metal":
            return "cpu", "the torch backend has no Metal (mps) path: it runs on the CPU, in the same unified memory"
        return kind, None

    def resident_weights(self, spec: ModelSpec, kind: str, dtype: str | None = None, *, packed: bool = False
                         ) -> ResidentWeights:
        runs_on, note = self.runs_on(kind)
        dt = check_weight_dtype(dtype) or default_dtype(spec, runs_on)
        size = WEIGHT_DTYPE_BYTES[dt]
        formula = (f"torch on {runs_on}, {dt}: Σ tensors n × {size} B (dequantized at load), norms n × 4 B (float32)"
                   + (", q8_0/q4_0 matrices their GGUF bytes (packed)" if packed else ""))
        if spec.tied_embeddings:
            formula += "; tied output: token_embd counted once"
        return ResidentWeights(torch_weight_bytes(spec, dt, packed=packed), runs_on, dt, formula, note)

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
