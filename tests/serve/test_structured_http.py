"""Structured output through the server on the embedded model: JSON schemas, regex, choice, Lark, tools.

Every reply is checked with ``jsonschema``; eight requests with eight schemas in one batch must each be valid
and (one thread, greedy) token for token what the same request gives alone.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")
pytest.importorskip("llama_cpp")

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                   "required": ["name", "age"], "additionalProperties": False},
        "city": {"type": "string", "maxLength": 24}}, "required": ["person", "city"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"colors": {"type": "array", "minItems": 2, "maxItems": 4,
                                                          "items": {"type": "string", "maxLength": 12}}},
              "required": ["colors"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "calm"]},
                                              "score": {"type": "integer", "minimum": 1, "maximum": 5}},
             "required": ["mood", "score"], "additionalProperties": False},
    "anyof": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string",
                                                                                        "maxLength": 10}]}},
              "required": ["value"], "additionalProperties": False},
    "ranges": {"type": "object", "properties": {"temp": {"type": "number", "minimum": -50, "maximum": 60},
                                                "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}},
               "required": ["temp", "count"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                 "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]$"}},
                "required": ["code", "date"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                                  "pages": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "isbn": {"type": "string", "maxLength": 13}},
                 "required": ["title"], "additionalProperties": False},
    "mixed": {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"],
                                                                                 "maxLength": 20},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                        "maxItems": 3}},
              "required": ["ok", "note", "tags"], "additionalProperties": False},
}
PROMPTS = {name: f"Write a JSON object about a {name} example." for name in SCHEMAS}


def _ask(client, name, **kw):
    return client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": PROMPTS[name]}], max_tokens=96,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                "strict": True}}, **kw)


@pytest.mark.parametrize("seed", [0, 7])
def test_every_schema_gives_valid_json(client, seed):
    valid = 0
    for name, schema in SCHEMAS.items():
        ch = _ask(client, name, temperature=0.8, seed=seed).choices[0]
        assert ch.finish_reason == "stop", (name, ch)
        jsonschema.validate(json.loads(ch.message.content), schema)
        valid += 1
    assert valid == len(SCHEMAS)


def _per_slot_kv(model, ctx):
    """The server's llama.cpp executor with a KV cache of its own per slot (no unified cache), one thread."""
    def factory(config):
        from localinfer.backends.engine import LoadPlan
        from localinfer.commands.serve import open_llamacpp

        plan = LoadPlan(str(model), n_ctx=ctx, n_seq=config.n_slots, n_threads=1, flash_attn=True,
                        options={"kv_unified": False})
        return lambda: open_llamacpp(plan)
    return factory


def test_eight_schemas_in_one_batch_match_each_alone(default_model):
    srv = LiveServer(default_model, parallel=8, max_queue=8, park=0, open_executor=_per_slot_kv(default_model, 4096))
    try:
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300) as c:
            alone = {name: _ask(c, name, temperature=0).choices[0].message.content for name in SCHEMAS}
            with ThreadPoolExecutor(8) as pool:
                together = dict(zip(SCHEMAS, pool.map(lambda n: _ask(c, n, temperature=0), SCHEMAS)))
            assert srv.runtime.engine.scheduler.peak_running >= 4
        for name, schema in SCHEMAS.items():
            text = together[name].choices[0].message.content
            jsonschema.validate(json.loads(text), schema)
            assert text == alone[name], name
    finally:
        srv.stop()


def test_parse_with_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population: int = Field(ge=0, le=100_000_000)

    r = client.beta.chat.completions.parse(model=MODEL_ID, response_format=City, max_tokens=120, temperature=0,
                                           messages=[{"role": "user", "content": "Describe Paris."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_json_object_n_choices_and_completions(client, srv):
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "A JSON object."}],
                                       response_format={"type": "json_object"}, n=2, max_tokens=64,
                                       temperature=1.0, seed=3)
    for ch in r.choices:
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(ch.message.content), dict)
    c = client.completions.create(model=MODEL_ID, prompt="The answer is", max_tokens=8, temperature=1.0, seed=1,
                                  extra_body={"choice": ["yes", "no", "maybe"]})
    assert c.choices[0].text in ("yes", "no", "maybe") and c.choices[0].finish_reason == "stop"
    c = client.completions.create(model=MODEL_ID, prompt="Call me at", max_tokens=20, temperature=1.0, seed=2,
                                  extra_body={"regex": r"[0-9]{3}-[0-9]{4}"})
    import re
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.choices[0].text)
    c = client.completions.create(model=MODEL_ID, prompt="Pick:", max_tokens=12, temperature=0.7, seed=4,
                                  extra_body={"grammar": 'start: "x=" NUM\nNUM: /[1-9][0-9]?/'})
    assert re.fullmatch(r"x=[1-9][0-9]?", c.choices[0].text)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 30},
                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                                               "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "search", "description": "Search the web",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string", "maxLength": 40}},
                                               "required": ["query"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What's the weather in Paris in celsius?"}]


def test_generic_tools_required_named_and_auto(client):
    for choice, names in (("required", {"get_weather", "search"}),
                          ({"type": "function", "function": {"name": "search"}}, {"search"})):
        ch = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            max_tokens=80, temperature=0).choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
        for call in ch.message.tool_calls:
            assert call.id and call.function.name in names
            spec = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), spec)
    ch = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, max_tokens=80,
                                        temperature=0).choices[0]
    assert ch.message.tool_calls or (ch.message.content and ch.finish_reason in ("stop", "length"))
    none = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, temperature=0).choices[0]
    assert none.message.tool_calls is None and none.finish_reason in ("stop", "length")
    shaped = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="none",
                                            response_format={"type": "json_object"}, max_tokens=60,
                                            temperature=0).choices[0]
    if shaped.finish_reason == "stop":
        assert isinstance(json.loads(shaped.message.content), dict)
    else:
        assert shaped.message.content.lstrip().startswith("{")


