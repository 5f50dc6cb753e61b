"""What clients nobody here wrote expect (issue 32 items 9-11): paths without /v1, any model name with one model
loaded, models.retrieve, several prompts in one completions request, echo and logit_bias — driven by the `openai`
client where it can send them."""

from __future__ import annotations

import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

MSG = [{"role": "user", "content": "Name a colour."}]


def test_any_model_name_is_served_and_the_reply_names_the_real_one(client):
    for name in ("gpt-3.5-turbo", "gpt-4o-mini", "x" * 300):
        r = client.chat.completions.create(model=name, messages=MSG, max_tokens=2, temperature=0)
        assert r.model == MODEL_ID and r.usage.completion_tokens == 2
    assert client.models.retrieve("gpt-3.5-turbo").id == "gpt-3.5-turbo"
    card = client.models.retrieve(MODEL_ID)
    assert card.id == MODEL_ID and card.owned_by == "localinfer"


def test_no_model_name_is_the_loaded_model(srv):
    """llama-server's own clients (and its test suite) send no model at all."""
    for path, body in (("/v1/chat/completions", {"messages": MSG}), ("/completions", {"prompt": "Hi"}),
                       ("/v1/embeddings", {"input": "Hi"})):
        for model in ({}, {"model": None}):
            r = httpx.post(srv.url + path, json={**body, **model, "max_tokens": 2}, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == MODEL_ID, r.text


def test_strict_model_names_answer_404_without_echoing_a_huge_name(default_model):
    srv = LiveServer(default_model, parallel=1, max_queue=1, ctx=256, app={"strict_model_names": True,
                                                                            "aliases": ("house",)})
    try:
        with openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0) as c:
            with pytest.raises(openai.NotFoundError) as e:
                c.chat.completions.create(model="y" * 1_000_000, messages=MSG, max_tokens=1)
            assert e.value.body["code"] == "model_not_found" and len(e.value.body["message"]) < 200
            with pytest.raises(openai.NotFoundError):
                c.models.retrieve("gpt-3.5-turbo")
            assert c.chat.completions.create(model="house", messages=MSG, max_tokens=1).model == MODEL_ID
    finally:
        srv.stop()


def test_paths_without_v1(srv):
    with openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0) as c:     # as llama-server serves them
        assert c.models.list().data[0].id == MODEL_ID
        assert c.chat.completions.create(model="m", messages=MSG, max_tokens=2).usage.completion_tokens == 2
        assert c.completions.create(model="m", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_a_list_of_prompts_gives_a_choice_per_prompt_and_n(client):
    """LangChain's OpenAI.batch/generate pack prompts in one request: each prompt's greedy reply is the one it
    gets alone, choice p * n + j is prompt p's j-th."""
    prompts = ["The capital of France is", "One, two, three,", "def add(a, b):"]
    alone = [client.completions.create(model="m", prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    r = client.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for t in alone for _ in range(2)]
    assert r.usage.completion_tokens == 36
    stream = client.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=0, stream=True)
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == alone


def test_echo(client):
    r = client.completions.create(model="m", prompt="The sky is", max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model="m", prompt="The sky is", max_tokens=4, temperature=0)
    assert r.choices[0].text == "The sky is" + plain.choices[0].text
    chunks = client.completions.create(model="m", prompt="The sky is", max_tokens=4, temperature=0, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_logit_bias_favours_and_bans_tokens(client, srv):
    tok = srv.runtime.tokenizer
    blue = tok.tokenize(" blue", add_bos=False, special=False)[0]
    r = client.completions.create(model="m", prompt="The sky is", max_tokens=3, temperature=0,
                                  logit_bias={str(blue): 100})
    assert r.choices[0].text == tok.token_bytes(blue).decode() * 3
    plain = client.completions.create(model="m", prompt="The sky is", max_tokens=1, temperature=0, logprobs=0)
    greedy = tok.tokenize(plain.choices[0].text, add_bos=False, special=False)[0]
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=1, temperature=0)
    banned = client.completions.create(model="m", prompt="The sky is", max_tokens=1, temperature=0,
                                       logit_bias={str(greedy): -100})
    assert banned.choices[0].text != plain.choices[0].text and r.usage.completion_tokens == 1
