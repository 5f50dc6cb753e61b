"""A bounded soak: a few hundred small requests with random early disconnects and cancels, then a burst
over the queue limit.  It must end with zero blocks and cells in use, zero 5xx, and the server answering."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer, assert_only_parked_kv

httpx = pytest.importorskip("httpx")

N_REQUESTS = 300
CONCURRENCY = 10
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def _path(body: dict) -> str:
    return CHAT if "messages" in body else TEXT


def _body(i: int, rng: random.Random, **kw) -> dict:
    """Mostly short completions (prefill is the cost on two cores), every fourth a chat request."""
    if i % 4 == 0:
        text = {"messages": [{"role": "user", "content": f"Question {i}: name a number."}]}
    else:
        text = {"prompt": f"{i} plus one is"}
    return {"model": MODEL_ID, **text, "max_tokens": rng.randint(1, 6), "temperature": 0.7, "seed": i, **kw}


async def _one(c, i: int, rng: random.Random, seen: Counter) -> None:
    kind = rng.random()
    if kind < 0.3:                                       # stream, then hang up after the first event
        body = _body(i, rng, stream=True, max_tokens=40, ignore_eos=True)
        async with c.stream("POST", _path(body), json=body) as r:
            seen[r.status_code] += 1
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        seen["disconnected"] += 1
    elif kind < 0.45:                                    # give up while queued or prefilling
        body = _body(i, rng, max_tokens=30, ignore_eos=True)
        task = asyncio.ensure_future(c.post(_path(body), json=body))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        if task.done():
            seen[task.result().status_code] += 1
        else:
            task.cancel()
            seen["cancelled"] += 1
            await asyncio.gather(task, return_exceptions=True)
    elif kind < 0.7:                                     # stream to the end
        body = _body(i, rng, stream=True)
        async with c.stream("POST", _path(body), json=body) as r:
            seen[r.status_code] += 1
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert r.status_code != 200 or lines[-1] == "data: [DONE]"
            seen["stream errors"] += sum("error" in json.loads(ln[6:]) for ln in lines[:-1])   # a 500 inside a 200
    else:
        body = _body(i, rng)
        r = await c.post(_path(body), json=body)
        seen[r.status_code] += 1
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_soak_with_disconnects_cancels_and_a_burst(default_model):
    srv = LiveServer(default_model, parallel=4, max_queue=8, ctx=1024)
    try:
        seen: Counter = Counter()

        async def main():
            rng = random.Random(15)
            sem = asyncio.Semaphore(CONCURRENCY)
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                async def bounded(i):
                    async with sem:
                        await _one(c, i, rng, seen)
                await asyncio.gather(*(bounded(i) for i in range(N_REQUESTS)))
                for _ in range(600):                 # the engine drops the last hung-up requests (the door now
                    if srv.runtime.outstanding == 0:  # counts what is outstanding as a request arrives)
                        break
                    await asyncio.sleep(0.05)
                burst = await asyncio.gather(*(c.post(TEXT, json=_body(1 + 4 * i, rng, max_tokens=32, ignore_eos=True))
                                               for i in range(30)))
            return burst

        burst = asyncio.run(main())
        codes = Counter(r.status_code for r in burst)
        assert codes[200] >= 12 and codes[429] >= 1 and codes[200] + codes[429] == 30, codes   # 4 + 8 held
        assert all(r.headers["retry-after"].isdigit() for r in burst if r.status_code == 429)
        assert all(r.json()["error"]["code"] == "queue_full" for r in burst if r.status_code == 429)
        assert not any(isinstance(k, int) and k >= 500 for k in seen) and not seen["stream errors"], seen
        assert seen["disconnected"] > 50 and seen["cancelled"] > 5, seen
        m = srv.wait_idle(timeout=30)
        assert_only_parked_kv(srv, m)
        assert m["localinfer_kv_compactions_total"] > 0     # cells compacted under this churn, and nothing lost
        assert m["localinfer_requests_cancelled_total"] >= seen["disconnected"] // 2
        assert m.get('localinfer_requests_finished_total{reason="error"}', 0) == 0
        assert not any(k.startswith('localinfer_requests_rejected_total{status="5') for k in m), \
            {k: v for k, v in m.items() if "rejected" in k}
        r = httpx.post(srv.url + CHAT, json=_body(0, random.Random(0), temperature=0), timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    finally:
        srv.stop()


def test_kv_pressure_preempts_and_every_request_still_finishes(default_model):
    """Four requests whose KV cannot all fit (ctx 128 = 8 blocks): the newest is preempted and recomputed."""
    srv = LiveServer(default_model, parallel=4, max_queue=4, ctx=128)
    try:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                bodies = [{"model": MODEL_ID, "prompt": f"Story {i}: once upon a time", "max_tokens": 60,
                           "temperature": 0, "ignore_eos": True} for i in range(4)]
                return await asyncio.gather(*(c.post(TEXT, json=b) for b in bodies))

        replies = asyncio.run(main())
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        assert all(r.json()["usage"]["completion_tokens"] == 60 for r in replies)
        assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in replies)
        m = srv.wait_idle()
        assert m["localinfer_preemptions_total"] > 0
        assert m["localinfer_kv_compactions_total"] > 0     # preempted cells freed, the rest compacted
        assert_only_parked_kv(srv, m)
    finally:
        srv.stop()
