"""A reply cut short is an error, not a ``finish_reason`` OpenAI's clients do not know: here the machine slows
down after a request was admitted (steps sleep), so its ``deadline_ms`` passes mid-reply."""

from __future__ import annotations

import time

import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer, sse_events

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

SLOW_AFTER = 4          # steps at full speed, then each step takes SLOW_S longer
SLOW_S = 0.2
BODY = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def slowing(default_model):
    """A fresh server per test: the step model it fits (over its last 512 steps) learns the slow steps, and would
    refuse a later request at admission."""
    from localinfer.backends.engine import LoadPlan
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    class SlowsDown(LlamaCppExecutor):
        """A machine that slows down (another process, thermal throttling) SLOW_AFTER steps after _slow_from_now."""
        left = 1 << 30

        def step(self, chunks):
            out = super().step(chunks)
            self.left -= 1
            if self.left < 0:
                time.sleep(SLOW_S)
            return out

    def opener(config):
        plan = LoadPlan(str(default_model), n_ctx=512, n_seq=config.n_slots, n_threads=1, flash_attn=True,
                        options={"kv_unified": True})
        return lambda: SlowsDown(plan, park_host=True)

    srv = LiveServer(default_model, parallel=2, open_executor=opener)
    # the deadline: three times the reply at this machine's present speed (a loaded machine is slower), so it is
    # admitted, and far below the (60 - SLOW_AFTER) × SLOW_S = 11 s the slowed reply would take
    t0 = time.monotonic()
    httpx.post(srv.url + "/v1/completions", json=BODY, timeout=60).raise_for_status()
    srv.deadline_ms = min(6000, max(1500, round(3000 * (time.monotonic() - t0))))
    yield srv
    srv.stop()


def _slow_from_now(srv) -> None:
    srv.runtime.executor.inner.left = SLOW_AFTER


def test_a_deadline_passing_mid_reply_is_504_not_a_half_reply(slowing):
    _slow_from_now(slowing)
    t0, deadline = time.monotonic(), slowing.deadline_ms
    r = httpx.post(slowing.url + "/v1/completions", json={**BODY, "deadline_ms": deadline}, timeout=60)
    assert time.monotonic() - t0 < deadline / 1e3 + 1.0     # cut at the deadline, not run to its 60 tokens (12 s)
    err = r.json()["error"]
    assert r.status_code == 504 and err["code"] == "deadline_exceeded" and err["param"] == "deadline_ms", r.text
    assert f"deadline_ms={deadline} passed after" in err["message"] and "\n" not in err["message"]
    slowing.wait_idle()


def test_a_stream_cut_mid_reply_ends_with_an_error_event(slowing):
    _slow_from_now(slowing)
    with httpx.stream("POST", slowing.url + "/v1/completions", json={**BODY, "stream": True,
                                                                          "deadline_ms": slowing.deadline_ms}, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "deadline_exceeded", events[-3:]
    texts = [c["text"] for e in events[:-2] for c in e["choices"]]
    assert texts and all(c["finish_reason"] is None for e in events[:-2] for c in e["choices"])
    slowing.wait_idle()


# One cut request a server: once steps have run slow, deadline-aware admission scales its predictions by their wall
# time (deadlines.StepErrors) and refuses the next such request at admission (429), as it should on a slow machine.

def test_the_openai_client_raises_a_stream_cut_mid_reply_as_its_api_error(slowing):
    _slow_from_now(slowing)
    client = openai.OpenAI(base_url=slowing.base_url, api_key="none", max_retries=0)
    with pytest.raises(openai.APIError, match=f"deadline_ms={slowing.deadline_ms} passed after") as e:
        for _ in client.completions.create(model=MODEL_ID, prompt=BODY["prompt"], max_tokens=60, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True,
                                                                    "deadline_ms": slowing.deadline_ms}):
            pass
    assert not isinstance(e.value, openai.RateLimitError)       # cut mid-reply, not refused at admission
    slowing.wait_idle()


def test_n_choices_cut_together(slowing):
    _slow_from_now(slowing)
    t0, deadline = time.monotonic(), slowing.deadline_ms
    r = httpx.post(slowing.url + "/v1/completions", json={**BODY, "n": 2, "deadline_ms": deadline}, timeout=60)
    assert r.status_code == 504 and time.monotonic() - t0 < deadline / 1e3 + 1.0, r.text   # neither ran to its end
    slowing.wait_idle()


def test_n_choices_streamed_and_cut_send_no_usage_chunk_after_the_error(slowing):
    _slow_from_now(slowing)
    body = {**BODY, "n": 2, "stream": True, "stream_options": {"include_usage": True},
            "deadline_ms": slowing.deadline_ms}
    with httpx.stream("POST", slowing.url + "/v1/completions", json=body, timeout=60) as r:
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "deadline_exceeded", events[-3:]
    assert not any(e.get("usage") for e in events[:-1]), events[-3:]
    slowing.wait_idle()
