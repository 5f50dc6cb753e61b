"""benchmarks/schedule_cycles.py: both schedules do a cycle's work, on the embedded model through llama.cpp."""

import pytest

from benchmarks.batch_costs import Context
from benchmarks.schedule_cycles import Cycles, Executor, Raw, total

from localinfer.model.sources import resolve_model


@pytest.mark.parametrize("via", ["raw", "raw-aside", "executor", "executor-aside"])
def test_both_schedules_do_the_same_work_a_cycle(via):
    k, out = 3, 7
    prompt = 64 if via.endswith("aside") else 8      # the executor computes aside prompts of the tiled kernel's rows
    model = str(resolve_model(None))
    if via.startswith("executor"):
        ops = Executor(model, 1, aside=via == "executor-aside")
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
        assert (s["short_s"] > 0) == via.startswith("raw")   # the executor's prompt step counts its rows' call
    if via == "raw-aside":        # each staggered prompt (one a request) computed aside and copied in
        assert ops.copied >= sum(s["short_calls"] for s in staggered)
    if via.startswith("executor"):
        aside = ops.x.prefill_aside
        assert (aside is not None and aside.prompts > 0 and aside.fallbacks == 0) == (via == "executor-aside")
