"""Parked KV through the server and the real `openai` client: a prompt sent again, and a conversation resent
turn after turn, report the prefix they reuse in ``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

import pytest

from tests.serve.test_http_support import MODEL_ID, assert_only_parked_kv

openai = pytest.importorskip("openai")

P = 16
GREEDY = {"temperature": 0, "max_tokens": 8}


def test_the_same_prompt_twice_in_a_row_is_cached_the_second_time(client, srv):
    msgs = [{"role": "system", "content": "You answer in one word. " * 6},
            {"role": "user", "content": "Which ocean is the largest? Think of the map of the world."}]
    before = srv.metrics()["localinfer_prefix_cache_hit_tokens_total"]
    first = client.chat.completions.create(model=MODEL_ID, messages=msgs, **GREEDY)
    second = client.chat.completions.create(model=MODEL_ID, messages=msgs, **GREEDY)
    n = first.usage.prompt_tokens
    assert second.usage.prompt_tokens == n
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // P * P > 0      # all but the last block
    hits = srv.metrics()["localinfer_prefix_cache_hit_tokens_total"] - before
    assert hits == first.usage.prompt_tokens_details.cached_tokens + second.usage.prompt_tokens_details.cached_tokens
    m = srv.wait_idle()
    assert m["localinfer_kv_blocks_cached"] > 0
    assert_only_parked_kv(srv, m, P)     # the parked request's blocks, in host memory


def test_a_multi_turn_conversation_reuses_the_previous_turn(client):
    msgs = [{"role": "system", "content": "You are a patient tutor of geography. Keep answers short."},
            {"role": "user", "content": "Name the longest river in Africa, and say where it ends."}]
    one = client.chat.completions.create(model=MODEL_ID, messages=msgs, **GREEDY)
    msgs += [{"role": "assistant", "content": one.choices[0].message.content},
             {"role": "user", "content": "And the longest river in South America?"}]
    two = client.chat.completions.create(model=MODEL_ID, messages=msgs, **GREEDY)
    covered = one.usage.prompt_tokens // P * P
    assert two.usage.prompt_tokens > one.usage.prompt_tokens
    assert covered <= two.usage.prompt_tokens_details.cached_tokens < two.usage.prompt_tokens
    assert two.usage.prompt_tokens_details.cached_tokens % P == 0
    msgs += [{"role": "assistant", "content": two.choices[0].message.content},
             {"role": "user", "content": "Which of the two is longer?"}]
    three = client.chat.completions.create(model=MODEL_ID, messages=msgs, **GREEDY)
    assert three.usage.prompt_tokens_details.cached_tokens >= two.usage.prompt_tokens // P * P


def test_prefix_cache_off_parks_nothing(default_model):
    from tests.serve.test_http_support import LiveServer

    srv = LiveServer(default_model, parallel=2, max_queue=2, ctx=512, prefix_cache=False)
    try:
        assert srv.runtime.engine.park_slots == 0 and srv.runtime.executor.n_slots == 2
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            msgs = [{"role": "user", "content": "Name a colour that is also a fruit, please."}]
            c.chat.completions.create(model=MODEL_ID, messages=msgs, **GREEDY)
            again = c.chat.completions.create(model=MODEL_ID, messages=msgs, **GREEDY)
        assert again.usage.prompt_tokens_details.cached_tokens == 0
        m = srv.wait_idle()
        assert m["localinfer_kv_blocks_cached"] == 0 and m["localinfer_kv_cells_used"] == 0
        assert m["localinfer_kv_host_tokens"] == 0
    finally:
        srv.stop()


def test_parked_kv_in_host_memory_outlives_the_cells(default_model):
    """256 cells (16 blocks: llama.cpp pads the 128 asked for) and eight prompts of 3 whole blocks each: their
    parked KV (24 blocks) stays in host memory past what the cells hold, so each prompt sent again is served from
    it (a pool the size of the cells kept about four, and the LRU evicted each before its turn came round)."""
    from tests.serve.test_http_support import LiveServer

    srv = LiveServer(default_model, parallel=1, max_queue=4, ctx=128)
    try:
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            def send(i):
                return c.completions.create(model=MODEL_ID, prompt=f"Story {i}: " + "the cat sat on a mat " * 8,
                                            max_tokens=4, temperature=0, extra_body={"ignore_eos": True}).usage

            first = [send(i) for i in range(8)]
            again = [send(i) for i in range(8)]
        assert all(u.prompt_tokens > 3 * P and u.prompt_tokens_details.cached_tokens < P for u in first)
        assert [u.prompt_tokens_details.cached_tokens for u in again] == [(u.prompt_tokens - 1) // P * P
                                                                         for u in again]
        m = srv.wait_idle()
        assert m["localinfer_kv_blocks_cached"] == 8 * 3 > m["localinfer_kv_blocks_total"] == 256 // P
        assert m["localinfer_kv_sequences_parked"] == 8      # a resend that kept nothing new took no second id
        assert_only_parked_kv(srv, m, P)
    finally:
        srv.stop()