def test_generic_tool_history_and_stream(client):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_a", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18 degrees, sunny"}]
    kw = {"model": MODEL_ID, "messages": history, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80,
          "temperature": 0}
    whole = client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        got = stream.get_final_completion().choices[0]
    assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls] == \
           [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]


def test_tools_with_response_format_on_the_generic_format_and_the_sdks_parse(client):
    pydantic = pytest.importorskip("pydantic")

    class Weather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        celsius: int = pydantic.Field(ge=-60, le=60)

    class GetWeather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)

    import openai

    tools = [openai.pydantic_function_tool(GetWeather, name="get_weather")]
    seen = set()
    for seed in range(4):
        ch = client.chat.completions.parse(model=MODEL_ID, messages=ASK, tools=tools, response_format=Weather,
                                           max_tokens=80, seed=seed).choices[0]
        if ch.message.tool_calls:
            seen.add("call")
            call = ch.message.tool_calls[0]
            assert call.function.name == "get_weather"
            assert isinstance(call.function.parsed_arguments, GetWeather)
        else:
            seen.add("answer")
            assert ch.finish_reason == "stop" and isinstance(ch.message.parsed, Weather), ch
    assert seen
    # tool_choice required still means calls only; a regex beside tools still cannot hold
    ch = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required",
                                        response_format={"type": "json_object"}, max_tokens=80).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls


def test_a_tool_call_cut_by_max_tokens_is_returned_as_far_as_it_got_as_the_stream_delivers_it(client):
    # issue 44: the non-streamed reply had no content and no call (smolagents then failed confusingly)
    kw = {"model": MODEL_ID, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 24,
          "temperature": 0}
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.tool_calls, whole
    call = whole.message.tool_calls[0]
    assert call.function.name in {"get_weather", "search"} and call.id
    calls, finish = {}, None          # the stream reassembled by hand (the SDK's helper refuses a length end)
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                got = calls.setdefault(d.index, ["", ""])
                got[0] += d.function.name or "" if d.function else ""
                got[1] += d.function.arguments or "" if d.function else ""
    assert finish == "length"
    assert [tuple(calls[i]) for i in sorted(calls)] == \
           [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"regex": "a(b"}, "regex"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", 3]}, "choice"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"regex": "a+", "choice": ["a"]}, "choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "regex": "a"}, "regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]}, "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                          "function": {"name": "f",
                                                                                       "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "5"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]}, "messages[0].tool_calls"),
]


@pytest.mark.parametrize("extra,param", BAD)
def test_bad_structure_is_a_400_naming_the_field(srv, extra, param):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and "\n" not in err["message"]
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_a_prefix_cache_hit_gives_the_same_constrained_reply(client):
    """The second request's prompt KV comes from the prefix cache; its grammar state starts from its own output."""
    first = _ask(client, "nested", temperature=0)
    again = _ask(client, "nested", temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    jsonschema.validate(json.loads(again.choices[0].message.content), SCHEMAS["nested"])


def test_llama_server_fields_json_schema_and_gbnf_grammar_are_honoured(srv):
    """llama-server's own request fields: a top-level ``json_schema`` and a GBNF ``grammar`` constrain the reply as
    ``response_format`` and a Lark grammar do (clients written for llama-server send them)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    base = {"model": "x", "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": "A number?"}]}
    r = httpx.post(srv.url + "/v1/chat/completions", json={**base, "json_schema": schema}, timeout=120)
    assert r.status_code == 200, r.text
    reply = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(reply) == {"n"} and 0 <= reply["n"] <= 9
    r = httpx.post(srv.url + "/v1/completions", json={"model": "x", "prompt": "Answer:", "max_tokens": 10,
                                                      "temperature": 0, "grammar": 'root ::= ("yes" | "no") "."'},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes.", "no.")
    r = httpx.post(srv.url + "/v1/completions", json={"model": "x", "prompt": "A", "grammar": "root ::= missing"},
                   timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
