"""Run prompts through the serving engine on a real executor, with or without prompt-lookup drafts, checking
after every step that the executor's KV cells are exactly the blocks' tokens (rejected drafts leave none)."""

from __future__ import annotations

from localinfer.generation.sampling import SamplingParams
from localinfer.serve.engine import StepEngine
from localinfer.serve.request import Request
from localinfer.serve.scheduler import Scheduler, SchedulerConfig


def run_engine(ex, blocks, prompts, max_tokens, draft_max=0, sampling=None, step_model=None):
    """(outputs, steps taken, the scheduler's drafter) for greedy (or ``sampling``) decoding of ``prompts``."""
    config = SchedulerConfig(max_running=ex.n_slots, policy="chunked", chunk_tokens=64, draft_max=draft_max)
    e = StepEngine(ex, Scheduler(config, blocks, step_model))
    reqs = [e.add_request(Request(f"r{i}", p, max_tokens, sampling=sampling or SamplingParams(temperature=0.0)))
            for i, p in enumerate(prompts)]
    steps = 0
    while e.unfinished:
        e.step()
        steps += 1
        assert ex.cells_used() == e.blocks.tokens_in_use()    # rejected drafts leave no cells behind
    assert ex.cells_used() == 0 and e.blocks.used == 0
    return [r.output for r in reqs], steps, e.scheduler.drafter
