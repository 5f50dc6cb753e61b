"""The load generator behind `bench serve` and benchmarks/serve_load.py: its arithmetic on hand-made results, a
real `localinfer serve` under tiny loads, a stand-in llama-server for /slots, and its typed errors."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from localinfer.errors import RemoteServerError, UsageError
from localinfer.loadgen import load as loadgen
from localinfer.loadgen.load import LoadConfig, Result, render_table, summarise
from localinfer.loadgen.peaks import SLOT_PEAK, slot_tokens

httpx = pytest.importorskip("httpx")

TINY = {"requests": 3, "prompt_tokens": 16, "output_tokens": 8, "poll_s": 0.02, "timeout": 60.0}


def test_summarise_counts_goodput_as_vllm_does():
    results = [Result(True, 200, 0.5, 2.0, 8, [0.1, 0.2]),           # good
               Result(True, 200, 1.5, 2.0, 8, [0.3]),                # TTFT over its SLO
               Result(True, 200, 0.2, 4.0, 8),                       # end-to-end over its SLO
               Result(False, 429, error="queue full"),               # refused
               Result(True, 200, 1.0, 3.0, 8, prompt_tokens=20, cached_tokens=16)]  # on both limits: good
    s = summarise(results, 4.0, slo_ttft=1.0, slo_e2e=3.0)
    assert (s["requests"], s["ok"], s["good"], s["output_tokens"]) == (5, 4, 2, 32)
    assert s["goodput_req_s"] == 0.5 and s["requests_s"] == 1.0 and s["output_tok_s"] == 8.0
    assert s["goodput_req_s"] <= s["requests_s"]
    assert (s["prompt_tokens"], s["cached_tokens"]) == (20, 16)
    assert s["errors"] == ["429 queue full"]
    assert s["ttft_p50_ms"] == 750.0 and s["itl_p50_ms"] == 200.0 and s["e2e_p50_ms"] == 2500.0
    assert s["e2e_p99_ms"] == pytest.approx(3970.0)


def test_summarise_shows_a_freeze_the_percentiles_hide():
    """One stall of 1.2 s among 999 gaps of 30 ms: p99 stays at 30 ms, the p99.9, the largest gap and the
    stalled request's own largest gap show it."""
    steady = [Result(True, 200, 0.1, 3.1, 101, [0.03] * 100) for _ in range(9)]
    stalled = Result(True, 200, 0.1, 4.3, 101, [0.03] * 50 + [1.2] + [0.03] * 49)
    s = summarise(steady + [stalled], 5.0, slo_ttft=1.0, slo_e2e=10.0)
    assert s["itl_p99_ms"] == 30.0 and s["itl_p99.9_ms"] > 30.0 and s["gap_max_ms"] == 1200.0
    assert sorted(s["request_gaps_ms"]) == [30.0] * 9 + [1200.0] and s["request_gap_p50_ms"] == 30.0
    assert "max gap" in render_table({"server": "x", "model": "m", "runs": [
        {**s, "mode": "closed", "concurrency": 4, "peaks": {}}]})


def test_summarise_of_nothing_has_no_percentiles():
    s = summarise([Result(False, 0, error="ConnectError")], 0.0, 1.0, 1.0)
    assert s["ok"] == s["good"] == 0 and s["goodput_req_s"] == 0 and s["ttft_p50_ms"] is None
    assert s["e2e_p95_ms"] is None and s["itl_p99_ms"] is None


def test_slot_tokens_sums_only_processing_slots():
    slots = [{"id": 0, "is_processing": True, "n_prompt_tokens": 300, "next_token": [{"n_decoded": 12}]},
             {"id": 1, "is_processing": False, "n_prompt_tokens": 900, "next_token": [{"n_decoded": 128}]},
             {"id": 2, "is_processing": True, "n_prompt_tokens": 40, "next_token": {"n_decoded": 2}},
             {"id": 3, "is_processing": True}, "junk", {"is_processing": True, "n_prompt_tokens": True}]
    assert slot_tokens(slots) == 354
    assert slot_tokens([]) == 0


def test_prompts_share_exactly_the_prefix_asked_for():
    a = loadgen.prompts(3, 40, 30, seed=1)
    assert len({" ".join(p.split()[:30]) for p in a}) == 1 and len(set(a)) == 3
    assert [p.split()[30] for p in a] == ["0:", "1:", "2:"] and all(len(p.split()) == 41 for p in a)
    assert loadgen.prompts(3, 40, 30, seed=1) == a and loadgen.prompts(3, 40, 0, seed=1)[0].startswith("0: ")


