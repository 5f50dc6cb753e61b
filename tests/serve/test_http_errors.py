"""Bad input and faults over raw HTTP (what the openai client will not send): each a 4xx in OpenAI's shape."""

from __future__ import annotations

import json
import logging
import os
import socket
import time

import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer, assert_only_parked_kv

httpx = pytest.importorskip("httpx")

CHAT = "/v1/chat/completions"
OK = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def _error(r, status: int, param=None, code=None) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    msg = body["error"]["message"]
    assert msg and "\n" not in msg and "Traceback" not in msg and "/work" not in msg
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return msg


@pytest.mark.parametrize("field, value, param", [
    ("temperature", "hot", "temperature"), ("temperature", float("nan"), "temperature"),
    ("temperature", 2.5, "temperature"), ("top_p", 0, "top_p"), ("top_p", 1.5, "top_p"),
    ("top_k", "x", "top_k"), ("min_p", -0.1, "min_p"), ("max_tokens", 0, "max_tokens"),
    ("max_tokens", 10**9, "max_tokens"), ("max_tokens", True, "max_tokens"), ("n", 0, "n"), ("n", 99, "n"),
    ("seed", -1, "seed"), ("seed", 1.5, "seed"), ("stop", 7, "stop"), ("stop", ["a", "b", "c", "d", "e"], "stop"),
    ("presence_penalty", 3, "presence_penalty"), ("frequency_penalty", "0", "frequency_penalty"),
    ("stream", "yes", "stream"), ("top_logprobs", 3, "top_logprobs"), ("messages", "hi", "messages"),
    ("messages", [], "messages"), ("messages", [{"role": "wizard", "content": "x"}], "messages[0].role"),
    ("messages", [{"role": "user", "content": 5}], "messages[0].content"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
     "messages[0].content[0]"),
    ("model", 3, "model"), ("tools", [{"type": "function"}], "tools[0]"), ("logit_bias", {"x": 5}, "logit_bias"),
    ("logit_bias", {"1": 101}, "logit_bias"), ("logit_bias", {"99999999": 1}, "logit_bias"), ("n_probs", 3, "n_probs"),
    ("mirostat", 2, "mirostat"), ("grammar", "root ::= \"a", "grammar"), ("echo", True, "echo"),
    ("stream_options", "x", "stream_options"), ("deadline_ms", -5, "deadline_ms"),
])
def test_wrong_types_and_out_of_range_name_the_field(http, field, value, param):
    body = dict(OK, **{field: value})
    if field == "top_logprobs":
        body["logprobs"] = False
    raw = json.dumps(body, allow_nan=True)
    msg = _error(http.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400, param)
    assert param.split("[")[0] in msg


def test_more_choices_than_the_server_holds(http, srv):
    limit = srv.runtime.config.parallel + srv.runtime.config.max_queue
    msg = _error(http.post(CHAT, json=dict(OK, n=limit + 1)), 400, "n")
    assert str(limit) in msg


def test_deadline_header(http):
    _error(http.post(CHAT, json=OK, headers={"x-localinfer-deadline-ms": "soon"}), 400, "x-localinfer-deadline-ms")
    _error(http.post(CHAT, json=OK, headers={"x-localinfer-deadline-ms": "0"}), 400, "x-localinfer-deadline-ms")
    late = dict(OK, messages=[{"role": "user", "content": "hi " * 300}], max_tokens=300)
    r = http.post(CHAT, json=late, headers={"x-localinfer-deadline-ms": "1"})
    _error(r, 429, "deadline_ms", "deadline_unmeetable")
    assert http.post(CHAT, json=OK, headers={"x-localinfer-deadline-ms": "600000"}).status_code == 200


def test_completions_fields(http):
    _error(http.post("/v1/completions", json={"model": MODEL_ID, "prompt": ""}), 400, "prompt")
    _error(http.post("/v1/completions", json={"model": MODEL_ID, "prompt": ["a", ""]}), 400, "prompt")
    _error(http.post("/v1/completions", json={"model": MODEL_ID, "prompt": ["a"] * 65}), 400, "prompt")
    _error(http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "x", "logprobs": 6}), 400, "logprobs")
    _error(http.post("/v1/completions", json={"model": MODEL_ID, "prompt": [1, 10**9]}), 400, "prompt")
    r = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": [1, 504, 3458], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


def test_malformed_json_body_and_content_type(http):
    deep, huge = b"[" * 100_000 + b"]" * 100_000, b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}"
    for raw in (b"{", b"[1, 2", b"\xff\xfe", b"null", b"[]", b"", b'"text"', deep, huge):
        _error(http.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400)
    _error(http.post(CHAT, content=json.dumps(OK), headers={"content-type": "multipart/form-data"}), 415)
    _error(http.post(CHAT, content=json.dumps(OK), headers={"content-type": "application/xml"}), 415)
    # what curl -d sends (text/plain, form-urlencoded) is read as the JSON it is (tests/serve/test_http_weak_inputs.py)


