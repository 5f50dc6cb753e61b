"""Closed-loop clients on the simulated executor, through the real engine, scheduler and block manager: the
convoy that ``decode_share`` breaks (scheduler.py).

Four clients each send their next 300-token prompt (128 tokens out) 3 ms after their previous answer ended, as a
client on the same machine does; steps take 23 ms + 2.4 ms a token + 0.3 µs a causal pair, a 2-core CPU's shape
(a 300-token prompt alone ≈ 0.76 s, a decode step of four ≈ 33 ms).
"""

import statistics

from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine
from localinfer.serve.http.config import DEFAULT_DECODE_SHARE
from localinfer.serve.replay import TraceRequest, trace_prompt
from localinfer.serve.request import Request
from localinfer.serve.scheduler import Scheduler, SchedulerConfig
from localinfer.serve.simulated import SimulatedExecutor
from localinfer.serve.step_model import LinearStepModel

MODEL = LinearStepModel(0.023, 2.4e-3, 0.3e-6)


def closed_loop(decode_share: float, clients: int = 4, requests: int = 16, think_s: float = 0.003):
    """(requests in the order sent, output tokens / s)."""
    config = SchedulerConfig(policy="chunked", max_running=8, token_budget=512, partial_slack=0.25,
                             decode_share=decode_share)
    scheduler = Scheduler(config, BlockManager(1000, 16), MODEL)
    executor = SimulatedExecutor(MODEL, n_slots=8)
    engine = StepEngine(executor, scheduler)
    sent = []

    def send(at: float) -> None:
        r = Request(f"r{len(sent)}", trace_prompt(TraceRequest(f"r{len(sent)}", 0, 300, 128)), 128, arrival_s=at)
        sent.append(engine.add_request(r))

    for _ in range(clients):
        send(0.0)
    for _ in range(100_000):
        if not engine.unfinished:
            break
        events = engine.step()
        if not events and not scheduler.running:
            engine._idle()
        for ev in events:
            if ev.finish_reason is not None and len(sent) < requests:
                send(executor.now + think_s)
    assert all(r.finished and len(r.output) == 128 for r in sent)
    return sent, sum(len(r.output) for r in sent) / max(r.finished_s for r in sent)


def test_the_default_share_of_decode_steps_breaks_the_closed_loop_convoy():
    alone = closed_loop(0.0, clients=1, requests=4)[0][-1].ttft_s         # one prompt on an idle machine
    convoy, tok_s = closed_loop(0.0)
    spread, tok_s_spread = closed_loop(DEFAULT_DECODE_SHARE)
    # without the share, after the first wave every request but one a cycle waits out another's prefill
    waits = [r.ttft_s / alone for r in convoy[4:]]
    assert statistics.median(waits) > 1.8 and sum(w > 1.8 for w in waits) >= 9
    # with it, the first wave's finishes spread out, and then each prompt finds the machine free
    assert all(r.ttft_s / alone < 1.2 for r in spread[4:])
    # at the cost of the first wave's later prompts: each waits the decode-only steps after those before it
    assert convoy[3].ttft_s < spread[3].ttft_s < (1 + 1.5 * DEFAULT_DECODE_SHARE) * convoy[3].ttft_s
    assert statistics.median(r.ttft_s for r in spread) < 0.6 * statistics.median(r.ttft_s for r in convoy)
    # for a little throughput: the decode-only steps batch fewer rows
    assert 0.98 * tok_s < tok_s_spread < tok_s
