"""Structured output and tools in a request body: ``response_format``, ``regex``, ``choice``, ``grammar``, ``tools``,
``tool_choice``, ``parallel_tool_calls``, and the tool parts of chat messages, checked field by field.

``response_format`` is OpenAI's (``text``, ``json_object``, ``json_schema`` with ``name``, ``schema``,
``strict``); ``regex`` (a string), ``choice`` (an array of strings) and ``grammar`` (a Lark grammar in
llguidance's dialect) are this server's extensions, as in vLLM.  At most one of them per request.  Every
schema and grammar is compiled here, so one that does not compile is a 400 naming its field
(``response_format.json_schema.schema``, ``tools[1].function.parameters``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from localinfer.errors import GrammarError
from localinfer.generation.constraints import grammar_from
from localinfer.generation.grammar_guard import MAX_JSON_DEPTH, json_depth
from localinfer.serve.http.errors import APIError, bad
from localinfer.serve.http.intake import loads_field

MAX_TOOLS = 128
MAX_ARGUMENT_BYTES = 1 << 20        # one tool call's arguments in the history
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z][\w-]*\s*::=")     # a line "name ::= ...": llama.cpp's GBNF, not Lark


@dataclass(frozen=True)
class Structure:
    """What constrains a reply: a grammar, or tools (or both absent)."""

    grammar: str | None = None          # compiled llguidance grammar (response_format, regex, choice, grammar)
    field: str | None = None            # where it came from
    tools: tuple[dict, ...] = ()        # {"name", "description", "parameters"}
    tool_choice: str = "auto"           # none | auto | required
    named: str | None = None            # tool_choice naming one function
    parallel: bool = True
    answer: dict | None = None          # with tools: the JSON schema a reply that calls no tool follows

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


STRUCTURE_FIELDS = ("response_format", "regex", "choice", "grammar", "json_schema", "tools")


def constrains(body: dict) -> bool:
    """Whether the body names anything :func:`parse_structure` compiles (a ``text`` response_format does not)."""
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "text" and not any(body.get(k) is not None
                                                                      for k in STRUCTURE_FIELDS[1:]):
        return False
    return any(body.get(k) is not None for k in STRUCTURE_FIELDS)


def parse_structure(body: dict) -> Structure | None:
    """The request's structure, or None when nothing constrains it."""
    kinds = []
    grammar = field = answer = None
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise bad("response_format", "response_format must be an object with a type: text, json_object or "
                                         "json_schema")
        kind = rf["type"]
        if kind == "json_object":
            grammar, field = _compile("json_object", None, "response_format"), "response_format"
            answer = {"type": "object"}
            kinds.append("response_format")
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad("response_format.json_schema", "response_format.json_schema must be an object "
                                                         "{name, schema, strict}")
            if js.get("name") is not None and not isinstance(js["name"], str):
                raise bad("response_format.json_schema.name", "response_format.json_schema.name must be a string")
            field = "response_format.json_schema.schema"
            if not isinstance(js.get("schema"), dict):
                raise bad(field, f"{field} must be a JSON schema object")
            grammar = _compile("json_schema", js["schema"], field)
            answer = js["schema"]
            kinds.append("response_format")
        elif kind != "text":
            raise bad("response_format.type", "response_format.type must be text, json_object or json_schema, got "
                                              f"{json.dumps(kind)[:40]}")
    for name, kind in (("regex", "regex"), ("choice", "choice"), ("grammar", "lark"), ("json_schema", "json_schema")):
        value = body.get(name)
        if value is not None:
            if name == "grammar" and isinstance(value, str) and _GBNF_RULE.search(value):
                kind = "gbnf"             # llama-server's grammar format; ours is Lark
            grammar, field = _compile(kind, value, name), name
            kinds.append(name)
    if len(kinds) > 1:
        raise bad(kinds[1], f"give one of response_format (json), regex, choice, grammar, json_schema; got "
                            f"{', '.join(kinds)}")
    tools = _tools(body.get("tools"))
    choice, named = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if tools and choice != "none" and grammar is not None and answer is None:
        raise bad(kinds[0], f"{kinds[0]} and tools cannot constrain one reply (response_format can): drop one, or "
                            "send tool_choice: none")
    if grammar is None and not tools:
        return None
    # tools with response_format: a reply is tool calls, or (tool_choice auto) JSON that follows the schema, as
    # OpenAI serves what agent frameworks send (openai-agents output_type, pydantic-ai NativeOutput, ai SDK)
    return Structure(grammar, field, tools, choice, named, parallel, answer if tools else None)


