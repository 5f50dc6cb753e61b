"""The memory of serve's second context for lone prompts (aside.py), as fit counts it.

``serve`` computes a lone prompt beside running sequences in a second context of the same model: one sequence,
``n_batch`` cells of KV, a compute buffer for ``n_ubatch`` tokens and one logits row, an output buffer of one row.
The executor makes it only where its cache is one the mask scan costs and a copy can enter (aside.for_executor);
:func:`aside_request` says the same from the header and the request, and :func:`aside_terms` prices that context as
llama.cpp allocates it (the memory model's own rules, applied to its request), under the key ``aside``.  The two
agree on every architecture family's tiny model (tests/backends/test_aside_conditions.py), M-RoPE read from the
rope sections where llama.cpp reads it so.  One case differs: a llama.cpp built without the GPU backend of a device
fit plans for computes on the CPU and makes the context fit did not count.
"""

from __future__ import annotations

from dataclasses import replace

from localinfer.backends.memory import FitRequest, Term
from localinfer.model.spec import ModelSpec

FA_TILE_ROWS = 64     # ggml-cpu's GGML_FA_TILE_Q: ubatches of at least this many rows use the tiled kernel
# llama_model_rope_type's M-RoPE and interleaved M-RoPE architectures: their cells carry an extension the executor
# neither compacts nor copies aside (llama-model.cpp)
MROPE_ARCHS = frozenset({"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen4exp",
                         "qwen3tts"})
# ... and those whose rope type is M-RoPE only when the file carries rope sections (hparams.use_mrope(): the first
# two set; a VL file of the family has them, its text-only files not), and dflash drafts (any section set)
MROPE_IF_SECTIONS = frozenset({"glm4", "glm4moe", "hunyuan_vl", "bailingmoe3"})


def mrope_cells(spec: ModelSpec) -> bool:
    """Whether llama.cpp gives this model's cells M-RoPE positions (llama_model_rope_type), from the header."""
    s = spec.rope_sections + (0,) * 4
    return (spec.arch in MROPE_ARCHS or (spec.arch in MROPE_IF_SECTIONS and s[0] > 0 and s[1] > 0)
            or (spec.arch == "dflash" and any(s)))


def aside_request(spec: ModelSpec, req: FitRequest, kind: str) -> FitRequest | None:
    """The second context's request when ``req`` asks for it (``prefill_aside``) and the executor would make it:
    computed on the CPU, flash attention with ubatches of the tiled kernel's rows, one unified cache of an
    attention-only model with no sliding-window or M-RoPE cells; else None."""
    on_cpu = kind == "cpu" or req.n_gpu_layers == 0
    if not (req.prefill_aside and on_cpu and req.flash_attn_on and req.kv_unified
            and min(req.n_ubatch, req.n_batch) >= FA_TILE_ROWS
            and not spec.has_recurrent and not spec.has_swa and not mrope_cells(spec)):
        return None
    cells = min(req.n_batch, req.llama_n_ctx)        # no prompt is longer than a slot (one unified cache: all cells)
    return replace(req, n_ctx=cells, n_seq=1, n_ctx_total=cells, n_outputs_max=1, prefill_aside=False)


def aside_terms(spec: ModelSpec, device, req: FitRequest, breakdown) -> list[Term]:
    """The second context's KV, compute and output terms (key ``aside``), priced by ``breakdown`` (the memory
    model's) on its request; none when it is not made."""
    one = aside_request(spec, req, device.kind)
    if one is None:
        return []
    sub, _ = breakdown(spec, device, one)
    return [replace(t, key="aside", label=f"{t.label}, lone prompts' context",
                    formula=f"{t.formula} (a second context: 1 sequence, {one.n_ctx} cells, 1 logits row; "
                            "LOCALINFER_PREFILL_ASIDE=0 leaves it out)",
                    buffer=None if t.buffer is None else f"{t.buffer} (aside)")
            for t in sub.terms if t.key in ("kv", "compute", "output")]
