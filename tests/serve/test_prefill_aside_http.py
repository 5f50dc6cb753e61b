"""The second context for lone prompts in a live server (on by default on the CPU): a prompt that arrives while another
reply streams is computed in the second context and copied in, both replies are whole, and /metrics shows the second
context's prompts and bytes."""

from __future__ import annotations

import json
import threading

import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer

httpx = pytest.importorskip("httpx")


def test_a_prompt_beside_a_streaming_reply_goes_aside_and_metrics_show_it(default_model, monkeypatch):
    monkeypatch.delenv("LOCALINFER_PREFILL_ASIDE", raising=False)        # the default
    srv = LiveServer(default_model, parallel=2, max_queue=2, ctx=1024, prefix_cache=False)
    try:
        m = srv.metrics()
        assert m["localinfer_prefill_aside_bytes"] > 0 and m["localinfer_prefill_aside_prompts_total"] == 0
        first, second = {}, {}
        streaming = threading.Event()

        def stream():
            body = {"model": MODEL_ID, "prompt": "Count: one two three", "max_tokens": 48, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
            with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=120) as r:
                first["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            first["tokens"] = event["usage"]["completion_tokens"]
                        streaming.set()

        t = threading.Thread(target=stream)
        t.start()
        assert streaming.wait(60)                 # the first reply holds cells and decodes
        prompt = " ".join(f"item {i}," for i in range(60))       # well over 64 tokens: the tiled kernel's
        r = httpx.post(srv.base_url + "/completions", timeout=120,
                       json={"model": MODEL_ID, "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
                             "temperature": 0})
        t.join(120)
        second["status"], second["usage"] = r.status_code, r.json()["usage"]
        assert first == {"status": 200, "tokens": 48} and second["status"] == 200
        assert second["usage"]["completion_tokens"] == 8 and second["usage"]["prompt_tokens"] >= 64
        m = srv.wait_idle()
        assert m["localinfer_prefill_aside_prompts_total"] >= 1 and m["localinfer_prefill_aside_fallbacks_total"] == 0
        assert 0 < m["localinfer_prefill_aside_seconds_total"] <= m["localinfer_engine_decode_seconds_total"]
    finally:
        srv.stop()


def test_turned_off_no_second_context(default_model, monkeypatch):
    monkeypatch.setenv("LOCALINFER_PREFILL_ASIDE", "0")
    srv = LiveServer(default_model, parallel=2, max_queue=2, ctx=512, prefix_cache=False)
    try:
        assert srv.metrics()["localinfer_prefill_aside_bytes"] == 0
    finally:
        srv.stop()