def _compile(kind: str, value, field: str) -> str:
    try:
        return grammar_from(kind, value, field)
    except GrammarError as exc:
        if exc.facts.get("busy"):
            raise APIError(503, str(exc), param=field, code="grammar_busy", headers={"Retry-After": "1"}) from None
        raise bad(field, str(exc), code="invalid_grammar") from None


def _tools(v) -> tuple[dict, ...]:
    if v is None or v == []:
        return ()
    if not isinstance(v, list):
        raise bad("tools", "tools must be an array of {type: function, function: {name, parameters}}")
    if len(v) > MAX_TOOLS:
        raise bad("tools", f"tools has {len(v)} entries; the limit is {MAX_TOOLS}")
    out, seen = [], set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad(where, f"{where} must be {{type: function, function: {{name, description, parameters}}}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad(f"{where}.function.name", f"{where}.function.name must be 1-64 letters, digits, _ . or -")
        if name in seen:
            raise bad(f"{where}.function.name", f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"{where}.function.description", f"{where}.function.description must be a string")
        params = f.get("parameters")
        if params is not None:
            pf = f"{where}.function.parameters"
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                raise bad(pf, f"{pf} must be a JSON schema of type object")
            _compile("json_schema", params, pf)
        tool = {"name": name, "parameters": params or {"type": "object", "properties": {}}}
        if desc:
            tool["description"] = desc
        out.append(tool)
    return tuple(out)


def _tool_choice(v, tools) -> tuple[str, str | None]:
    if v is None:
        return ("auto" if tools else "none"), None
    if v in ("none", "auto", "required"):
        if v == "required" and not tools:
            raise bad("tool_choice", "tool_choice required needs tools")
        return v, None
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict):
        name = v["function"].get("name")
        if name not in {t["name"] for t in tools}:
            raise bad("tool_choice.function.name", f"tool_choice names {json.dumps(name)[:60]}, which is not in tools")
        return "required", name
    raise bad("tool_choice", "tool_choice must be none, auto, required or {type: function, function: {name}}")


def tool_message(m: dict, where: str, role: str) -> dict:
    """The tool parts of one chat message: an assistant's ``tool_calls`` (arguments parsed to objects, as chat
    templates print them), a tool result's ``tool_call_id`` and ``name``."""
    out = {}
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise bad(f"{where}.tool_calls", f"{where}.tool_calls must be an array")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id must be the id of the call it answers")
        out["tool_call_id"] = tid
    if isinstance(m.get("name"), str) and role in ("tool", "function"):
        out["name"] = m["name"]
    return out


def _call(c, where: str) -> dict:
    if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
        raise bad(where, f"{where} must be {{id, type: function, function: {{name, arguments}}}}")
    f = c["function"]
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise bad(f"{where}.function.name", f"{where}.function.name must be a non-empty string")
    args = f.get("arguments", "{}")
    field = f"{where}.function.arguments"
    if isinstance(args, str):
        if len(args) > MAX_ARGUMENT_BYTES:
            raise bad(field, f"{field} is {len(args):,} characters; the limit is {MAX_ARGUMENT_BYTES:,}")
        args = loads_field(args, field) if args.strip() else {}
    if json_depth(args) > MAX_JSON_DEPTH:
        raise bad(field, f"{field} nests deeper than {MAX_JSON_DEPTH} levels; flatten it")
    if not isinstance(args, dict):
        raise bad(f"{where}.function.arguments", f"{where}.function.arguments must be a JSON object")
    cid = c.get("id")
    if cid is not None and not isinstance(cid, str):
        raise bad(f"{where}.id", f"{where}.id must be a string")
    return {"id": cid or "", "type": "function", "function": {"name": f["name"], "arguments": args}}
