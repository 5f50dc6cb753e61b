"""Tool calls on generated tiny models whose chat templates write Hermes, Llama 3 and Mistral calls.

Random weights write garbage: constrained decoding must still force every call into the template's format
with arguments that satisfy the tool's schema, and the stream must reassemble into the same calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer
from tests.support.ggufgen import write_tiny_model

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("llama_cpp")

TEMPLATES = Path(__file__).parent / "data" / "templates"
ADDED = {"hermes": (("<tool_call>", 4), ("</tool_call>", 4)),        # user-defined, as in Qwen's vocabulary
         "llama3": (("<|python_tag|>", 3),),
         "mistral": (("[TOOL_CALLS]", 3), ("[AVAILABLE_TOOLS]", 3), ("[/AVAILABLE_TOOLS]", 3))}   # control tokens
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Sum of two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Oslo, and what is 2 + 3?"}]


@pytest.fixture(scope="module", params=["hermes", "llama3", "mistral"])
def fmt_client(request, tmp_path_factory):
    fmt = request.param
    template = (TEMPLATES / f"{fmt}.jinja").read_text()
    path = write_tiny_model(tmp_path_factory.mktemp(fmt) / f"{fmt}.gguf", n_embd=64, n_ff=128, seed=3, ctx=2048,
                            added_tokens=ADDED[fmt], extra_kv={"tokenizer.chat_template": template})
    srv = LiveServer(path, parallel=2, ctx=2048, park=2)
    try:
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120) as c:
            yield fmt, c, srv
    finally:
        srv.stop()


def _check_calls(calls, names=("get_weather", "add")):
    assert calls, "no tool call"
    ids = [c.id for c in calls]
    assert all(ids) and len(set(ids)) == len(ids)
    for c in calls:
        assert c.type == "function" and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_template_format_is_detected(fmt_client):
    from localinfer.model.tools import detect

    fmt, _, _ = fmt_client
    assert detect((TEMPLATES / f"{fmt}.jinja").read_text()).name == fmt


@pytest.mark.parametrize("seed", [0, 1])
def test_required_forces_a_valid_call(fmt_client, seed):
    _, c, _ = fmt_client
    r = c.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    _check_calls(ch.message.tool_calls)
    assert len(ch.message.tool_calls) == 1


def test_named_tool_choice_is_that_tool(fmt_client):
    _, c, _ = fmt_client
    r = c.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.9,
                                  parallel_tool_calls=False,
                                  seed=5, tool_choice={"type": "function", "function": {"name": "add"}})
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls, names=("add",))


def test_streamed_calls_reassemble_into_the_unstreamed_ones(fmt_client):
    _, c, _ = fmt_client
    kw = {"model": MODEL_ID, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 160,
          "temperature": 0, "parallel_tool_calls": False}
    whole = c.chat.completions.create(**kw).choices[0]
    with c.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        got = stream.get_final_completion().choices[0]
    assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls] == \
           [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert len({t.id for t in got.message.tool_calls}) == len(got.message.tool_calls)
    assert got.finish_reason == whole.finish_reason


def test_auto_keeps_text_as_content_and_history_renders(fmt_client):
    _, c, _ = fmt_client
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = c.chat.completions.create(model=MODEL_ID, messages=history, tools=TOOLS, max_tokens=24, temperature=0)
    ch = r.choices[0]
    assert ch.message.content or ch.message.tool_calls
    if ch.message.tool_calls:
        _check_calls(ch.message.tool_calls)


def test_malformed_call_in_history_is_a_400(fmt_client):
    _, c, _ = fmt_client
    bad = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL_ID, messages=bad, tools=TOOLS, max_tokens=4)
    assert err.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "celsius": {"type": "integer", "minimum": -60, "maximum": 60}},
          "required": ["city", "celsius"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_tools_with_response_format_reply_with_calls_or_the_schemas_json(fmt_client, seed):
    # issue 44: what openai-agents (output_type + tools), pydantic-ai and the ai SDK send; a 400 before
    _, c, _ = fmt_client
    ch = c.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, max_tokens=120, seed=seed,
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "answer", "schema": ANSWER}}).choices[0]
    if ch.message.tool_calls:           # cut by max_tokens, the last call is as far as it got
        calls = ch.message.tool_calls if ch.finish_reason != "length" else ch.message.tool_calls[:-1]
        if calls:
            _check_calls(calls)
    elif ch.finish_reason == "stop":
        jsonschema.validate(json.loads(ch.message.content), ANSWER)
    else:
        assert ch.finish_reason == "length" and ch.message.content.lstrip().startswith("{")
