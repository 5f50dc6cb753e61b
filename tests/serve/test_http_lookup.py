"""`localinfer serve --lookup`: drafts verified inside the server's steps, through the real `openai` client.

A greedy request gives the same text with drafts as the session's plain server
(1 thread, flash attention on, one request at a time), the drafts are counted
in /metrics, and several streams at once still end with every block returned.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer, shared

openai = pytest.importorskip("openai")

COPY = ("Copy the list exactly.\nList: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon.\n"
        "Copy: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon.\n"
        "List: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon.\nCopy:")


@pytest.fixture(scope="module")
def lookup_srv(default_model):
    srv = LiveServer(default_model, draft_max=6)
    yield srv
    srv.stop()


def _complete(srv, prompt, **kw):
    with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        return c.completions.create(model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=40, **kw)


def test_greedy_text_with_drafts_equals_the_plain_server(lookup_srv, default_model, request):
    plain = _complete(shared(default_model, request.config), COPY)
    spec = _complete(lookup_srv, COPY)
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    m = lookup_srv.wait_idle()
    assert 0 < m["localinfer_spec_accepted_tokens_total"] <= m["localinfer_spec_draft_tokens_total"]


def test_concurrent_streams_with_drafts_finish_and_return_their_blocks(lookup_srv):
    async def one(c, i):
        stream = await c.completions.create(model=MODEL_ID, prompt=COPY + f" {i}", temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        async for ev in stream:
            text += "".join(ch.text for ch in ev.choices)
            usage = ev.usage or usage
        return text, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=lookup_srv.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(one(c, i) for i in range(4)))

    results = asyncio.run(main())
    assert all(text and usage.completion_tokens == 24 for text, usage in results)
    assert lookup_srv.wait_idle()["localinfer_kv_blocks_used"] == 0
