"""The gap bound (``max_gap_s``, ``serve --max-gap``) on the simulator: every running stream gets a token at least
that often, whatever arrives, while prompts still progress; without it the same loads freeze streams."""

from hypothesis import given, settings
from hypothesis import strategies as st

from localinfer.serve.assembly import build_step_engine
from localinfer.serve.request import FinishReason, Request
from localinfer.serve.scheduler import SchedulerConfig
from localinfer.serve.simulated import SimulatedExecutor
from localinfer.serve.step_model import LinearStepModel

CPU = LinearStepModel.parse("20,2000,0.5")     # a CPU-like step: 20 ms + 2 ms a token (a 300-token prompt: 0.6 s)

LOADS = st.lists(st.tuples(st.floats(0, 3.0), st.integers(1, 700), st.integers(1, 60)), min_size=1, max_size=24)


def _run(load, **cfg):
    config = SchedulerConfig(policy="chunked", max_running=4, chunk_tokens=512, token_budget=512, **cfg)
    e = build_step_engine(SimulatedExecutor(CPU, n_slots=4), config, step_model=CPU, num_blocks=4 * 48,
                          block_tokens=16)
    reqs = [e.add_request(Request(f"r{i}", tuple(range(7 * i, 7 * i + n_in)), n_out, arrival_s=t))
            for i, (t, n_in, n_out) in enumerate(sorted(load))]
    e.run()
    return reqs


@settings(max_examples=60, deadline=None)
@given(LOADS, st.sampled_from([0.0, 0.05]), st.sampled_from([None, 0.25]))
def test_no_stream_waits_longer_than_the_bound(load, share, slack):
    """4 decodes + a 16-token chunk take 0.112 s here, so a bound of 0.15 s can always be kept."""
    reqs = _run(load, max_gap_s=0.150, decode_share=share, partial_slack=slack)
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert max(r.max_gap_s for r in reqs) <= 0.150 + 1e-9


def test_without_the_bound_the_same_load_freezes_streams():
    load = [(0.0, 40, 50), (0.05, 600, 10), (0.1, 600, 10), (0.2, 600, 10)]
    free = _run(load)
    bound = _run(load, max_gap_s=0.150)
    assert max(r.max_gap_s for r in free) > 1.0 and max(r.max_gap_s for r in bound) <= 0.150 + 1e-9
    # what the bound costs: later first tokens for the long prompts, not the short one's
    assert bound[0].ttft_s == free[0].ttft_s
    assert max(r.ttft_s for r in bound) > max(r.ttft_s for r in free)


def test_decodes_too_many_for_the_bound_still_let_the_oldest_prompt_move():
    """Four decodes alone take 0.028 s; a bound of 0.02 s cannot hold, and prompts still finish (a block a step)."""
    reqs = _run([(0.0, 20, 30), (0.0, 20, 30), (0.0, 20, 30), (0.01, 300, 5)], max_gap_s=0.020)
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
