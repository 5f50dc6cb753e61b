"""benchmarks/schedule_cycles.py: both schedules do a cycle's work, on the embedded model through llama.cpp."""

import pytest

from benchmarks.batch_costs import Context
from benchmarks.schedule_cycles import Cycles, Executor, Raw, total

from localinfer.model.sources import resolve_model


@pytest.mark.parametrize("via", ["raw", "raw-aside", "executor"])
def test_both_schedules_do_the_same_work_a_cycle(via):
    k, prompt, out = 3, 8, 7
    model = str(resolve_model(None))
    if via == "executor":
        ops = Executor(model, 1)
    else:        # raw-aside: each lone prompt computed in a second context and its state copied in
        ops = Raw(Context(model, 1, cells=256), Context(model, 1, cells=256) if via == "raw-aside" else None)
    cyc = Cycles(ops, k, prompt, out)
    waves, staggered = cyc.waves(1), cyc.staggered(2)
    assert len(waves) == 1 and len(staggered) == 2          # the staggered schedule's first cycle is not counted
    w = waves[0]
    assert (w["decode_steps"], w["short_calls"], w["rows"]) == (out - 1, 0, k * (out - 1))
    for s in staggered:
        assert s["rows"] == k * (out - 1)                    # every request's tokens after the first, once
        assert s["short_calls"] == k                         # one beside each prompt
        assert s["decode_steps"] + s["short_calls"] >= out - 1
        assert total(s) > 0 and s["prompt_s"] > 0
        assert (s["short_s"] > 0) == (via != "executor")     # the executor's prompt step counts its rows' call
    if via == "raw-aside":        # the copied prompts hold their cells in the main context: the work went on there
        assert ops.c.L.llama_memory_seq_pos_max(ops.c.mem, 0) >= prompt - 1
