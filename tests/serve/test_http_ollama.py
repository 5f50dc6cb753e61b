"""The Ollama face driven by the real `ollama` Python client (issue 32 item 14)."""

from __future__ import annotations

import pytest

from tests.serve.test_http_support import MODEL_ID

ollama = pytest.importorskip("ollama")
httpx = pytest.importorskip("httpx")

MSG = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def oc(srv):
    return ollama.Client(host=srv.url, timeout=60)


def test_chat_whole_and_streamed_match_the_openai_face(oc, client):
    r = oc.chat(model="llama3.2", messages=MSG, options=GREEDY, stream=False)
    assert r.done and r.done_reason == "length" and r.message.role == "assistant"
    assert r.eval_count == 6 and r.prompt_eval_count > 5 and r.total_duration >= r.eval_duration > 0
    same = client.chat.completions.create(model="m", messages=MSG, max_tokens=6, temperature=0)
    assert r.message.content == same.choices[0].message.content
    parts = list(oc.chat(model="llama3.2", messages=MSG, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert "".join(p.message.content for p in parts) == r.message.content


def test_generate_with_the_template_raw_and_streamed(oc, client):
    r = oc.generate(model="m", prompt="Name a colour.", options=GREEDY)
    chat = oc.chat(model="m", messages=MSG, options=GREEDY)
    assert r.response == chat.message.content and r.done
    raw = oc.generate(model="m", prompt="The capital of France is", raw=True, options=GREEDY)
    plain = client.completions.create(model="m", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert raw.response == plain.choices[0].text
    streamed = "".join(p.response for p in oc.generate(model="m", prompt="The capital of France is", raw=True,
                                                       options=GREEDY, stream=True))
    assert streamed == raw.response
    stop = oc.generate(model="m", prompt="One, two, three,", raw=True, options={"temperature": 0, "stop": [","]})
    assert "," not in stop.response and stop.done_reason == "stop"
    assert oc.generate(model="m", prompt="").done_reason == "load"


def test_list_show_ps_version_and_embed(oc, srv):
    models = oc.list().models
    assert len(models) == 1 and models[0].model == f"{MODEL_ID}:latest" and models[0].details.format == "gguf"
    assert models[0].size > 1_000_000 and models[0].details.quantization_level
    shown = oc.show(models[0].model)
    assert "{%" in shown.template and shown.modelinfo["general.architecture"] == "llama"
    assert oc.ps().models[0].model == f"{MODEL_ID}:latest"
    assert httpx.get(srv.url + "/api/version").json()["version"]
    e = oc.embed(model="m", input=["a cat", "a dog"])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) >= 64
    old = oc.embeddings(model="m", prompt="a cat")
    assert max(abs(a - b) for a, b in zip(old.embedding, e.embeddings[0])) < 2e-3


def test_what_the_server_cannot_do_is_a_400_in_ollamas_shape(oc, srv):
    for kw, words in (({"format": "json"}, "format"), ({"options": {"mirostat": 2}}, "mirostat"),
                      ({"options": {"temperature": 5}}, "temperature")):
        with pytest.raises(ollama.ResponseError) as e:
            oc.chat(model="m", messages=MSG, **kw)
        assert e.value.status_code == 400 and words in e.value.error
    r = httpx.post(srv.url + "/api/chat", json={"model": "m", "messages": "hi"})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(srv.url + "/api/generate", json={"model": "m", "prompt": "x", "images": ["aGk="]})
    assert r.status_code == 400 and "images" in r.json()["error"]
