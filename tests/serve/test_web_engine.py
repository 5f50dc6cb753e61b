"""The engine view in headless Chromium during a burst of 16 requests (4 slots, 8 queued, so 4 are refused with
429): what the page shows is what /metrics exports, its KV grid adds up to the blocks in use, each step's
batch stays within the budget, and once idle every number equals /metrics'."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer
from tests.support.browser import chromium, wait_for

SYSTEM = ("You are a concise assistant for a cooking school. Answer in one short sentence, and never use lists "
          "or headings in the answer.")                                     # a shared prefix: shared blocks
TOPICS = ["bread", "rice", "soup", "eggs", "pasta", "tea", "salad", "beans", "cake", "fish", "curry", "pie",
          "tofu", "jam", "corn", "stew"]


@pytest.fixture(scope="module")
def server(default_model):
    s = LiveServer(default_model, parallel=4, max_queue=8, ctx=2048, token_budget=128)
    yield s
    s.stop()


def _burst(server, statuses: list) -> list[threading.Thread]:
    def one(topic):
        r = httpx.post(server.base_url + "/chat/completions", timeout=120, json={
            "model": MODEL_ID, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"How to cook {topic}?"}]})
        statuses.append(r.status_code)
    threads = [threading.Thread(target=one, args=(t,)) for t in TOPICS]
    for t in threads:
        t.start()
    return threads


def _shown(page) -> dict:
    return page.evaluate("""() => {
        const n = (id) => Number(document.getElementById(id).textContent.replace(/[^0-9.]/g, ''));
        const g = LI.engine.gridCounts;
        return {used: n('s-used'), running: n('s-running'), waiting: n('s-waiting'), steps: n('s-steps'),
                held: g.held, shared: g.shared, parked: g.parked, cached: g.cached, free: g.free,
                reasons: document.getElementById('reasons').textContent, polls: LI.engine.polls,
                state: LI.engine.last};
    }""")


def test_the_engine_view_follows_a_burst_with_the_numbers_of_metrics(server):
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url + "/engine", timeout=20_000)
        wait_for(page, "() => window.LI && LI.engine && LI.engine.polls >= 1", 15)
        before = server.metrics()
        statuses: list[int] = []
        threads = _burst(server, statuses)
        busy, multi = [], 0
        try:
            deadline = time.monotonic() + 60
            while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
                polls = page.evaluate("() => LI.engine.polls")
                wait_for(page, f"() => LI.engine.polls > {polls}", 5)
                shown = _shown(page)
                snap = shown["state"]["snapshot"]
                m = snap["metrics"]
                # the page's numbers are the snapshot's /metrics samples, and its grid adds up to them
                assert shown["used"] == m["localinfer_kv_blocks_used"] == snap["pool"]["used"]
                assert shown["held"] + shown["shared"] == snap["pool"]["used"]
                assert shown["parked"] + shown["cached"] == m["localinfer_kv_blocks_cached"]
                assert shown["running"] == m["localinfer_requests_running"] == snap["running"] <= 4
                assert shown["waiting"] == m["localinfer_requests_waiting"] == snap["waiting"]
                assert shown["steps"] == m["localinfer_engine_steps_total"]
                assert [r["state"] for r in snap["requests"]] == ["running"] * snap["running"] + ["waiting"] * snap["waiting"]
                for step in snap["steps"]:
                    assert step["tokens"] == sum(c["tokens"] for c in step["chunks"]) <= step["budget"] == 128
                    multi = max(multi, len(step["chunks"]))
                now = server.metrics()                       # a scrape after the snapshot: counters only grew
                assert now["localinfer_engine_steps_total"] >= m["localinfer_engine_steps_total"]
                if snap["running"]:
                    busy.append(shown)
        finally:
            for t in threads:
                t.join(120)
        assert busy and max(s["running"] for s in busy) >= 2 and multi >= 2     # batches of several requests
        assert max(s["shared"] for s in busy) > 0                               # the system prompt's blocks, shared
        ok, refused = statuses.count(200), statuses.count(429)
        assert ok + refused == 16 and ok >= 12
        m = server.wait_idle(20)
        # idle: the page catches up, and then every number it holds equals /metrics
        wait_for(page, f"() => LI.engine.last.snapshot.metrics.localinfer_engine_steps_total === "
                       f"{m['localinfer_engine_steps_total']}", 10)
        shown = _shown(page)
        snap = shown["state"]["snapshot"]
        for name, value in m.items():
            if "_bucket" not in name:
                assert snap["metrics"][name] == value, name
        assert shown["used"] == shown["running"] == 0 and shown["steps"] == m["localinfer_engine_steps_total"]
        rejected = m.get('localinfer_requests_rejected_total{status="429"}', 0)
        assert rejected - before.get('localinfer_requests_rejected_total{status="429"}', 0) == refused
        if refused:
            assert f"HTTP 429 {rejected:g}" in shown["reasons"]
        done = [f for f in snap["finished"] if f["reason"] in ("stop", "length")]
        assert len(done) >= ok and snap["counts"]["admissions"] >= ok
        hit = m["localinfer_prefix_cache_hit_tokens_total"] / m["localinfer_prompt_tokens_total"]
        assert page.evaluate("() => document.getElementById('s-hit').textContent") == f"{100 * hit:.1f}%"
