"""How the server schedules (:class:`ServeConfig`) and the engine it builds over an executor.

The KV pool is the executor's cells in blocks of ``block_tokens`` (docs/serving.md:
a sequence of L tokens holds ⌈L / p⌉ blocks), so a request's prompt +
max_tokens may use at most ``⌊cells / p⌋ · p`` positions.  Every prefix hit is a
copy from a sequence that holds the KV (``pool_hits=False``: llama.cpp keeps KV
only in its sequences): a running request, or a parked one — the executor has
``n_slots`` = ``parallel`` + ``park_slots`` sequence ids, and a finished or
cancelled request's slot stays parked with its whole committed blocks (evictable
cached blocks) until the pool or a slot is needed (``Engine`` parking), so a
repeated system prompt or a resent conversation is copied, not recomputed.
``prefix_cache=False`` parks nothing.  Prompts are prefilled in chunks (``chunked``); a request
with a deadline is refused at admission when the step model fitted on this
machine (:mod:`.stepfit`) predicts it late, and stopped (finish reason
``deadline``) once its deadline has passed — its result is worthless then and
its slot serves someone else.  With ``draft_max`` (``serve --lookup``) decoding
requests verify prompt-lookup drafts inside the same steps (:mod:`localinfer.serve.speculation`).
"""

from __future__ import annotations

from dataclasses import dataclass

from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import Engine
from localinfer.serve.http.stepfit import FittedStepModel, TimedExecutor, calibrate
from localinfer.serve.scheduler import Scheduler, SchedulerConfig

MAX_SLOTS = 256          # llama.cpp's LLAMA_MAX_SEQ (backends.memory.MAX_PARALLEL): sequence ids of one context
# Parked sequences keep finished requests' KV: each user's next chat turn and a shared system prompt hit it.
# llama.cpp's executor keeps them in host memory (park_host), so parking costs no decode speed (0 / 1 / 4 / 8 parked:
# 83.2 / 83.8 / 83.7 / 82.1 tok/s at concurrency 1, benchmarks/results/serve_parked_cpu.txt) and a sequence id costs
# nothing measurable (a 4-row decode step 19.4-20.2 ms with 5, 17 or 65 ids); their RAM is capped (8 GiB or half the
# free RAM, executor.HOST_PARK_MAX; Engine._victim says who goes first), which the fit check does not count.  Sixteen
# keep 8 users' 4-turn chats: 82% of later turns' prompt tokens cached against 30% with one parked, TTFT p50 0.99 s
# against 1.71 s (llama-server: 53%, 2.07 s); 24 users' 3-turn chats need more: 79% cached with 32 against 36% with 16,
# TTFT p50 1.32-1.41 s against 2.17-2.36 s, while fresh prompts ran as fast with 32 as with 16 (median ratio 0.97x at
# concurrency 4, 1.04x at 8, three rounds; benchmarks/results/serve_multiturn_cpu.txt).
DEFAULT_PARKED = 32
# A prompt's unfinished chunk joins a step that finishes another prompt only if it lengthens it by at most a quarter
# (scheduler.py, partial_slack): on a CPU, 8 prompts of 302 tokens arriving together then leave one per step.
DEFAULT_PARTIAL_SLACK = 0.25
# After a step that prefills, decode-only steps take a twentieth of its prompt time (one or two steps on a CPU)
# before the next prompt (scheduler.py, decode_share): closed-loop clients otherwise settle into a convoy, each new
# prompt waiting out another's prefill; a tenth cost more TTFT p95 at concurrency 8 (docs/serving.md).
DEFAULT_DECODE_SHARE = 0.05


@dataclass(frozen=True)
class ServeConfig:
    """How the server schedules: slots, queue, prefill chunking, prefix cache, shutdown grace."""

    parallel: int = 4
    max_queue: int = 64
    token_budget: int | None = None
    chunk: int | None = None             # prompt tokens per request per step (None: SchedulerConfig's)
    itl_target_s: float | None = None
    prefix_cache: bool = True
    block_tokens: int = 16
    admission: str = "on_demand"
    park: int | None = None              # parked sequences for finished requests' KV (None: DEFAULT_PARKED)
    draft_max: int = 0                   # prompt-lookup drafts per request and step (0: no lookup)
    partial_slack: float | None = DEFAULT_PARTIAL_SLACK   # None: fill every step's budget
    decode_share: float = DEFAULT_DECODE_SHARE   # decode-only time after a prompt step, a share of its prompt time


    @property
    def park_slots(self) -> int:
        """Sequence slots for parked requests: ``park`` (default :data:`DEFAULT_PARKED`) within llama.cpp's 256;
        0 without the prefix cache."""
        if not self.prefix_cache:
            return 0
        return max(0, min(DEFAULT_PARKED if self.park is None else self.park, MAX_SLOTS - self.parallel))

    @property
    def n_slots(self) -> int:
        """Sequence ids the executor needs (``LoadPlan.n_seq``): the running requests' and the parked ones'."""
        return self.parallel + self.park_slots


def build_engine(inner, config: ServeConfig) -> tuple[TimedExecutor, Engine, FittedStepModel]:
    """(timed executor, engine, step model) over a loaded executor."""
    model = FittedStepModel(calibrate(inner))
    executor = TimedExecutor(inner, model)
    # a paging executor (torch) brings its block size and restores prefixes cached in blocks no sequence holds
    p = getattr(inner, "block_size", None) or config.block_tokens
    n_blocks = (getattr(inner, "n_cells", None) or 0) // p
    # parking needs spare sequence ids and dropping a sequence's tail (not a recurrent model)
    park = max(0, min(config.park_slots, inner.n_slots - config.parallel)) if getattr(inner, "drops_tail", False) else 0
    # parked KV in host memory (llama.cpp's park_host): a cache tier past the cells, as much as the parked ids hold
    # and the host budget's bytes (llama.cpp parks no more; 32 ids of a 128k context would be 262,144 blocks)
    per_slot = (getattr(inner, "slot_cells", None) or n_blocks * p) // p
    host = min(park * per_slot, inner.host_cells() // p) if getattr(inner, "parks_in_host", False) else 0
    blocks = BlockManager(n_blocks + host, p, prefix_cache=config.prefix_cache,
                          pool_hits=getattr(inner, "restores_cached_prefix", False), max_used=n_blocks if host else None)
    chunk = {"chunk_tokens": config.chunk} if config.chunk else {}
    sched = SchedulerConfig(policy="chunked", max_running=config.parallel, token_budget=config.token_budget,
                            itl_target_s=config.itl_target_s, admission=config.admission, deadline_aware=True,
                            drop_late=True, draft_max=config.draft_max, partial_slack=config.partial_slack,
                            decode_share=config.decode_share, **chunk)
    engine = Engine(executor, Scheduler(sched, blocks, model), park_slots=park)
    return executor, engine, model
