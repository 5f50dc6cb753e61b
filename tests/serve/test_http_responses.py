"""/v1/responses through the `openai` client: text in and out, the streaming events, previous_response_id and the
bounded store (issue 32 item 13)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def test_a_response_matches_the_chat_reply(client):
    r = client.responses.create(model="gpt-4o-mini", input="Name a colour.", max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=6, temperature=0)
    assert r.output_text == chat.choices[0].message.content and r.model == "smollm2"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_streaming_events_in_order(client):
    kinds, deltas = [], []
    with client.responses.stream(model="m", input="Name a colour.", max_output_tokens=6, temperature=0) as s:
        for e in s:
            kinds.append(e.type)
            if e.type == "response.output_text.delta":
                deltas.append(e.delta)
            last = e
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]                  # cut by max_output_tokens, as OpenAI says it
    assert "".join(deltas) == last.response.output_text and deltas
    with client.responses.stream(model="m", input="Say hi.", max_output_tokens=200, temperature=0) as s:
        final = s.get_final_response()                           # ended by the model: response.completed
    assert final.status == "completed" and final.output_text


def test_previous_response_id_continues_the_conversation(client, srv):
    first = client.responses.create(model="m", input=[{"role": "user", "content": "My name is Ada."}],
                                    instructions="Answer briefly.", max_output_tokens=5, temperature=0)
    second = client.responses.create(model="m", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)
    history = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    chat = client.chat.completions.create(model="m", messages=history, max_tokens=5, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens      # the first's instructions are not carried
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id="resp_nope", max_output_tokens=1)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model="m", input="x", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_is_bounded():
    from localinfer.serve.http.responses_api import Store

    s = Store(max_items=3, max_chars=100)
    for i in range(5):
        s.put({"id": f"r{i}"}, [{"role": "user", "content": "x" * 10}])
    assert list(s.items) == ["r2", "r3", "r4"] and s.chars == 30
    s.put({"id": "big"}, [{"role": "user", "content": "y" * 95}])
    assert list(s.items) == ["big"] and s.chars == 95


def test_tools_and_other_items_are_refused(srv):
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        for body, param in (({"tools": [{"type": "function", "name": "f"}]}, "tools"),
                            ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0]"),
                            ({"input": 5}, "input"), ({"text": {"format": {"type": "json_object"}}}, "text.format")):
            r = c.post("/responses", json={"model": "m", "input": "hi", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
