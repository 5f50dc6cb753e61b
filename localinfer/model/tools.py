"""Tool calls: the output format a chat template implies, its grammar, and the history in its terms.

Formats, detected from the template's source (``detect``):

=========  ====================================================  ==========================
name       one call (``{A}`` = the arguments object)            trigger (``auto``)
=========  ====================================================  ==========================
hermes     ``<tool_call>\\n{"name": "f", "arguments": {A}}\\n</tool_call>``   ``<tool_call>``
llama3     ``{"name": "f", "parameters": {A}}``                 ``{"name": ``
mistral    ``[TOOL_CALLS][{"name": "f", "arguments": {A}}, ...]``   ``[TOOL_CALLS]``
generic    ``{"tool_calls": [{"name": "f", "arguments": {A}}]}`` or ``{"content": "..."}``  (none)
=========  ====================================================  ==========================

``generic`` is for templates that know no tools (the embedded SmolLM2's): the tools
are described in a system message (``generic_messages``) and the whole reply is one
JSON object, a call or a reply.  ``tool_grammar`` writes the Lark grammar (llguidance's
dialect) that forces a call from the first token (``required`` or a named tool) or,
for ``auto``, lets text run until the trigger and forces a well-formed call after it
(a lazy lexeme).  Every call is written ``{"name": ..., "<args key>": ...}`` in that
order with ``", "`` and ``": "`` separators, which is what :mod:`.tool_parse` reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str          # text that starts the calls ("" for generic)
    args_key: str         # "arguments", or "parameters" (Llama 3)
    parallel: bool        # several calls in one reply

    def call_prefix(self, name: str) -> str:
        """The text of a call up to its arguments object."""
        return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "' + self.args_key + '": '


HERMES = ToolFormat("hermes", "<tool_call>", "arguments", True)
LLAMA3 = ToolFormat("llama3", '{"name": ', "parameters", False)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "arguments", True)
GENERIC = ToolFormat("generic", "", "arguments", True)
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, GENERIC)}


def detect(template_source: str) -> ToolFormat:
    """The tool-call format a chat template writes its assistant calls in (generic when it has none)."""
    src = template_source or ""
    if "<tool_call>" in src:
        return HERMES
    if "[TOOL_CALLS]" in src:
        return MISTRAL
    if "tool_call" in src and ("<|python_tag|>" in src or "ipython" in src or '"parameters"' in src):
        return LLAMA3
    return GENERIC


def args_schema(tool: dict, root: bool = True) -> dict:
    """A tool's arguments schema; at a grammar's root, in its JSON style (a schema's own x-guidance wins)."""
    params = dict(tool.get("parameters") or {"type": "object"})
    if root:
        params["x-guidance"] = {**JSON_STYLE, **params.get("x-guidance", {})}
    return params


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_grammar(fmt: ToolFormat, tools: list[dict], *, required: bool, parallel: bool,
                 trigger_token: int | None = None, answer: dict | None = None) -> str:
    """A Lark grammar for the reply: calls only (``required``), or text that may turn into calls (``auto``).

    ``tools``: ``{"name", "parameters"}`` each (named tool_choice: just that one).  ``trigger_token``: the
    trigger's id when it is one special token of the vocabulary (``<[id]>`` in the grammar), else its text.
    ``answer``: a JSON schema (response_format) the reply follows when it calls no tool, in place of free text.
    """
    if fmt is GENERIC:
        return _generic_grammar(tools, required=required, parallel=parallel, answer=answer)
    parallel = parallel and fmt.parallel
    lines = ["%llguidance {}"]
    calls, rests = [], []
    for i, tool in enumerate(tools):
        prefix = fmt.call_prefix(tool["name"])
        schema = json.dumps(args_schema(tool), ensure_ascii=False)
        lines.append(f"call_{i}: {_lit(prefix)} %json {schema} \"}}\"")
        calls.append(f"call_{i}")
        if fmt is LLAMA3:
            lines.append(f"rest_{i}: {_lit(prefix[len(fmt.trigger):])} %json {schema} \"}}\"")
            rests.append(f"rest_{i}")
    lines.append("call: " + " | ".join(calls))
    trig = f"<[{trigger_token}]>" if trigger_token is not None else _lit(fmt.trigger)
    if fmt is HERMES:
        one = '"\\n" call "\\n</tool_call>"'
        after = one + (f' ("\\n" {trig} {one})*' if parallel else "")
    elif fmt is MISTRAL:
        after = '"[" call' + (' (", " call)*' if parallel else "") + ' "]"'
    else:                                       # llama3: the trigger is the call's own beginning
        lines.append("rest: " + " | ".join(rests))
        after = "rest"
    lines.append(f"after: {after}")
    if required:
        lines.append(f"start: {trig} after")
    elif answer is not None:
        schema = json.dumps(args_schema({"parameters": answer}), ensure_ascii=False)
        lines += [f"answer: %json {schema}", f"start: answer | {trig} after"]
    elif trigger_token is not None:
        lines += ["start: TEXT | TEXT " + trig + " after", r"TEXT: /(.|\n)*/"]
    else:
        lines += ["start: TEXT | pre after", r"TEXT: /(.|\n)*/", f"pre[lazy]: TEXT {_lit(fmt.trigger)}"]
    return "\n".join(lines) + "\n"


def _generic_grammar(tools: list[dict], *, required: bool, parallel: bool, answer: dict | None = None) -> str:
    defs: dict = {}
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                        "arguments": hoisted(args_schema(t, False), f"tool{i}", defs)},
                        "required": ["name", "arguments"], "additionalProperties": False}
                       for i, t in enumerate(tools)]}
    listed = {"type": "array", "items": calls, "minItems": 1}
    if not parallel:
        listed["maxItems"] = 1
    call = {"type": "object", "properties": {"tool_calls": listed}, "required": ["tool_calls"],
            "additionalProperties": False}
    reply = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
             "additionalProperties": False}
    if answer is not None:
        reply = hoisted(answer, "answer", defs)
    schema = {"x-guidance": JSON_STYLE, **(call if required else {"anyOf": [call, reply]})}
    if defs:
        schema["$defs"] = defs
    return "%llguidance {}\nstart: %json " + json.dumps(schema, ensure_ascii=False) + "\n"