def test_unknown_route_and_method(http):
    msg = _error(http.get("/v1/nothing" + "x" * 20_000), 404)
    assert len(msg) < 200                             # the path is not echoed whole
    _error(http.get(CHAT), 405)


def test_prompt_over_the_context_gives_both_numbers(http):
    msg = _error(http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "word " * 900, "max_tokens": 200}),
                 400, "max_tokens", "context_length_exceeded")
    assert "200" in msg and "1024" in msg
    _error(http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "word " * 1100}), 400, "prompt",
           "context_length_exceeded")


def test_body_over_the_cap_is_413(http, srv):
    cap = srv.config.max_body_bytes
    big = json.dumps(dict(OK, messages=[{"role": "user", "content": "x" * (cap + 10)}]))
    _error(http.post(CHAT, content=big, headers={"content-type": "application/json"}), 413)

    def chunks():                                   # no Content-Length: the cap applies while reading
        for _ in range(cap // 65536 + 2):
            yield b" " * 65536
    _error(http.post(CHAT, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert http.post(CHAT, json=OK).status_code == 200


def test_host_header_is_checked(http, srv):
    _error(http.get("/v1/models", headers={"host": "evil.example"}), 403, "host", "host_not_allowed")
    _error(http.get("/v1/models", headers={"host": "evil.example:8080"}), 403)
    for ok in ("192.168.1.5:8080", "[fe80::1]:8080", "10.0.0.2", "app.localhost:3000"):   # nothing to rebind
        assert http.get("/v1/models", headers={"host": ok}).status_code == 200, ok
    _error(http.get("/v1/models", headers={"host": "192.168.1.5.evil.example"}), 403)


def test_health_and_metrics(http, srv):
    assert http.get("/health").json() == {"status": "ok"}
    text = http.get("/metrics").text
    for name in ("localinfer_requests_running", "localinfer_requests_waiting", "localinfer_kv_blocks_used",
                 "localinfer_kv_blocks_cached", "localinfer_kv_blocks_total", "localinfer_prompt_tokens_total",
                 "localinfer_generation_tokens_total", "localinfer_prefix_cache_hit_tokens_total",
                 "localinfer_preemptions_total", "localinfer_requests_cancelled_total",
                 "localinfer_time_to_first_token_seconds_bucket", "localinfer_inter_token_latency_seconds_bucket",
                 "localinfer_e2e_request_latency_seconds_bucket"):
        assert f"\n{name}" in text, name
    assert srv.metrics()["localinfer_kv_blocks_total"] == 1024 // 16


@pytest.mark.skipif(os.environ.get("LOCALINFER_EVENT_LOOP") == "asyncio", reason="the standard loop was asked for")
def test_the_server_runs_on_uvloop_where_it_is_installed(http, srv):
    """uvloop (the serve extra) is the event loop when importable: less of the loop's CPU beside llama.cpp."""
    pytest.importorskip("uvloop")
    assert http.get("/health").status_code == 200
    loop = srv.runtime._loop
    assert loop is not None and loop.is_running() and type(loop).__module__.startswith("uvloop"), type(loop)


def test_localinfer_event_loop_values(monkeypatch, caplog):
    from localinfer.serve.http.server import event_loop

    monkeypatch.delenv("LOCALINFER_EVENT_LOOP", raising=False)
    with caplog.at_level(logging.WARNING, logger="localinfer.serve"):
        assert event_loop() == "auto"             # uvicorn's: uvloop where it imports
        for value in ("auto", "uvloop"):
            monkeypatch.setenv("LOCALINFER_EVENT_LOOP", value)
            assert event_loop() == "auto"
        monkeypatch.setenv("LOCALINFER_EVENT_LOOP", "asyncio")
        assert event_loop() == "asyncio"
        assert not caplog.records
        monkeypatch.setenv("LOCALINFER_EVENT_LOOP", "uvlop")
        assert event_loop() == "auto"             # a typo: warned, and the default kept
    assert "uvlop" in caplog.text and "LOCALINFER_EVENT_LOOP" in caplog.text


def test_metrics_scraped_again_show_what_finished_and_what_was_refused_since(http, srv):
    """/metrics renders the request counters again only after they change: each scrape still shows the request
    finished and the request refused since the one before."""
    srv.wait_idle()
    before = srv.metrics()
    assert srv.metrics() == before                          # nothing changed: the same text
    assert http.post(CHAT, json=dict(OK, max_tokens=3, ignore_eos=True)).status_code == 200
    after = srv.wait_idle()
    assert after["localinfer_generation_tokens_total"] - before["localinfer_generation_tokens_total"] == 3
    assert after["localinfer_e2e_request_latency_seconds_count"] - \
        before["localinfer_e2e_request_latency_seconds_count"] == 1
    bad = 'localinfer_requests_rejected_total{status="400"}'
    _error(http.post(CHAT, json=dict(OK, max_tokens=-1)), 400)
    assert srv.metrics().get(bad, 0) - after.get(bad, 0) == 1


def test_gauges_are_published_on_each_change_and_every_publish_s_between(http, srv):
    """The engine thread publishes its gauges when a request is admitted or finishes and when it goes idle, and
    between those at most every PUBLISH_S, not after every step (which cost ~10% of its host work)."""
    from localinfer.serve.http.runtime import PUBLISH_S

    srv.wait_idle()
    metrics, seen = srv.runtime.metrics, []
    publish = metrics.publish
    # the time the engine thread compared with PUBLISH_S (set just before it publishes)
    metrics.publish = lambda values: (seen.append((srv.runtime._published[0], dict(values))), publish(values))
    try:
        steps0 = srv.runtime.executor.steps
        assert http.post(CHAT, json=dict(OK, max_tokens=96, ignore_eos=True)).status_code == 200
        srv.wait_idle()
        steps = srv.runtime.executor.steps - steps0
    finally:
        del metrics.publish                                 # the class's own method again
    busy = [(t, v) for t, v in seen if v["requests_running"]]
    assert busy and busy[0][1]["engine_steps"] <= steps0 + 1   # published at the admission, the first step
    assert seen[-1][1]["requests_running"] == 0 and seen[-1][1]["kv_blocks_used"] == 0
    assert 3 <= len(seen) < steps / 2, (len(seen), steps)   # published between changes, yet not every step
    while_busy = [v["engine_steps"] for _, v in busy]
    assert len(set(while_busy)) == len(while_busy)          # one publish a step at most
    gaps = [b - a for (a, _), (b, _) in zip(busy, busy[1:])]
    assert gaps and min(gaps) >= PUBLISH_S * 0.9 and max(gaps) < PUBLISH_S + 1.0, gaps


def test_disconnect_mid_stream_cancels_and_frees_blocks(srv):
    before = srv.metrics()["localinfer_requests_cancelled_total"]
    body = json.dumps(dict(OK, max_tokens=400, stream=True, ignore_eos=True)).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(65536)
        assert b" 200 " in got.split(b"\r\n")[0]
    deadline = time.monotonic() + 10
    while srv.metrics()["localinfer_requests_cancelled_total"] == before:
        assert time.monotonic() < deadline, "the disconnect was not noticed"
        time.sleep(0.05)
    m = srv.wait_idle()
    assert_only_parked_kv(srv, m)
    assert m["localinfer_generation_tokens_total"] > 0


def test_api_key_guards_everything_but_health(default_model):
    openai = pytest.importorskip("openai")
    srv = LiveServer(default_model, parallel=1, max_queue=0, ctx=256, api_key="s3cret")
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            for path in ("/v1/models", "/metrics"):
                _error(c.get(path), 401, code="invalid_api_key")
                _error(c.get(path, headers={"authorization": "Bearer wrong"}), 401)
                _error(c.get(path, headers={"authorization": "Basic s3cret"}), 401)
                assert c.get(path, headers={"authorization": "Bearer s3cret"}).status_code == 200
            _error(c.post(CHAT, json=OK), 401)
            # with a key too, a name not allowed is refused before the key is looked at
            _error(c.get("/v1/models", headers={"authorization": "Bearer s3cret", "host": "box.lan"}), 403,
                   "host", "host_not_allowed")
        with openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0) as bad, \
                pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with openai.OpenAI(base_url=srv.base_url, api_key="s3cret", max_retries=0) as good:
            assert good.chat.completions.create(**dict(OK, max_tokens=1)).usage.completion_tokens == 1
            s1 = good.chat.completions.create(**dict(OK, max_tokens=200), stream=True, extra_body={"ignore_eos": True})
            next(iter(s1))                                  # --parallel 1 --max-queue 0: the next one is refused
            with pytest.raises(openai.RateLimitError) as e:
                good.chat.completions.create(**OK)
            assert e.value.response.headers["retry-after"].isdigit()
            assert e.value.body["code"] == "queue_full"
            s1.close()
    finally:
        srv.stop()


def test_the_loop_answers_while_a_long_prefill_runs(srv, http):
    """The engine thread computes; the event loop never waits on it: /health, /metrics and a refused request
    all answer while a prompt of ~900 tokens (seconds on one thread) is still being prefilled."""
    import threading

    done = {}

    def long_one():
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            done["status"] = c.post("/v1/completions", json={"model": MODEL_ID, "prompt": "one two three " * 300,
                                                              "max_tokens": 1}).status_code
        done["at"] = time.monotonic()

    start = time.monotonic()
    t = threading.Thread(target=long_one)
    t.start()
    time.sleep(0.3)
    answered = []
    for path in ("/health", "/metrics", "/health"):
        assert http.get(path).status_code == 200
        answered.append(time.monotonic())
    _error(http.post(CHAT, json=dict(OK, temperature=9)), 400, "temperature")
    answered.append(time.monotonic())
    t.join(60)
    assert done["status"] == 200
    if done["at"] - start < 1.0:
        pytest.skip("the prefill took under a second here (an accelerator?): nothing to overlap")
    assert answered[-1] < done["at"], "the loop waited for the prefill"
