"""Sampling fields over HTTP through the `openai` client: ``seed`` reproduces, ``top_k``/``top_p``/``min_p`` take
effect, the completions logprobs shape, and ``n`` choices streamed."""

from __future__ import annotations

import pytest

from tests.serve.test_http_support import MODEL_ID

openai = pytest.importorskip("openai")

PROMPT = "Write a short poem about the sea."


def _text(client, **kw) -> str:
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": PROMPT}],
                                       **{"max_tokens": 20, "extra_body": {"ignore_eos": True}, **kw})
    return r.choices[0].message.content


def test_seed_reproduces_and_the_truncations_take_effect(client):
    hot = {"temperature": 1.5}
    a = _text(client, seed=7, **hot)
    assert _text(client, seed=7, **hot) == a
    assert any(_text(client, seed=s, **hot) != a for s in (8, 9, 10))     # 20 tokens at T=1.5: not all alike
    greedy = _text(client, temperature=0)
    # each keeps only the likeliest token here, so a hot sampler gives the greedy reply whatever the seed
    assert _text(client, seed=3, top_p=1e-6, **hot) == greedy
    assert _text(client, seed=3, extra_body={"ignore_eos": True, "top_k": 1}, **hot) == greedy
    assert _text(client, seed=3, extra_body={"ignore_eos": True, "min_p": 1.0}, **hot) == greedy


def test_completions_logprobs_have_the_legacy_shape(client):
    r = client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and p <= 0 and max(top.values()) == p and top[tok] == p     # greedy: the likeliest


def test_n_choices_stream_each_to_its_end(client):
    stream = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": PROMPT}],
                                            n=3, temperature=1.0, seed=11, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    texts, reasons = ["", "", ""], [None, None, None]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["length"] * 3 and all(texts)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
