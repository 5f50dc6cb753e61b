"""Tool formats: detection, grammars (random walks on the embedded vocabulary), the tolerant streaming parser."""

from __future__ import annotations

import json

import numpy as np
import pytest

from localinfer.model.tool_parse import ToolStream, scan
from localinfer.model.tools import FORMATS, GENERIC, HERMES, LLAMA3, MISTRAL, detect, generic_messages, tool_grammar

ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "string", "maxLength": 6}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"name": "add", "parameters": ADD},
         {"name": "ping", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]


def test_detection_from_template_source():
    assert detect("{% for m in messages %}<tool_call>{% endfor %}") is HERMES
    assert detect("[TOOL_CALLS]{{ x }}") is MISTRAL
    assert detect("{% if m.tool_calls %}<|python_tag|>{% endif %}") is LLAMA3
    assert detect("<|im_start|>{{ m.content }}") is GENERIC and detect("") is GENERIC


def _reassemble(deltas):
    calls, content = {}, ""
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            e = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if tc.get("id"):
                assert e["id"] is None, "a call's id and name come once"
                e["id"], e["name"] = tc["id"], tc["function"]["name"]
            e["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def _stream(fmt, text, step=3):
    s, deltas = ToolStream(fmt), []
    for i in range(0, len(text), step):
        deltas += s.feed(text[i:i + step])
    deltas += s.finish()
    return s, deltas


def test_stream_reassembles_into_the_final_calls_and_holds_a_partial_trigger():
    text = ('Let me check. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x}y"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    for step in (1, 2, 7):
        s, deltas = _stream(HERMES, text, step)
        content, calls = s.result()
        got_content, got = _reassemble(deltas)
        assert content == got_content == "Let me check."
        assert [(c["id"], c["name"], c["arguments"]) for c in got] == \
               [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": "x}y"}, {}]
    assert scan(HERMES, "Hello <tool", final=False)[0] == "Hello "


def test_text_that_is_not_a_call_stays_content():
    s, _ = _stream(HERMES, "no calls, just <b>text</b> and {\"name\": 1}")
    assert s.result() == ("no calls, just <b>text</b> and {\"name\": 1}", [])
    s, _ = _stream(HERMES, 'broken <tool_call>\n{"name": "add", "arguments": {"a": 1')   # cut short: not a call
    assert s.result() == ('broken <tool_call>\n{"name": "add", "arguments": {"a": 1', [])
    s, _ = _stream(GENERIC, '{"content": "hi there"}')
    assert s.result() == ("hi there", [])


@pytest.fixture(scope="module")
def vocab(default_model):
    pytest.importorskip("llguidance")
    pytest.importorskip("llama_cpp")
    from localinfer.backends.vocab import VocabOnly

    v = VocabOnly(str(default_model))
    yield v
    v.close()


def _walk(vocab, c, rng, forced=(), limit=300):
    for t in forced:
        assert c.allowed()[t], "the grammar refuses the trigger"
        c.consume(t)
    for _ in range(limit):
        if c.stopped_after(len(c.tokens)):
            break
        ok = np.flatnonzero(c.allowed())
        ok = ok[~np.isin(ok, list(vocab.eos_ids))] if len(ok) > len(vocab.eos_ids) else ok
        lens = np.array([len(vocab.token_bytes(int(t))) or 9 for t in ok])
        ok = ok[lens == lens.min()] if rng.random() < 0.7 else ok
        c.consume(int(rng.choice(ok)))
    return b"".join(vocab.token_bytes(t) for t in c.tokens).decode("utf-8")


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("required", [True, False])
def test_grammars_force_calls_that_parse(vocab, name, required):
    from localinfer.generation.constraints import Constraint, check_grammar, grammar_tokenizer

    fmt = FORMATS[name]
    g = tool_grammar(fmt, TOOLS, required=required, parallel=False)
    check_grammar(g, "tools")
    prefix = "Sure. " if not required and fmt is not GENERIC else ""
    forced = vocab.tokenize(prefix + fmt.trigger) if not required and fmt is not GENERIC else []
    for seed in range(3):
        c = Constraint(grammar_tokenizer(vocab), g)
        text = _walk(vocab, c, np.random.default_rng(seed), forced)
        s, deltas = _stream(fmt, text, 4)
        content, calls = s.result()
        if not required and fmt is GENERIC:     # auto, generic: a call or a reply, both one JSON object
            assert calls or isinstance(json.loads(text)["content"], str)
            continue
        assert c.stopped_after(len(c.tokens)) and len(calls) == 1, text
        args = json.loads(calls[0]["function"]["arguments"])
        assert calls[0]["function"]["name"] in ("add", "ping") and isinstance(args, dict)
        if calls[0]["function"]["name"] == "add":
            assert 0 <= args["a"] <= 99 and len(args["b"]) <= 6
        assert _reassemble(deltas)[1][0]["arguments"] == calls[0]["function"]["arguments"]
        assert (content or "") == prefix.strip()


def test_generic_messages_describe_tools_and_rewrite_history():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": "z"}}}]},
            {"role": "tool", "content": "2", "tool_call_id": "c1"}]
    out = generic_messages(msgs, TOOLS, required=True)
    assert out[0]["role"] == "system" and '"add"' in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": "z"}}]}
    assert out[3]["role"] == "user" and "c1" in out[3]["content"]
