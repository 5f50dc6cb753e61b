"""Tools and structured output on the Responses API: its shapes turned into the chat path's and back.

Request side (``chat_fields``): ``tools`` (function tools ``{type: function, name, description, parameters,
strict}``; the built-in types, web_search, file_search, computer and the rest, are a 400 naming them),
``tool_choice`` (``auto``/``none``/``required`` or ``{type: function, name}``), ``parallel_tool_calls`` and
``text.format`` (``json_schema`` with ``name``/``schema``/``strict``, ``json_object``, ``text``) become the chat
request's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``response_format``.  Input items
(``input_messages``): ``message``, ``function_call`` (an assistant's call: consecutive ones make one assistant
message) and ``function_call_output`` (a tool message answering ``call_id``).

Reply side: the chat reply's content and calls become output items, a ``message`` and one ``function_call``
item per call (``call_id`` the chat call's id); streamed, the chat deltas become the events OpenAI sends for
them (``response.output_item.added`` with the function_call item, ``response.function_call_arguments.delta`` …
``.done``, ``response.output_item.done``).
"""

from __future__ import annotations

import json

from localinfer.serve.http.errors import bad
from localinfer.serve.http.schemas import _kind

BUILT_IN = ("web_search", "web_search_preview", "file_search", "computer", "computer_use_preview",
            "code_interpreter", "image_generation", "mcp", "local_shell", "custom")
TEXT_PARTS = ("input_text", "output_text", "text")


def chat_fields(body: dict) -> dict:
    """The chat request's tool and format fields for a Responses body (400s name the Responses field)."""
    out: dict = {}
    tools = body.get("tools")
    if tools not in (None, []):
        if not isinstance(tools, list):
            raise bad("tools", f"tools must be an array, got {_kind(tools)}")
        chat = []
        for i, t in enumerate(tools):
            where = f"tools[{i}]"
            kind = t.get("type") if isinstance(t, dict) else None
            if isinstance(kind, str) and any(kind == b or kind.startswith(b + "_") for b in BUILT_IN):
                raise bad(f"{where}.type", f"{where}.type {kind!r} is a built-in tool this server does not run; "
                                           "only function tools are served", code="unsupported_parameter")
            if kind != "function":
                raise bad(f"{where}.type", f"{where} must be a function tool {{type: function, name, parameters}}")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            chat.append({"type": "function", "function": fn})
        out["tools"] = chat
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad("tool_choice", "tool_choice must be auto, none, required or {type: function, name}")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise bad("text", f"text must be an object {{format: ...}}, got {_kind(text)}")
        fmt = text.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_schema", "json_object"):
                raise bad("text.format", "text.format must be {type: text}, {type: json_object} or "
                                         "{type: json_schema, name, schema}")
            if fmt["type"] == "json_object":
                out["response_format"] = {"type": "json_object"}
            elif fmt["type"] == "json_schema":
                if not isinstance(fmt.get("schema"), dict):
                    raise bad("text.format.schema", "text.format.schema must be a JSON schema object")
                out["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": fmt.get("name") or "response", "schema": fmt["schema"], "strict": fmt.get("strict")}}
    return out


def input_messages(v) -> list[dict]:
    """Chat messages from ``input`` items: messages, function calls and their outputs."""
    out: list[dict] = []
    for i, item in enumerate(v):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not isinstance(args, str):
                raise bad(where, f"{where} must be {{type: function_call, call_id, name, arguments (a JSON string)}}")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.call_id", f"{where}.call_id must name the call it answers")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        else:
            raise bad(f"{where}.type", f"{where} must be a message, function_call or function_call_output item, "
                                       f"got {kind if isinstance(kind, str) else _kind(item)!r}")
    return out


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"{where} must be a string or an array of text parts, got {_kind(content)}")
    texts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in TEXT_PARTS or not isinstance(p.get("text"), str):
            raise bad(f"{where}[{j}]", f"{where}[{j}] must be a text part {{type: input_text, text}}")
        texts.append(p["text"])
    return "".join(texts)


