"""`localinfer serve` through the real `openai` client: sync and async, streaming and not, 8 at once, typed errors."""

from __future__ import annotations

import asyncio

import pytest

from tests.serve.test_http_support import MODEL_ID, assert_only_parked_kv

openai = pytest.importorskip("openai")

PROMPTS = ["Name a colour.", "What is 2 + 2?", "Say hello in French.", "Name a fruit.", "What is the capital of Italy?",
           "Write one word.", "Name a planet.", "Count to three."]
GREEDY = {"temperature": 0, "max_tokens": 12}


def _chat(client, text, **kw):
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": text}],
                                          **{**GREEDY, **kw})


def test_models_lists_the_served_model(client, srv):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_ID]


def test_chat_non_streaming_has_usage_and_finish_reason(client):
    r = _chat(client, PROMPTS[0])
    assert r.object == "chat.completion" and r.model == MODEL_ID
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    cached = u.prompt_tokens_details.cached_tokens      # the template's default system prompt: parked by earlier chats
    assert cached % 16 == 0 and 0 <= cached < u.prompt_tokens


def test_streaming_equals_non_streaming_and_include_usage(client):
    # a reply computed after a prefix-cache hit may differ at a near tie from a cold one (other kernels for
    # the suffix), so both compared requests start from the same hit: a first send puts the prompt in the cache
    _chat(client, PROMPTS[1])
    whole = _chat(client, PROMPTS[1])
    chunks = list(_chat(client, PROMPTS[1], stream=True, stream_options={"include_usage": True}))
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached == whole.usage.prompt_tokens_details.cached_tokens > 0
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_stream_and_text_parts(client, srv):
    r = client.completions.create(model=MODEL_ID, prompt="The capital of France is", **GREEDY)
    assert r.object == "text_completion" and r.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_ID, prompt="The capital of France is", stream=True, **GREEDY) if c.choices)
    assert streamed == r.choices[0].text
    prompts = []
    submit = srv.runtime.submit
    srv.runtime.submit = lambda ps, *a, **kw: prompts.extend(ps) or submit(ps, *a, **kw)
    try:
        parts = client.chat.completions.create(model=MODEL_ID, messages=[
            {"role": "system", "content": [{"type": "text", "text": "You are brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}],
            **GREEDY)
        plain = client.chat.completions.create(model=MODEL_ID, messages=[
            {"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}], **GREEDY)
    finally:
        del srv.runtime.submit
    # the same prompt tokens (not compared by reply: plain's prefix is parts' parked KV, whose cells a unified
    # cache may hold in another order than a fresh prefill, so a near tie can flip; docs/serving.md)
    assert len(prompts) == 2 and prompts[0] == prompts[1]
    assert plain.usage.prompt_tokens_details.cached_tokens == (len(prompts[0]) - 1) // 16 * 16
    assert parts.choices[0].message.content and plain.choices[0].message.content


def test_stop_string_cuts_the_reply(client):
    full = client.completions.create(model=MODEL_ID, prompt="1, 2, 3, 4,", temperature=0, max_tokens=16)
    text = full.choices[0].text
    word = text.strip().split()[1]                      # a word well inside the greedy reply
    cut = text[:text.index(word)]
    r = client.completions.create(model=MODEL_ID, prompt="1, 2, 3, 4,", temperature=0, max_tokens=16, stop=[word])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL_ID, prompt="1, 2, 3, 4,", temperature=0, max_tokens=16,
                                              stop=word, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_ignore_eos_logprobs_and_n(client):
    r = _chat(client, "Say OK.", max_tokens=24, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    r = _chat(client, PROMPTS[3], logprobs=True, top_logprobs=2)
    entries = r.choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert all(e.top_logprobs[0].logprob == e.logprob for e in entries)     # greedy takes the likeliest
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    two = _chat(client, PROMPTS[2], n=2, temperature=0.9, seed=5)
    assert [c.index for c in two.choices] == [0, 1]


def test_eight_concurrent_async_requests(srv):
    """Eight at once over four slots, half streaming: every reply whole, every slot and block back.

    (Not compared token for token with each prompt alone: llama.cpp's logits for a prompt prefilled in one
    batch with another differ from alone by up to ~1 here even at one thread with flash attention.)
    """
    async def main():
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60) as ac:
            async def one(i, p):
                msgs = [{"role": "user", "content": p}]
                if i % 2:
                    stream = await ac.chat.completions.create(model=MODEL_ID, stream=True, messages=msgs,
                                                              stream_options={"include_usage": True}, **GREEDY)
                    chunks = [c async for c in stream]
                    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                    return text, chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens
                r = await ac.chat.completions.create(model=MODEL_ID, messages=msgs, **GREEDY)
                return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    results = asyncio.run(main())
    assert len(results) == 8
    for text, reason, n in results:
        assert text and reason in ("stop", "length") and 1 <= n <= GREEDY["max_tokens"]
    m = srv.wait_idle()
    assert_only_parked_kv(srv, m)


def test_shared_prefix_is_reported_as_cached(client, srv):
    system = "You are a careful assistant. " * 30
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]
    before = srv.metrics()["localinfer_prefix_cache_hit_tokens_total"]
    stream = client.chat.completions.create(model=MODEL_ID, messages=msgs("Tell a story."), temperature=0,
                                            max_tokens=200, extra_body={"ignore_eos": True}, stream=True)
    next(iter(stream))                                  # the first request holds the prefix while the second arrives
    second = client.chat.completions.create(model=MODEL_ID, messages=msgs("Name a colour."), **GREEDY)
    stream.close()                                      # hanging up cancels the first
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 128 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert srv.metrics()["localinfer_prefix_cache_hit_tokens_total"] - before == cached


def test_errors_are_the_clients_typed_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "hi", temperature=5)
    assert e.value.body["param"] == "temperature" and "between 0 and 2" in e.value.body["message"]
    # any model name is served with one model loaded (issue 32); --strict-model-names: test_http_clients.py
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "hi " * 50, max_tokens=1000)
    msg = e.value.body["message"]
    assert e.value.body["code"] == "context_length_exceeded" and "1000" in msg and "1024" in msg
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "hi", n=0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.RateLimitError) as e:
        _chat(client, "hi " * 300, max_tokens=400, extra_body={"deadline_ms": 1})
    assert e.value.body["code"] == "deadline_unmeetable"
    assert _chat(client, "hi").choices[0].message.content is not None      # still serving


def test_concurrent_greedy_requests_equal_each_alone(default_model):
    """Four greedy completions at once give, token for token, what each gives alone (one thread, flash attention;
    prompts under one 16-token block, so nothing comes from the prefix cache, and under 64 rows together).
    Its own server without decode-only steps between prompts (``decode_share`` 0): a near-tie in these answers
    flips with where a sequence's KV cells fall among the others', and those steps move them
    (benchmarks/results/serve_decode_share_cpu.txt)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.serve.test_http_support import LiveServer

    prompts = ["The sky is", "My favourite food is", "Once there was a", "Paris is the capital of"]

    def one(p):
        return client.completions.create(model=MODEL_ID, prompt=p, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    srv = LiveServer(default_model, decode_share=0.0)
    try:
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60) as client:
            alone = [one(p) for p in prompts]
            with ThreadPoolExecutor(len(prompts)) as pool:
                together = list(pool.map(one, prompts))
    finally:
        srv.stop()
    assert together == alone and len(set(alone)) == len(alone)
