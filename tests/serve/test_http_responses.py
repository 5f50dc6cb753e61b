"""/v1/responses through the `openai` client: text in and out, the streaming events, previous_response_id and the
bounded store (issue 32 item 13)."""

from __future__ import annotations

import json

import pytest

from tests.serve.test_http_support import MODEL_ID

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


def test_built_in_tools_and_unknown_items_are_refused_naming_them(srv):
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        for body, param in (({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
                            ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
                            ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
                            ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
                            ({"input": 5}, "input"), ({"text": {"format": {"type": "yaml"}}}, "text.format"),
                            ({"tool_choice": {"type": "file_search"}}, "tool_choice")):
            r = c.post("/responses", json={"model": "m", "input": "hi", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER}


def test_function_tools_round_trip_with_the_openai_client(client):
    # issue 44: the Agents SDK's default path — a call, its output fed back by previous_response_id, an answer
    r = client.responses.create(model=MODEL_ID, input="Weather in Oslo?", tools=[TOOL], tool_choice="required",
                                max_output_tokens=40, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments), dict)
    follow = client.responses.create(model=MODEL_ID, previous_response_id=r.id, tools=[TOOL], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "12 degrees"}], max_output_tokens=8, temperature=0)
    assert follow.output_text and not [o for o in follow.output if o.type == "function_call"]
    # the same turn written out by hand (no store): function_call then function_call_output items
    again = client.responses.create(model=MODEL_ID, store=False, tools=[TOOL], max_output_tokens=8, temperature=0,
                                    input=[{"role": "user", "content": "Weather in Oslo?"},
                                           {"type": "function_call", "call_id": calls[0].call_id,
                                            "name": "get_weather", "arguments": calls[0].arguments},
                                           {"type": "function_call_output", "call_id": calls[0].call_id,
                                            "output": "12 degrees"}])
    assert again.status in ("completed", "incomplete")


def test_streamed_function_calls_send_openais_events_and_reassemble(client):
    kw = {"model": MODEL_ID, "input": "Weather in Oslo?", "tools": [TOOL], "tool_choice": "required",
          "max_output_tokens": 40, "temperature": 0}
    whole = client.responses.create(**kw)
    kinds, args = [], ""
    with client.responses.stream(**kw) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                args += event.delta
        final = stream.get_final_response()
    assert "response.output_item.added" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.delta" in kinds
    got = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert got == [(o.name, o.arguments) for o in whole.output if o.type == "function_call"]
    assert args == got[0][1]


def test_text_format_json_schema_gives_json_that_follows_it(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL_ID, input="Name a city.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert r.text.format.type == "json_schema"
    if r.status == "completed":
        assert set(json.loads(r.output_text)) == {"city"}
