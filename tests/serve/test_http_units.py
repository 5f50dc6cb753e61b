"""The server's pure parts without a server: body parsing, penalties and logprobs, text with stop strings,
the fitted step model, the error shape."""

from __future__ import annotations

import contextlib
import json
import math

import numpy as np
import pytest

from localinfer.serve.http.errors import APIError
from localinfer.serve.http.responses import TextStream
from localinfer.serve.http.sampler import ServeRequest, logprob_of, sampling_for
from localinfer.serve.http.schemas import parse
from localinfer.serve.http.step_timing import FittedStepModel
from localinfer.serve.request import FinishReason
from localinfer.serve.step_model import LinearStepModel

pytest.importorskip("prometheus_client")


def test_parse_defaults_aliases_and_precedence():
    s = parse({"model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                          {"role": "assistant", "content": None}, {"role": "user", "content": "x"}],
               "max_tokens": 9, "max_completion_tokens": 5, "top_k": -1, "stop": "END", "seed": 3,
               "stream": True, "stream_options": {"include_usage": True}, "response_format": {"type": "text"}},
              chat=True, deadline_header="250")
    assert [m["role"] for m in s.messages] == ["system", "assistant", "user"] and s.messages[1]["content"] == ""
    assert s.max_tokens == 5 and s.sampling.top_k == 0 and s.sampling.seed == 3 and s.stop == ("END",)
    assert s.stream and s.include_usage and s.deadline_ms == 250 and s.logprobs is None and s.n == 1
    c = parse({"model": "m", "prompt": [[1, 2, 3]], "logprobs": 0, "deadline_ms": 500}, chat=False,
              deadline_header="100")
    assert c.prompt == (1, 2, 3) and c.logprobs == 0 and c.deadline_ms == 100
    assert parse({"model": "m", "prompt": ["one"]}, chat=False).prompt == "one"


@pytest.mark.parametrize("body, param", [
    ([], None), ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, "model"),    # no model: the loaded one
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
])
def test_parse_refusals_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse(body, chat=True)
    err = e.value
    assert err.status == 400 and err.param == param and "\n" not in err.message
    assert set(json.loads(err.json_bytes())["error"]) == {"message", "type", "param", "code"}


def _request(**kw) -> ServeRequest:
    from localinfer.generation.sampling import SamplingParams

    return ServeRequest("r", (1, 2), 8, sampling=SamplingParams(temperature=0), **kw)


def test_frequency_and_presence_penalties_follow_openai():
    logits = np.array([0.0, 5.0, 4.5, 1.0], dtype=np.float32)
    r = _request(frequency_penalty=0.3)
    assert r.sampler.sample(logits, r.view()) == 1
    r.output.append(1)                                  # once: 5 - 0.3 = 4.7 > 4.5
    assert r.sampler.sample(logits, r.view()) == 1
    r.output.append(1)                                  # twice: 5 - 0.6 = 4.4 < 4.5
    assert r.sampler.sample(logits, r.view()) == 2
    p = _request(presence_penalty=0.6)
    p.output += [1, 1, 1]                               # presence counts once: 5 - 0.6 = 4.4
    assert p.sampler.sample(logits, p.view()) == 2
    banned = _request(banned=frozenset({1}))
    assert banned.sampler.sample(logits, banned.view()) == 2


def test_logprobs_are_the_raw_log_softmax():
    logits = np.array([1.0, 3.0, 2.0], dtype=np.float32)
    lse = math.log(sum(math.exp(x) for x in (1.0, 3.0, 2.0)))
    lp = logprob_of(logits, 2, 2)
    assert lp.token == 2 and lp.logprob == pytest.approx(2.0 - lse)
    assert [t for t, _ in lp.top] == [1, 2] and lp.top[0][1] == pytest.approx(3.0 - lse)
    r = _request(top_logprobs=1, frequency_penalty=2.0)
    r.output.append(1)
    tok = r.sampler.sample(logits, r.view())            # the penalty moves the choice, not the logprob
    assert tok == 2 and r.logprobs[-1].logprob == pytest.approx(2.0 - lse) and r.logprobs[-1].top[0][0] == 1
    assert sampling_for(r.sampling.with_(seed=7), 2).seed == 9 and sampling_for(r.sampling, 2).seed is None


PIECES = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"\xe2\x82", 6: b"\xac", 9: b"</s>"}


class _Tok:
    def token_bytes(self, t):
        return PIECES[t]