@pytest.mark.parametrize("kw, flag", [({"concurrency": (0,)}, "--concurrency"), ({"rate": (-1.0,)}, "--rate"),
                                      ({"concurrency": (), "rate": ()}, "--concurrency"),
                                      ({"rate": (float("nan"),)}, "--rate"), ({"requests": 0}, "--requests"),
                                      ({"output_tokens": -5}, "--output-tokens"), ({"slo_e2e": 0}, "--slo-e2e"),
                                      ({"deadline_ms": -1}, "--deadline-ms")])
def test_bad_settings_are_usage_errors_naming_the_flag(kw, flag):
    with pytest.raises(UsageError) as e:
        LoadConfig(**kw)
    assert e.value.flag == flag and flag in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/v1", "127.0.0.1:8080/v1", "http:///v1", "http://h:99999/v1",
                                 "http://a b/v1", ""])
def test_check_url_refuses_what_is_not_http(url):
    with pytest.raises(UsageError) as e:
        loadgen.check_url(url)
    assert e.value.flag == "--url"


def test_check_url_and_server_root():
    assert loadgen.check_url("https://host:8443/v1/") == "https://host:8443/v1"
    assert loadgen.server_root("http://127.0.0.1:8080/v1") == "http://127.0.0.1:8080"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_a_remote_server_error():
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(RemoteServerError) as e:
        loadgen.run_load(url, LoadConfig(concurrency=(1,), **TINY))
    assert "cannot reach" in str(e.value) and url in str(e.value) and e.value.hint


class FakeServer:
    """A stdlib stand-in for llama-server: /v1/models, /slots, and streamed /v1/completions with usage."""

    def __init__(self, models=None, slots=None, status=200, hang_up=(), comments=False):
        outer = self
        self.comments = comments                       # answer with SSE keep-alive comments only, never a token
        self.models = {"data": [{"id": "fake"}]} if models is None else models
        self.slots, self.status, self.bodies = slots, status, []
        self.hang_up, self.posts = set(hang_up), 0     # POSTs (0: the warm-up) closed without a byte of answer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, payload, ctype="application/json"):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, outer.models)
                elif self.path == "/slots" and outer.slots is not None:
                    self._send(200, outer.slots)
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.posts += 1
                if outer.posts - 1 in outer.hang_up:
                    self.close_connection = True
                    return
                outer.bodies.append(body)
                if outer.status != 200:
                    return self._send(outer.status, {"error": {"message": "nope"}})
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for _ in range(300 if outer.comments else 0):   # at most 30 s of ': keep-alive'
                    try:
                        self.wfile.write(b": keep-alive\n\n")
                        self.wfile.flush()
                    except OSError:
                        return
                    time.sleep(0.1)
                for _ in range(body["max_tokens"]):
                    self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
                usage = {"prompt_tokens": 10, "completion_tokens": body["max_tokens"],
                         "prompt_tokens_details": {"cached_tokens": 4}}
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_llama_server_slots_are_polled_for_the_peak():
    slots = [{"id": 0, "is_processing": True, "n_prompt_tokens": 100, "next_token": [{"n_decoded": 5}]},
             {"id": 1, "is_processing": True, "n_prompt_tokens": 60, "next_token": [{"n_decoded": 7}]},
             {"id": 2, "is_processing": False, "n_prompt_tokens": 999, "next_token": [{"n_decoded": 9}]}]
    fake = FakeServer(slots=slots)
    try:
        out = loadgen.run_load(fake.url, LoadConfig(concurrency=(2,), rate=(50.0,), extra_body={"min_tokens": 8},
                                                    deadline_ms=5000, **TINY))
    finally:
        fake.close()
    assert out["model"] == "fake"
    for run in out["runs"]:
        assert run["peaks"] == {SLOT_PEAK: 172} and run["ok"] == 3 and run["output_tokens"] == 24
        assert run["cached_tokens"] == 12 and run["prompt_tokens"] == 30 and run["engine"] == {}
    body = fake.bodies[-1]
    assert body["min_tokens"] == 8 and body["ignore_eos"] and body["deadline_ms"] == 5000
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 8