_DEF_KEYS = ("$defs", "definitions")


def hoisted(schema: dict, tag: str, defs: dict) -> dict:
    """``schema`` (a tool's arguments) made fit to sit inside another schema: its ``$defs`` / ``definitions`` move
    into ``defs`` under ``tag``-prefixed names and every local ``$ref`` is rewritten to resolve against the
    enclosing root: ``#/$defs/x`` and ``#/definitions/x`` to the moved entries, ``#`` and any other ``#/...``
    pointer (``#/properties/a``) into the schema itself, kept whole at ``#/$defs/{tag}``.  The schema's depth is
    bounded (generation/grammar_guard.py) before this runs."""
    def esc(name: str) -> str:
        return name.replace("~", "~0").replace("/", "~1")

    def unesc(name: str) -> str:
        return name.replace("~1", "/").replace("~0", "~")

    def new_name(key: str, name: str) -> str:        # "/" cannot collide: names from one table differ
        return f"{tag}/{key.lstrip('$')}/{name}"

    roots = []

    def ref(r: str) -> str:
        for key in _DEF_KEYS:
            head = f"#/{key}/"
            if r.startswith(head):
                name, sep, tail = r[len(head):].partition("/")
                return f"#/$defs/{esc(new_name(key, unesc(name)))}" + (sep + tail if sep else "")
        if r == "#" or r.startswith("#/"):
            roots.append(True)
            return f"#/$defs/{esc(tag)}" + r[1:]
        return r

    def rewrite(v):
        if isinstance(v, dict):
            return {k: (ref(x) if k == "$ref" and isinstance(x, str) else rewrite(x)) for k, x in v.items()}
        if isinstance(v, list):
            return [rewrite(x) for x in v]
        return v

    own = {k: v for k, v in schema.items() if k not in _DEF_KEYS}
    for key in _DEF_KEYS:
        for name, sub in (schema.get(key) or {}).items():
            defs[new_name(key, name)] = rewrite(sub)
    body = rewrite(own)
    if roots:
        defs[tag] = body
    return body


def generic_messages(messages: list[dict], tools: list[dict], required: bool, describe: bool = True) -> list[dict]:
    """The conversation for a template without tools: a system message describing them and the reply's JSON
    (unless not ``describe``: tool_choice none), assistant calls written as that JSON, tool results as user
    messages that say which call they answer."""
    spec = json.dumps([{k: t[k] for k in ("name", "description", "parameters") if k in t} for t in tools],
                      ensure_ascii=False)
    how = ('Reply with one JSON object: {"tool_calls": [{"name": ..., "arguments": {...}}]} to call tools'
           + ("." if required else ', or {"content": "..."} to answer directly.'))
    intro = f"You can call these tools:\n{spec}\n{how}"
    out, system_done = [], not describe
    for m in messages:
        if m["role"] == "system" and not system_done:
            out.append({"role": "system", "content": m["content"] + "\n\n" + intro})
            system_done = True
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        elif m["role"] == "tool":
            who = m.get("name") or m.get("tool_call_id") or "a tool"
            out.append({"role": "user", "content": f"Result of {who}: {m['content']}"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if not system_done:
        out.insert(0, {"role": "system", "content": intro})
    return out