def test_text_stream_holds_back_a_forming_stop_and_joins_utf8():
    t = TextStream(_Tok(), ("lo w",), frozenset({9}))
    assert [t.feed(x) for x in (1, 2)] == ["He", "l"]            # "l", then "lo", could start "lo w"
    assert t.feed(3) == "" and t.stopped and t.tokens == 3
    assert t.feed(4) == "" and t.flush() == ""
    u = TextStream(_Tok(), (), frozenset({9}))
    assert [u.feed(x) for x in (5, 6, 9)] == ["", "€", ""] and u.flush() == "" and u.tokens == 3
    v = TextStream(_Tok(), ("xyz",), frozenset())
    assert v.feed(1) == "Hel" and v.feed(2) == "lo" and v.flush() == "" and not v.stopped


def test_fitted_step_model_learns_the_machine():
    m = FittedStepModel(LinearStepModel(0.1, 0.0, 0.0), refit=8)
    for n in (1, 1, 8, 16, 32, 64, 1, 128, 4, 2):
        m.observe([(n, 0)], 0.010 + 0.001 * n)
    assert m.model.fixed_s == pytest.approx(0.010, rel=1e-3) and m.model.per_token_s == pytest.approx(0.001, rel=1e-3)
    assert m.seconds([(100, 0)]) == pytest.approx(0.110, rel=1e-2)


def test_the_fitted_model_keeps_decode_rows_and_prompt_tokens_apart():
    """A CPU's steps: 5 ms + 3.6 ms a prompt token + 2.9 ms a chunk (a decode row costs 6.5 ms, twice a prompt
    token).  Fitted on a server's mix (decode steps of 1-7 rows, a 300-token prompt beside them now and then),
    both kinds are predicted to 2%, where one coefficient a token predicted a 6-row decode step 30% short."""
    def truth(shapes):
        return 0.005 + 0.0036 * sum(c for c, _ in shapes) + 0.0029 * len(shapes)

    m = FittedStepModel(LinearStepModel(0.005, 0.0036, 0.0), refit=8)
    for i in range(120):
        rows = [(1, 300 + i)] * (1 + i % 7)
        shapes = rows + [(300, 0)] if i % 16 == 0 else rows
        m.observe(shapes, truth(shapes))
    for shapes in ([(1, 400)] * 6, [(1, 400)] * 3 + [(300, 0)], [(1, 400)]):
        assert m.seconds(shapes) == pytest.approx(truth(shapes), rel=0.02), shapes
    assert m.model.per_seq_s == pytest.approx(0.0029, rel=0.02)
    decodes = FittedStepModel(LinearStepModel(0.005, 0.0036, 0.0, 0.0029), refit=8)
    for i in range(40):           # decode steps only: the row's cost is fitted, a prompt token's price kept
        decodes.observe([(1, 300 + i)] * (1 + i % 7), 0.004 + 0.007 * (1 + i % 7))
    got = decodes.model
    assert got.per_token_s + got.per_seq_s == pytest.approx(0.007, rel=1e-3)
    assert got.per_token_s == pytest.approx(0.0036, rel=1e-2)


@pytest.mark.parametrize("model", [LinearStepModel(0.026, 3.04e-5, 3e-9),
                                   LinearStepModel(0.007, 0.003, 8e-7, 0.001, 5e-6),
                                   LinearStepModel(0.007, 0.003, 7e-7, 0.001, 5e-6, 3e-5)])
def test_a_steps_seconds_are_its_features_weighed(model):
    """seconds() sums in one pass what the fit and the deadline factor weigh through features() and predict()."""
    from localinfer.serve.step_model import features

    for shapes in ([(1, 400)] * 8 + [(300, 0)], [(1, 2048)], [(2048, 0)], [(63, 500), (64, 500)],
                   [(1, 700)] * 3 + [(512, 1024)]):
        assert model.seconds(shapes) == pytest.approx(model.predict(features(shapes)), rel=1e-12)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_window_of_equal_decode_steps_keeps_the_prompt_token_as_the_old_model_priced_it(rows):
    """512 steps of the same number of decode rows (a long reply alone, or three): tokens, chunks and the constant
    are one column to the fit.  The rows' time is fitted (every such step predicted exactly) and taken up by the
    fixed time and a chunk's, a prompt token keeping its old price, so a 300-token prompt is still priced near its
    cost; a minimum-norm fit halved a row between
    the fixed time and a token and priced that prompt at 1.87x (1.78x at 3 rows)."""
    truth = LinearStepModel(0.008, 0.0028, 0.0, 0.0005, 3e-6)
    old = LinearStepModel(0.009, 0.0029, 1e-9, 0.0006, 0.0)
    m = FittedStepModel(old, refit=32)
    for i in range(512):
        shapes = [(1, 300 + i + 7 * k) for k in range(rows)]
        m.observe(shapes, truth.seconds(shapes))
    got = m.model
    step = [(1, 900 + 7 * k) for k in range(rows)]
    assert m.seconds(step) == pytest.approx(truth.seconds(step), rel=1e-6)
    assert got.per_token_s == pytest.approx(old.per_token_s, rel=1e-2)      # no prompt seen: its token's price kept
    # no prompt in the window: a prompt's pairs keep their old price
    assert (got.per_row_pair_s, got.per_pair_s) == pytest.approx((3e-6, 1e-9), rel=1e-6)
    assert m.seconds([(300, 0)]) == pytest.approx(truth.seconds([(300, 0)]), rel=0.1)


