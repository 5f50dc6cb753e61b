"""How the server schedules (:class:`ServeConfig`) and the step engine it builds over an executor.

Prompts are prefilled in chunks; a request with a deadline is refused at admission when the step
model fitted on this machine (:mod:`.step_timing`) predicts it late, and stopped (finish reason
``deadline``) once its deadline has passed.  Finished requests' KV is parked in spare sequence
ids for later prefix hits (:mod:`localinfer.serve.parking`).  The defaults below are chosen from
measurements recorded in docs/executor.md and docs/serving.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from localinfer.serve.assembly import build_step_engine
from localinfer.serve.engine import StepEngine
from localinfer.serve.http.step_timing import FittedStepModel, TimedExecutor, calibrate
from localinfer.serve.scheduler import Admission, Policy, SchedulerConfig
from localinfer.serve.snapshots import DEFAULT_STRIDE, SnapshotPolicy

MAX_SLOTS = 256          # llama.cpp's LLAMA_MAX_SEQ (backends.memory.MAX_PARALLEL): sequence ids of one context
# Parked sequences keep finished requests' KV: each user's next chat turn and a shared system prompt hit it.  32 keep
# 24 users' 3-turn chats at no cost to fresh prompts (docs/executor.md); their host RAM is capped (HOST_CACHE_MAX or half
# the free RAM; Parking.victim says who goes first), which the fit check does not count.
DEFAULT_PARKED = 32
# On a recurrent or hybrid model every sequence id holds a recurrent state on the device (llama.cpp sizes the state
# for n_seq_max sequences: 75 MiB each on Qwen3-Next-80B), so fewer parked ids by default; their attention KV shares
# the cells, their state at a chat turn's end is a snapshot in host memory (serve/snapshots.py).
DEFAULT_PARKED_RECURRENT = 8
# A prompt's unfinished chunk joins a step that finishes another prompt only if it lengthens it by at most a quarter
# (scheduler.py, partial_slack): on a CPU, 8 prompts of 302 tokens arriving together then leave one per step.
DEFAULT_PARTIAL_SLACK = 0.25
# After a step that prefills, decode-only steps take a twentieth of its prompt time (one or two steps on a CPU)
# before the next prompt (scheduler.py, decode_share): closed-loop clients otherwise settle into a convoy, each new
# prompt waiting out another's prefill; a tenth cost more TTFT p95 at concurrency 8 (docs/serving.md).
DEFAULT_DECODE_SHARE = 0.05


# The scheduler serve runs: chunked prefill, blocks taken as the KV grows, deadlines kept (a late request is refused
# or stopped), with the defaults above.  ``--parallel`` is its ``max_running``.
SERVE_SCHEDULER = SchedulerConfig(policy=Policy.CHUNKED, max_running=4, admission=Admission.ON_DEMAND,
                                  deadline_aware=True, drop_late=True, partial_slack=DEFAULT_PARTIAL_SLACK,
                                  decode_share=DEFAULT_DECODE_SHARE)
_SCHEDULER_FIELDS = frozenset(f.name for f in fields(SchedulerConfig))


@dataclass(frozen=True)
class ServeConfig:
    """How the server runs: the scheduler's settings, and what only a server has (its queue, the prefix cache and
    parked sequences, the step log)."""

    scheduler: SchedulerConfig = SERVE_SCHEDULER
    max_queue: int = 64
    step_log: str | None = None          # a file the engine appends one JSON line per step to (serve --step-log)
    prefix_cache: bool = True
    block_tokens: int = 16
    park: int | None = None              # parked sequences for finished requests' KV (None: DEFAULT_PARKED)
    snapshot_stride: int = DEFAULT_STRIDE    # recurrent models: a prompt's state saved every this many tokens (0: none)

    @classmethod
    def build(cls, *, parallel: int | None = None, **options) -> ServeConfig:
        """A config from flat options: the scheduler's fields (``chunk_tokens``, ``token_budget``, ``max_gap_s``, …;
        ``parallel`` is ``max_running``) over :data:`SERVE_SCHEDULER`, the rest ServeConfig's own."""
        sched = {k: options.pop(k) for k in list(options) if k in _SCHEDULER_FIELDS}
        if parallel is not None:
            sched["max_running"] = parallel
        return cls(scheduler=replace(SERVE_SCHEDULER, **sched), **options)

    @property
    def parallel(self) -> int:
        """Requests decoding at once (``--parallel``)."""
        return self.scheduler.max_running

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
    engine = build_step_engine(executor, config.scheduler, step_model=model, block_tokens=config.block_tokens,
                               prefix_cache=config.prefix_cache, park_slots=config.park_slots, on_step=on_step,
                               snapshot_policy=SnapshotPolicy(stride=config.snapshot_stride))
    return executor, engine, model
