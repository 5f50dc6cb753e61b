"""Reading tool calls out of a reply as it grows: content, call names, argument text.

The grammar (:func:`localinfer.model.tools.tool_grammar`) writes every call as
``{"name": "f", "arguments": {...}`` in that order, so a scan of the text so far
finds each call's name once it is complete and its arguments as a growing raw
JSON text (up to the brace that closes them).  ``ToolStream`` turns successive
scans into OpenAI deltas — content, then per call ``index``, ``id``, ``type`` and
``name`` once, then argument fragments that only ever append — and the reply's
final ``content`` and ``tool_calls`` are the same scan of the whole text, so the
non-streamed answer is exactly what a client reassembles from the stream.  Text
before the trigger is content (a partial trigger at the end is held back); a call
whose arguments never closed is not a call, unless the reply was cut by its token
limit: then it is kept with what it has (``finish_reason: length``), as streamed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from localinfer.model.tools import GENERIC, ToolFormat

_CALL = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "(?:arguments|parameters)": ')
_TOOL_CALLS = re.compile(r'\s*\{"tool_calls": \[')              # the generic format's calls object
_TOOL_CALLS_LEN = len('{"tool_calls": [')


@dataclass
class Call:
    name: str
    arguments: str        # raw JSON text of the arguments object (partial until complete)
    complete: bool


def _object_end(text: str, start: int) -> int | None:
    """The index after the JSON value (object) starting at ``start``, or None while it is unfinished."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan(fmt: ToolFormat, text: str, final: bool, answer_json: bool = False) -> tuple[str, list[Call]]:
    """(content so far, calls so far) of a reply's text in format ``fmt``; ``answer_json``: a reply without
    calls is response_format's JSON, its content whole (not the generic format's ``{"content": ...}``)."""
    if fmt is GENERIC:
        start, content = 0, ""
        if answer_json and not _TOOL_CALLS.match(text) and (final or len(text.lstrip()) >= _TOOL_CALLS_LEN):
            return (text if final else ""), []          # response_format's JSON, not calls (whatever it holds)
    else:
        start = text.find(fmt.trigger)
        if start < 0:
            return (text if final else _hold_trigger(text, fmt.trigger)), []
        content = text[:start]
    calls, pos = [], start
    while (m := _CALL.search(text, pos)) is not None:
        try:
            name = json.loads(m.group(1))
        except ValueError:
            break
        end = _object_end(text, m.end())
        calls.append(Call(name, text[m.end():end if end is not None else len(text)], end is not None))
        if end is None:
            break
        pos = end
    if fmt is GENERIC and final and not calls and answer_json:
        content = text
    elif fmt is GENERIC and final and not calls:
        try:
            obj = json.loads(text)
            content = obj["content"] if isinstance(obj, dict) and isinstance(obj.get("content"), str) else text
        except ValueError:
            content = text
    return content, calls


def _hold_trigger(text: str, trigger: str) -> str:
    for k in range(min(len(trigger) - 1, len(text)), 0, -1):
        if text.endswith(trigger[:k]):
            return text[:-k]
    return text


def _valid(call: Call) -> bool:
    if not call.complete:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False


class ToolStream:
    """One choice's reply in a tool format: ``feed`` text as it comes, get OpenAI deltas; ``result`` at the end."""

    def __init__(self, fmt: ToolFormat, answer_json: bool = False):
        self.fmt = fmt
        self.answer_json = answer_json
        self.text = ""
        self.ids: list[str] = []          # one per call announced
        self._content = ""                # content sent so far
        self._args: list[int] = []        # argument characters sent per call

    def feed(self, text: str, final: bool = False, cut: bool = False) -> list[dict]:
        """Append ``text``; the deltas it makes (``{"content": ...}`` or ``{"tool_calls": [...]}``).  ``cut`` (the
        reply's last feed, ended by the token limit): an unclosed call stays a call, as in :meth:`result`."""
        self.text += text
        content, calls = scan(self.fmt, self.text, final, self.answer_json)
        if final:
            calls = [c for c in calls if _valid(c) or (cut and not c.complete)]
            if not calls and self.fmt is not GENERIC:
                content = self.text if self.fmt.trigger in self.text else content
        out = []
        shown = content.strip() if final else content.lstrip().rstrip(" \t\r\n")
        if shown.startswith(self._content) and len(shown) > len(self._content):
            out.append({"content": shown[len(self._content):]})
            self._content = shown
        for i, call in enumerate(calls):
            if i == len(self.ids):
                self.ids.append("call_" + uuid.uuid4().hex[:24])
                self._args.append(0)
                out.append({"tool_calls": [{"index": i, "id": self.ids[i], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            frag = call.arguments[self._args[i]:]
            if frag and (call.complete or not final or cut):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": frag}}]})
                self._args[i] = len(call.arguments)
        return out

    def finish(self, cut: bool = False) -> list[dict]:
        return self.feed("", final=True, cut=cut)

    def result(self, cut: bool = False) -> tuple[str | None, list[dict]]:
        """(content or None, tool_calls in OpenAI's message shape) of the whole reply.  ``cut`` (finish_reason
        length): a call whose arguments never closed is kept with the arguments it has, as the stream sent them."""
        content, calls = scan(self.fmt, self.text, True, self.answer_json)
        calls = [c for c in calls if _valid(c) or (cut and not c.complete)]
        if not calls and self.fmt is not GENERIC and self.fmt.trigger in self.text:
            content = self.text
        while len(self.ids) < len(calls):
            self.ids.append("call_" + uuid.uuid4().hex[:24])
        out = [{"id": self.ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
               for i, c in enumerate(calls)]
        return (content.strip() or None), out
