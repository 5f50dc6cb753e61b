"""Batch scaling through the step engine: ``localinfer bench --batch-sizes 1,2,4,8``.

For each prompt depth d and batch b, b greedy requests of d tokens each
(different windows of one text, prefix cache off) run together through
:func:`~localinfer.serve.batch.run_batch` on one llama.cpp context, ignoring
end-of-generation so each yields exactly ``gen`` tokens.  The first step
prefills every prompt and yields each first token; the ``gen - 1`` steps after it
decode one token per request.  A thin recorder around the executor keeps every
step's chunks (so the bytes the model says it read, D_w(b) + Σ L_i·k per step,
docs/speed.md, are summed over the steps actually taken) and the time inside it
(the rest of a step is the engine's overhead).  Figures and schema:
:func:`localinfer.generation.bench.batch_row`.

One executor serves every (b, d): ``max(batches)`` slots, each with its own KV
stream (``kv_unified=False``, where llama.cpp computes every row as alone).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from localinfer.backends.engine import LoadPlan
from localinfer.backends.executor import ExecutorWrapper
from localinfer.generation.bench import batch_row, batch_section, prompt_of
from localinfer.generation.sampling import SamplingParams
from localinfer.plan.paging import DEFAULT_BLOCK_TOKENS, blocks_for
from localinfer.serve.batch import run_batch

GREEDY = SamplingParams(temperature=0.0)


def batch_plan(plan: LoadPlan, batches: Sequence[int], depths: Sequence[int], gen: int) -> LoadPlan:
    """``plan`` widened to ``max(batches)`` slots, each holding the deepest prompt + ``gen`` (256-cell pages)."""
    need = max(max(depths), 1) + gen
    from localinfer.backends.llamacpp.memory import LLAMA_CTX_PAD
    from localinfer.units import pad_to

    slot = pad_to(blocks_for(need) * DEFAULT_BLOCK_TOKENS, LLAMA_CTX_PAD)
    n = max(batches)
    return plan.with_(n_seq=n, n_ctx=n * slot, options={**plan.options, "kv_unified": False, "quiet": True})


class _Recorder(ExecutorWrapper):
    """An executor that also keeps, per step, (seconds inside, ((start, new tokens), ...))."""

    def __init__(self, inner):
        super().__init__(inner)
        self.steps: list[tuple[float, tuple[tuple[int, int], ...]]] = []

    def step(self, chunks):
        t0 = time.perf_counter()
        rows = self.inner.step(chunks)
        self.steps.append((time.perf_counter() - t0, tuple((c.start, len(c.tokens)) for c in chunks)))
        return rows


def measure_batch(executor, cost, kv: str, batch: int, depth: int, gen: int, *,
                  peak_bandwidth: float | None = None) -> dict:
    """One row: ``batch`` requests of a ``depth``-token prompt, ``gen`` tokens each, through the engine."""
    vocab = executor.engine
    n = max(depth, 1)
    text = prompt_of(vocab, n + batch)
    prompts = [text[i:i + n] for i in range(batch)]
    rec = _Recorder(executor)
    out = run_batch(rec, vocab, prompts, GREEDY, max_tokens=gen, parallel=batch, ignore_eos=True,
                    prefix_cache=False)
    first = max(r.token_times[0] for r in out)            # every prompt prefilled
    last = max(r.token_times[-1] for r in out)
    prefill_at = max(i for i, (_, chunks) in enumerate(rec.steps) if any(s < n for s, _ in chunks))
    decode = rec.steps[prefill_at + 1:]
    rates = [(len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0])
             for r in out if r.token_times[-1] > r.token_times[0]]
    return batch_row(cost, kv, batch=batch, depth=depth, tokens=sum(len(r.tokens) for r in out),
                     decode_steps=[[s + 1 for s, _ in chunks] for _, chunks in decode],
                     prefill_s=first - out[0].start_s, decode_s=last - first,
                     executor_s=sum(t for t, _ in decode),
                     request_tok_s=sum(rates) / len(rates) if rates else None, peak_bandwidth=peak_bandwidth)


def measure_batch_scaling(executor, cost, kv: str, batches: Sequence[int], depths: Sequence[int], gen: int, *,
                          repeats: int = 1, peak_bandwidth: float | None = None, progress=None) -> dict:
    """The ``batch_scaling`` section: every depth × batch, after one warm-up batch.

    Each row is the best tok/s of ``repeats`` runs, taken round-robin over the
    batch sizes (b = 1, 2, 4, ..., then again), so that load from other
    processes falls on every batch size alike.
    """
    batches = tuple(dict.fromkeys(batches))
    if gen < 2:
        raise ValueError(f"batch scaling needs at least 2 tokens per request (a decode step), got {gen}")
    if max(batches) > executor.n_slots:
        raise ValueError(f"batch {max(batches)} exceeds the executor's {executor.n_slots} slots")
    measure_batch(executor, cost, kv, max(batches), 1, 2)         # warm up every slot's graph
    rows = []
    for depth in depths:
        best: dict[int, dict] = {}
        for rep in range(repeats):
            for b in batches:
                row = measure_batch(executor, cost, kv, b, depth, gen, peak_bandwidth=peak_bandwidth)
                if b not in best or (row["tok_s"] or 0) > (best[b]["tok_s"] or 0):
                    best[b] = row
                if progress and rep == repeats - 1:
                    progress.step(f"batch {b} @{depth}")
        rows += [best[b] for b in batches]
    flash = getattr(getattr(executor.engine, "plan", None), "flash_attn", None)
    return batch_section(cost, rows, kv=kv, flash_attn=flash, kv_unified=executor.unified, gen_tokens=gen)


def run_batch_scaling(plan: LoadPlan, cost, kv: str, batches: Sequence[int], depths: Sequence[int], gen: int,
                      **kw) -> dict:
    """Open a llama.cpp executor for ``batch_plan(plan, ...)`` and measure (see :func:`measure_batch_scaling`)."""
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor(batch_plan(plan, batches, depths, gen)) as ex:
        return measure_batch_scaling(ex, cost, kv, batches, depths, gen, **kw)