def _long_prompt_steps(m, truth, prompts) -> list:
    """256 steps of 1-4 decode rows, every eighth with one of ``prompts`` (chunk, positions held) beside them,
    observed by ``m``; their shapes."""
    steps = []
    for i in range(256):
        shapes = [(1, 300 + i + 9 * k) for k in range(1 + i % 4)]
        if i % 8 == 0:
            shapes.append(prompts[(i // 8) % len(prompts)])
        m.observe(shapes, truth.seconds(shapes))
        steps.append(shapes)
    return steps


GRID = [(c, h) for h in (0, 512, 1024, 2048) for c in (64, 128, 256, 512)]


def test_a_prompt_chunks_held_positions_are_fitted_apart_from_its_pairs():
    """A CPU's prompt chunk pays once for every position before it, whatever its length (SmolLM2 on two cores: a
    64-token chunk 2,048 positions in costs 1.45 µs a pair more than at 0, a 512-token one 0.94).  Fitted on chunks
    of 64-512 tokens at 0-2,048 positions, the model gives both prices back, and a 64-token chunk after 2,048
    positions is predicted exactly where one price a pair, fitted on the same steps, is 14% short."""
    from localinfer.serve.http.step_timing import _fit
    from localinfer.serve.step_model import features

    truth = LinearStepModel(0.006, 0.0028, 7e-7, 0.001, 5e-6, 3e-5)
    old = LinearStepModel(0.006, 0.0028, 1.2e-6, 0.001, 5e-6)          # calibrate's: the held price in the pairs
    m = FittedStepModel(old, refit=32)
    steps = _long_prompt_steps(m, truth, GRID)
    got = m.model
    assert (got.per_pair_s, got.per_held_s) == pytest.approx((7e-7, 3e-5), rel=1e-3)
    assert m.seconds([(64, 2048)]) == pytest.approx(truth.seconds([(64, 2048)]), rel=1e-3)
    obs = np.array([(*features(s), truth.seconds(s)) for s in steps])
    obs[:, 4] = 0.0                                   # the same steps with no held column: one price a pair
    pairs_only = _fit(obs, old)
    assert pairs_only.per_held_s == 0 and pairs_only.seconds([(64, 2048)]) < 0.9 * truth.seconds([(64, 2048)])


@pytest.mark.parametrize("held", [0.0, 3e-5])
def test_prompts_from_position_0_leave_the_held_price_as_it_was(held):
    """Every prompt chunk from position 0 (a closed loop's 300-token prompts): nothing tells a held position's
    price, so it stays the old model's, and the steps are still predicted exactly."""
    truth = LinearStepModel(0.006, 0.0028, 7e-7, 0.001, 5e-6, 3e-5)
    m = FittedStepModel(LinearStepModel(0.006, 0.0028, 7e-7, 0.001, 5e-6, held), refit=32)
    _long_prompt_steps(m, truth, [(300, 0), (64, 0), (512, 0)])
    assert m.model.per_held_s == pytest.approx(held, abs=1e-12)
    step = [(1, 500)] * 3 + [(300, 0)]
    assert m.seconds(step) == pytest.approx(truth.seconds(step), rel=1e-6)


def test_calibration_measures_a_chunk_apart_from_a_token():
    """calibrate's steps (a prefill, a decode, two one-token chunks) on the simulated executor, whose clock is a
    known model, give that model back."""
    from localinfer.serve.http.step_timing import calibrate
    from localinfer.serve.simulated import SimulatedExecutor

    true = LinearStepModel(0.005, 0.0036, 0.0, 0.0029)
    got = calibrate(SimulatedExecutor(true, n_slots=4))
    assert (got.fixed_s, got.per_token_s, got.per_seq_s) == pytest.approx((0.005, 0.0036, 0.0029), rel=1e-6)
    one = calibrate(SimulatedExecutor(true, n_slots=1))        # one slot: no second chunk to time
    assert one.per_seq_s == 0 and one.seconds([(1, 64)]) == pytest.approx(true.seconds([(1, 64)]), rel=1e-6)


@pytest.mark.parametrize("cap", [4096, 100])
def test_calibration_prices_a_rows_pairs_and_a_prompts_apart_over_placeholder_positions(cap):
    """The simulated executor with placeholder positions (``fill``, as the llama.cpp executor's) on a clock that is
    a CPU-shaped model (a row's pair 5 µs, a prompt's 0.8): calibrate gives both prices back, and none where the
    executor can fill too few positions to tell them (a big model's KV under the byte cap)."""
    from localinfer.serve.http.step_timing import calibrate
    from localinfer.serve.simulated import SimulatedExecutor

    class Filling(SimulatedExecutor):
        def fill(self, src, dst, n):
            self._cells[dst] = list(range(-1, -1 - min(n, cap), -1))
            return len(self._cells[dst])

    true = LinearStepModel(0.005, 0.0036, 8e-7, 0.0029, 5e-6)
    ex = Filling(true, n_slots=4)
    got = calibrate(ex)
    if cap > 1000:
        assert (got.per_row_pair_s, got.per_pair_s) == pytest.approx((5e-6, 8e-7), rel=1e-6)
        assert (got.fixed_s, got.per_token_s, got.per_seq_s) == pytest.approx((0.005, 0.0036, 0.0029), rel=2e-2)
    else:
        assert (got.per_row_pair_s, got.per_pair_s) == (0.0, 0.0)
    assert not any(ex._cells.get(s) for s in range(4))     # nothing left behind


def test_calibration_puts_a_held_positions_price_in_a_prompts_pairs_on_the_safe_side():
    """Calibration times one prompt length (64 tokens at 0 and after the placeholders): it cannot tell a held
    position's price from a pair's, so it leaves it 0 and prices the pairs as a 64-token chunk pays them; a longer
    chunk after as many positions is then predicted long, not short, until a refit sees one."""
    from localinfer.serve.http.step_timing import WIDE, calibrate
    from localinfer.serve.simulated import SimulatedExecutor

    class Filling(SimulatedExecutor):
        def fill(self, src, dst, n):
            self._cells[dst] = list(range(-1, -1 - n, -1))
            return n

    true = LinearStepModel(0.005, 0.0036, 7e-7, 0.0029, 5e-6, 3e-5)
    got = calibrate(Filling(true, n_slots=4))
    assert got.per_held_s == 0 and got.per_pair_s > true.per_pair_s
    wide = [(64, WIDE + 2)]                        # calibrate's own chunk, which it prices exactly
    assert got.seconds(wide) == pytest.approx(true.seconds(wide), rel=2e-2)
    assert true.seconds([(512, 1024)]) < got.seconds([(512, 1024)]) < 1.3 * true.seconds([(512, 1024)])


def test_finish_reason_values_stay_the_engines():
    assert {r.value for r in FinishReason} >= {"stop", "length", "cancelled", "deadline", "error"}


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_accepted_connections_turn_nagle_off(host):
    """The socket serve binds makes asyncio set TCP_NODELAY on every connection it accepts (with proto 0 it
    did not, and each keep-alive request after a connection's first waited ~40 ms for a delayed ACK)."""
    import asyncio
    import socket

    from localinfer.serve.http.server import bind

    try:
        sock = bind(host, 0)
    except OSError:
        pytest.skip(f"no {host} on this machine")
    seen: list[int] = []

    async def main():
        def on_client(reader, writer):
            s = writer.get_extra_info("socket")
            seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_client, sock=sock)
        async with server:
            r, w = await asyncio.open_connection(host, sock.getsockname()[1])
            await r.read()
            w.close()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert len(seen) == 1 and seen[0]


@contextlib.contextmanager
def _relay_loop():
    """(a running event loop, the calls of ``_deliver`` it got: (calling thread's name, events))."""
    import asyncio
    import threading

    from localinfer.serve.http.runtime import _deliver

    loop = asyncio.new_event_loop()
    calls: list[tuple[str, int]] = []
    real = loop.call_soon_threadsafe

    def recording(fn, *args):
        if fn is _deliver:
            calls.append((threading.current_thread().name, len(args[0])))
        return real(fn, *args)

    loop.call_soon_threadsafe = recording
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        yield loop, calls
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_the_relay_thread_not_the_engine_wakes_the_loop():
    """Events reach the loop through the relay thread: a self-pipe write from the engine thread let the loop take
    the GIL and format the step's SSE frames while the engine waited (runtime.py's docstring)."""
    import asyncio

    from localinfer.serve.http.config import ServeConfig
    from localinfer.serve.http.runtime import Event, Handle, Runtime

    with _relay_loop() as (loop, calls):
        rt = Runtime(lambda: None, ServeConfig.build(parallel=1))
        rt._loop = loop
        rt._relay.start()
        queue: asyncio.Queue = asyncio.Queue()
        h = Handle(None, queue, 0)
        rt._dispatch([(h, Event(0, 7)), (h, Event(0, None, "stop"))])
        got = asyncio.run_coroutine_threadsafe(asyncio.wait_for(_queued(queue, 2), 5), loop).result(10)
        assert [e.token for e in got] == [7, None] and h.finished
        assert [name for name, _ in calls] == ["localinfer-relay"]
        rt._end_relay()                                   # what the engine thread does when it stops
        rt._relay.join(5)
        assert not rt._relay.is_alive()


async def _queued(queue, n):
    return [await queue.get() for _ in range(n)]


def test_the_relay_delivers_what_was_queued_before_the_end_in_one_wake_up():
    """Steps queued while the relay was busy go to the loop in one call, in order, and the engine's end still
    delivers them before the relay stops."""
    import asyncio

    from localinfer.serve.http.config import ServeConfig
    from localinfer.serve.http.runtime import Event, Handle, Runtime

    with _relay_loop() as (loop, calls):
        rt = Runtime(lambda: None, ServeConfig.build(parallel=1))
        rt._loop = loop
        queue: asyncio.Queue = asyncio.Queue()
        h = Handle(None, queue, 0)
        rt._dispatch([(h, Event(0, 7))])                  # three steps' events, queued before the relay runs
        rt._dispatch([(h, Event(0, 8))])
        rt._dispatch([(h, Event(0, None, "stop"))])
        rt._end_relay()
        rt._relay.start()
        rt._relay.join(5)
        assert not rt._relay.is_alive()
        got = asyncio.run_coroutine_threadsafe(asyncio.wait_for(_queued(queue, 3), 5), loop).result(10)
        assert [e.token for e in got] == [7, 8, None] and h.finished
        assert calls == [("localinfer-relay", 3)]


def test_a_few_stalled_steps_do_not_move_the_fitted_step_model():
    """40 ms + 2 ms a token, measured; eight steps in 200 the OS stalled for 2 s: the plain fit's prediction of a
    step with a prompt chunk grows by half, the robust one stays within 5% (the gap bound sizes chunks by it)."""
    import numpy as np

    from localinfer.serve.http.step_timing import _fit, robust_fit
    from localinfer.serve.step_model import LinearStepModel

    rng = np.random.default_rng(3)
    tokens = rng.integers(1, 60, 200).astype(float)
    # (tokens, pairs, row pairs, chunks, held, seconds): one chunk a step
    obs = np.column_stack([tokens, np.zeros(200), np.zeros(200), np.ones(200), np.zeros(200),
                           0.040 + 0.002 * tokens + rng.normal(0, 0.001, 200)])
    obs[[10, 30, 55, 90, 120, 150, 170, 190], -1] = 2.0
    old = LinearStepModel(0.03, 0.001, 0.0)
    plain, robust = _fit(obs, old), robust_fit(obs, old)
    for tokens, truth in ((1, 0.042), (30, 0.100)):     # a decode, a decode step with a 29-token chunk
        assert abs(robust.seconds([(tokens, 0)]) - truth) < 0.05 * truth
    assert plain.seconds([(30, 0)]) > 1.5 * 0.100


def test_a_low_descriptor_limit_is_raised_or_shared_not_a_cap_of_one():
    # issue 44: at RLIMIT_NOFILE 64 the connection cap was 1 (64 - a 64-descriptor reserve)
    import subprocess
    import sys

    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
            "from localinfer.serve.http.limits import connection_cap; "
            "print(connection_cap(512), *resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code.format(soft=64, hard=64)], capture_output=True, text=True,
                         check=True).stdout.split()
    assert int(out[0]) == 32                          # half the limit kept for the process, half for clients
    out = subprocess.run([sys.executable, "-c", code.format(soft=64, hard=4096)], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["512", "4096", "4096"]             # the soft limit raised to the hard one: the cap asked for