def output_items(rid: str, content: str | None, calls: list[dict], status: str = "completed") -> list[dict]:
    """The response's output: a message (when there is text) and a function_call item per call (``incomplete``
    when max_output_tokens cut its arguments)."""
    items = []
    if content or (content is not None and not calls):
        items.append({"type": "message", "id": "msg_" + rid[5:], "status": status, "role": "assistant",
                      "content": [{"type": "output_text", "text": content, "annotations": []}]})
    for c in calls:
        items.append(function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"],
                                        status if complete(c) else "incomplete"))
    return items


def complete(call: dict) -> bool:
    """Whether a call's arguments are a whole JSON object (not cut by the token limit)."""
    try:
        return isinstance(json.loads(call["function"]["arguments"]), dict)
    except ValueError:
        return False


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def history_message(content: str | None, calls: list[dict]) -> dict:
    """The assistant turn as the chat path reads it back (``previous_response_id``): a call cut by the token
    limit is left out (its arguments are not JSON, and no output can answer it)."""
    m: dict = {"role": "assistant", "content": content}
    calls = [c for c in calls if complete(c)]
    if calls:
        m["tool_calls"] = [{"id": c["id"], "type": "function",
                            "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                           for c in calls]
    return m


class ToolEvents:
    """The Responses stream's events for a tool reply, from the chat path's deltas (``ev`` writes one event)."""

    def __init__(self, rid: str, ev):
        self.rid, self.ev = rid, ev
        self.text = ""
        self.message_index: int | None = None
        self.calls: dict[int, dict] = {}          # chat call index -> {output_index, id, name, arguments}
        self.n = 0

    def feed(self, deltas: list[dict]):
        for d in deltas:
            if d.get("content"):
                if self.message_index is None:
                    self.message_index, self.n = self.n, self.n + 1
                    item = {"type": "message", "id": "msg_" + self.rid[5:], "status": "in_progress",
                            "role": "assistant", "content": []}
                    yield self.ev("response.output_item.added", output_index=self.message_index, item=item)
                    yield self.ev("response.content_part.added", item_id=item["id"], output_index=self.message_index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                self.text += d["content"]
                yield self.ev("response.output_text.delta", item_id="msg_" + self.rid[5:],
                              output_index=self.message_index, content_index=0, delta=d["content"], logprobs=[])
            for tc in d.get("tool_calls") or ():
                i = tc["index"]
                if i not in self.calls:
                    fn = tc.get("function") or {}
                    self.calls[i] = {"output_index": self.n, "id": tc["id"], "name": fn.get("name", ""),
                                     "arguments": ""}
                    self.n += 1
                    item = function_call_item(tc["id"], self.calls[i]["name"], "", "in_progress")
                    yield self.ev("response.output_item.added", output_index=self.calls[i]["output_index"], item=item)
                    continue
                frag = (tc.get("function") or {}).get("arguments") or ""
                if frag:
                    c = self.calls[i]
                    c["arguments"] += frag
                    yield self.ev("response.function_call_arguments.delta", item_id=function_call_item(
                        c["id"], c["name"], "")["id"], output_index=c["output_index"], delta=frag)

    def done(self, response: dict):
        """The closing events of each item, from the finished response's output items."""
        for item in response["output"]:
            if item["type"] == "message" and self.message_index is not None:
                text = item["content"][0]["text"]
                part = {"type": "output_text", "text": text, "annotations": []}
                yield self.ev("response.output_text.done", item_id=item["id"], output_index=self.message_index,
                              content_index=0, text=text, logprobs=[])
                yield self.ev("response.content_part.done", item_id=item["id"], output_index=self.message_index,
                              content_index=0, part=part)
                yield self.ev("response.output_item.done", output_index=self.message_index, item=item)
            elif item["type"] == "function_call":
                c = next((c for c in self.calls.values() if c["id"] == item["call_id"]), None)
                index = c["output_index"] if c else self.n
                yield self.ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])
                yield self.ev("response.output_item.done", output_index=index, item=item)
