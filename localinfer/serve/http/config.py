"""How the server schedules (:class:`ServeConfig`) and the step engine it builds over an executor.

Prompts are prefilled in chunks; a request with a deadline is refused at admission when the step
model fitted on this machine (:mod:`.step_timing`) predicts it late, and stopped (finish reason
``deadline``) once its deadline has passed.  Finished requests' KV is parked in spare sequence
ids for later prefix hits (:mod:`localinfer.serve.parking`).  The defaults below are chosen from
measurements recorded in docs/executor.md and docs/serving.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from localinfer.serve.assembly import build_step_engine
from localinfer.serve.engine import StepEngine
from localinfer.serve.http.step_timing import FittedStepModel, TimedExecutor, calibrate
from localinfer.serve.scheduler import Admission, Policy, SchedulerConfig

MAX_SLOTS = 256          # llama.cpp's LLAMA_MAX_SEQ (backends.memory.MAX_PARALLEL): sequence ids of one context
# Parked sequences keep finished requests' KV: each user's next chat turn and a shared system prompt hit it.  32 keep
# 24 users' 3-turn chats at no cost to fresh prompts (docs/executor.md); their host RAM is capped (HOST_PARK_MAX or half
# the free RAM; Parking.victim says who goes first), which the fit check does not count.
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
    max_gap_s: float | None = None       # while requests decode, a step is predicted to take at most this
    step_log: str | None = None          # a file the engine appends one JSON line per step to (serve --step-log)
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


def build_engine(inner, config: ServeConfig, on_step=None) -> tuple[TimedExecutor, StepEngine, FittedStepModel]:
    """(timed executor, step engine, step model) over a loaded executor; ``on_step`` hears of every step."""
    model = FittedStepModel(calibrate(inner))
    executor = TimedExecutor(inner, model)
    chunk = {"chunk_tokens": config.chunk} if config.chunk else {}
    sched = SchedulerConfig(policy=Policy.CHUNKED, max_running=config.parallel, token_budget=config.token_budget,
                            itl_target_s=config.itl_target_s, max_gap_s=config.max_gap_s,
                            admission=Admission(config.admission),
                            deadline_aware=True, drop_late=True, draft_max=config.draft_max,
                            partial_slack=config.partial_slack, decode_share=config.decode_share, **chunk)
    engine = build_step_engine(executor, sched, step_model=model, block_tokens=config.block_tokens,
                               prefix_cache=config.prefix_cache, park_slots=config.park_slots, on_step=on_step)
    return executor, engine, model