def test_the_timeout_bounds_the_whole_request_not_each_read():
    """Issue 32 item 7: a peer sending keep-alive comments never trips httpx's per-read timeout."""
    import asyncio

    fake = FakeServer(comments=True)
    config = LoadConfig(concurrency=(1,), **dict(TINY, timeout=1.0))

    async def go():
        async with httpx.AsyncClient(base_url=fake.url, timeout=config.timeout) as client:
            return await loadgen.one(client, config, "fake", "hi")
    try:
        r = asyncio.run(asyncio.wait_for(go(), 20))
    finally:
        fake.close()
    assert not r.ok and "--timeout 1" in r.error


def test_a_request_the_server_hung_up_on_before_answering_is_sent_once_more():
    fake = FakeServer(hang_up={1, 3, 4})    # the first request's first send; the third's first and second
    try:
        out = loadgen.run_load(fake.url, LoadConfig(concurrency=(1,), **TINY))
    finally:
        fake.close()
    run = out["runs"][0]
    assert run["ok"] == 2 and run["resent"] == 2 and run["output_tokens"] == 16
    assert run["errors"] == ["0 RemoteProtocolError: Server disconnected without sending a response."]


@pytest.mark.parametrize("models", [{"data": []}, {"object": "list"}, ["x"]])
def test_a_server_listing_no_model_is_refused(models):
    fake = FakeServer(models=models)
    try:
        with pytest.raises(RemoteServerError) as e:
            loadgen.run_load(fake.url, LoadConfig(concurrency=(1,), **TINY))
        assert "lists no model" in str(e.value) and "--model-name" in e.value.hint
        assert loadgen.run_load(fake.url, LoadConfig(concurrency=(1,), model_name="named", **TINY))["model"] == "named"
    finally:
        fake.close()


def test_a_warm_up_the_server_refuses_is_a_remote_server_error():
    fake = FakeServer(status=404)
    try:
        with pytest.raises(RemoteServerError) as e:
            loadgen.run_load(fake.url, LoadConfig(concurrency=(1,), **TINY))
    finally:
        fake.close()
    assert "warm-up" in str(e.value) and "HTTP 404" in str(e.value)


def test_tiny_loads_on_a_real_localinfer_serve(srv):
    seen = []
    out = loadgen.run_load(srv.base_url, LoadConfig(concurrency=(1, 2), rate=(20.0,), **TINY),
                           progress=lambda label, done, total: seen.append((label, done, total)))
    assert out["model"] == "smollm2"
    runs = out["runs"]
    assert [(r["mode"], r.get("concurrency"), r.get("rate_req_s")) for r in runs] == [
        ("closed", 1, None), ("closed", 2, None), ("open", None, 20.0)]
    for r in runs:
        assert r["requests"] == r["ok"] == 3 and r["errors"] == []
        assert r["output_tokens"] == 3 * 8 and r["prompt_tokens"] > 3 * 8
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"]
        assert 0 < r["goodput_req_s"] <= r["requests_s"] and r["good"] <= r["ok"]
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["makespan_s"], rel=0.01)
        assert r["ttft_p50_ms"] <= r["ttft_p95_ms"] <= r["ttft_p99_ms"] <= r["e2e_p99_ms"]
        assert r["itl_p50_ms"] is not None and r["e2e_p50_ms"] > 0
        assert set(r["peaks"]) >= {"localinfer_kv_blocks_used", "localinfer_requests_running"}
        assert r["peaks"]["localinfer_kv_blocks_used"] % 16 == 0 and SLOT_PEAK not in r["peaks"]
        assert r["peaks"]["localinfer_requests_running"] <= 3
        assert r["engine"].get("engine_steps_total", 0) > 0
    assert max(r["peaks"]["localinfer_kv_blocks_used"] for r in runs) > 0
    assert seen[:3] == [("concurrency 1", 1, 3), ("concurrency 1", 2, 3), ("concurrency 1", 3, 3)]
    assert len(seen) == 9 and seen[-1] == ("rate 20/s", 3, 3)
    srv.wait_idle()
    doc = loadgen.document("localinfer", out, {"requests": 3}, loadgen.loadavg())
    assert set(doc) == {"server", "machine", "settings", "model", "runs", "when"}
    assert doc["machine"]["cores"] and json.loads(json.dumps(doc)) == doc
    table = loadgen.render_table(doc).splitlines()
    assert len(table) == 2 + 3 and table[2].split()[0] == "c=1" and table[4].split()[0] == "rate=20"
