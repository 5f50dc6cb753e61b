"""The Ollama face driven by the real `ollama` Python client (issue 32 item 14)."""

from __future__ import annotations

import json

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
    for kw, words in (({"options": {"mirostat": 2}}, "mirostat"), ({"options": {"temperature": 5}}, "temperature")):
        with pytest.raises(ollama.ResponseError) as e:
            oc.chat(model="m", messages=MSG, **kw)
        assert e.value.status_code == 400 and words in e.value.error
    r = httpx.post(srv.url + "/api/chat", json={"model": "m", "messages": "hi"})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(srv.url + "/api/chat", json={"model": "m", "messages": MSG, "format": "yaml"})
    assert r.status_code == 400 and "format" in r.json()["error"]
    r = httpx.post(srv.url + "/api/generate", json={"model": "m", "prompt": "x", "images": ["aGk="]})
    assert r.status_code == 400 and "images" in r.json()["error"]


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}}


@pytest.mark.parametrize("stream", [False, True])
def test_format_json_and_a_schema_on_chat_and_generate(oc, stream):
    # issue 44: litellm's ollama/ and ollama_chat/ and ollama-js send these; a 400 before
    def whole(parts):
        parts = list(parts) if stream else [parts]
        return parts[-1], "".join((p.message.content if hasattr(p, "message") and p.message else p.response) or ""
                                  for p in parts)

    last, text = whole(oc.chat(model="m", messages=MSG, format="json", stream=stream,
                               options={"num_predict": 40, "temperature": 0}))
    assert text.lstrip().startswith("{")
    if last.done_reason == "stop":
        assert isinstance(json.loads(text), dict)
    last, text = whole(oc.generate(model="m", prompt="Name a city.", format=WEATHER, stream=stream,
                                   options={"num_predict": 40, "temperature": 0}))
    if last.done_reason == "stop":
        assert set(json.loads(text)) == {"city"}
    else:
        assert text.lstrip().startswith('{"city": ')


def test_tools_on_chat_in_ollamas_shapes(oc):
    r = oc.chat(model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[TOOL],
                options={"num_predict": 60, "temperature": 0})
    calls = r.message.tool_calls or []
    for c in calls:
        assert c.function.name == "get_weather" and isinstance(c.function.arguments, dict)
    if not calls:
        assert r.message.content
    # a turn with the call and its result, as Ollama's clients send it (no ids: the tool answers the call)
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "content": "12 degrees", "tool_name": "get_weather"}]
    r = oc.chat(model="m", messages=history, tools=[TOOL], options={"num_predict": 20, "temperature": 0})
    assert r.done and (r.message.content or r.message.tool_calls)
    streamed = list(oc.chat(model="m", messages=history, tools=[TOOL], stream=True,
                            options={"num_predict": 20, "temperature": 0}))
    assert streamed[-1].done
