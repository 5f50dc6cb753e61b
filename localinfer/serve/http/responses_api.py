"""OpenAI's Responses API (``/v1/responses``), the one the Agents SDK uses by default: text in, text out.

``input`` is a string or a list of messages (``role`` + string content or
``input_text``/``output_text`` parts); ``instructions`` becomes a system
message.  The reply is a ``response`` object with one ``message`` output item;
``stream: true`` sends the event sequence (``response.created`` …
``response.output_text.delta`` … ``response.completed``).  A stored response
(``store``, default true) keeps its conversation so a later request's
``previous_response_id`` continues it; at most ``MAX_STORED`` responses and
``MAX_STORED_CHARS`` characters are kept, the oldest dropped first.  ``GET`` and
``DELETE /v1/responses/{id}`` read and drop one.  Function tools, ``tool_choice``,
``parallel_tool_calls``, ``text.format`` and the ``function_call`` / ``function_call_output`` input items go
through the chat path (:mod:`.responses_tools`): a reply's calls are ``function_call`` output items, streamed
as OpenAI streams them, and a stored response keeps them for the next turn's ``previous_response_id``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localinfer.serve.http.errors import APIError, bad
from localinfer.serve.http.responses_tools import (ToolEvents, chat_fields, history_message, input_messages,
                                                   output_items)
from localinfer.serve.http.schemas import _kind, parse
from localinfer.serve.http.sse import EventStream

MAX_STORED = 1000
MAX_STORED_CHARS = 64 << 20
REFUSED = ("reasoning", "prompt", "include", "background", "conversation")


class Store:
    """Stored responses, least recently stored first out, bounded in count and characters."""

    def __init__(self, max_items: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS):
        self.items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.max_items, self.max_chars, self.chars = max_items, max_chars, 0

    def put(self, response: dict, messages: list[dict]) -> None:
        size = sum(len(m["content"] or "") + len(str(m.get("tool_calls") or "")) for m in messages)
        self.items[response["id"]] = (response, messages, size)
        self.chars += size
        while self.items and (len(self.items) > self.max_items or self.chars > self.max_chars):
            _, (_, _, n) = self.items.popitem(last=False)
            self.chars -= n

    def get(self, rid: str) -> tuple[dict, list[dict]]:
        if rid not in self.items:
            raise APIError(404, f"no stored response {rid[:80]!r} (responses are kept in memory, at most "
                                f"{self.max_items})", param="previous_response_id", code="previous_response_not_found")
        response, messages, _ = self.items[rid]
        return response, messages

    def delete(self, rid: str) -> None:
        self.get(rid)
        _, _, n = self.items.pop(rid)
        self.chars -= n


def _messages(body: dict) -> list[dict]:
    """Chat messages from ``instructions`` and ``input``."""
    out = []
    inst = body.get("instructions")
    if inst is not None:
        if not isinstance(inst, str):
            raise bad("instructions", f"instructions must be a string, got {_kind(inst)}")
        out.append({"role": "system", "content": inst})
    v = body.get("input")
    if isinstance(v, str):
        return out + [{"role": "user", "content": v}]
    if not isinstance(v, list) or not v:
        raise bad("input", f"input must be a string or a non-empty array of messages, got {_kind(v)}")
    return out + input_messages(v)


def routes(srv) -> list:
    store = Store()
    srv.responses_store = store

    def envelope(rid: str, body: dict, status: str, output: list[dict], usage: dict | None, reason: str | None,
                 prev: str | None, created: int) -> dict:
        text = body.get("text") if isinstance(body.get("text"), dict) else {}
        return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "model": srv.config.model_id, "output": output,
                "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
                "previous_response_id": prev, "reasoning": {"effort": None, "summary": None},
                "store": body.get("store", True) is not False, "temperature": body.get("temperature"),
                "text": {"format": text.get("format") or {"type": "text"}},
                "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
                "top_p": body.get("top_p"), "truncation": "disabled", "usage": usage, "user": body.get("user"),
                "metadata": body.get("metadata") or {}}

    async def create(request: Request) -> Response:
        body = await srv.body(request)
        if not isinstance(body, dict):
            raise bad(None, f"the request body must be a JSON object, got {_kind(body)}")
        for name in REFUSED:
            if body.get(name) not in (None, [], {}, "", "auto", "none"):
                raise bad(name, f"{name} is not supported by this server yet", code="unsupported_parameter")
        prev = body.get("previous_response_id")
        history: list[dict] = []
        if prev is not None:
            if not isinstance(prev, str):
                raise bad("previous_response_id", f"previous_response_id must be a string, got {_kind(prev)}")
            history = [m for m in store.get(prev)[1] if m["role"] != "system"]   # instructions are not carried
        new = _messages(body)
        k = 1 if body.get("instructions") is not None else 0     # this request's instructions lead
        messages = new[:k] + history + new[k:]
        ob = {"model": body.get("model"), "messages": messages, "max_completion_tokens": body.get("max_output_tokens"),
              "temperature": body.get("temperature"), "top_p": body.get("top_p"), **chat_fields(body)}
        spec = await srv.prep.parse(ob, lambda: parse(ob, chat=True))
        srv.check_model(spec.model)
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise bad("stream", f"stream must be true or false, got {_kind(stream)}")
        prompts = await srv.tokens(spec)
        gen = srv.generation(request, spec, prompts)
        rid, created = "resp_" + uuid.uuid4().hex, int(time.time())

        def finish(content: str | None, calls: list[dict], reason: str | None) -> dict:
            u = gen.usage()
            usage = {"input_tokens": u["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u["total_tokens"]}
            status = "incomplete" if reason == "length" else "completed"
            out = envelope(rid, body, status, output_items(rid, content, calls), usage, reason, prev, created)
            if out["store"]:
                store.put(out, [*messages, history_message(content, calls)])
            return out

        handed_off = False
        try:
            await gen.first()
            if not stream:
                parts, reason = [], None
                async for _, text, why in gen.pieces():
                    parts.append(text)
                    reason = why or reason
                if gen.tools is not None:
                    return JSONResponse(finish(*gen.tools[0].result(cut=reason == "length"), reason))
                return JSONResponse(finish("".join(parts), [], reason))
            handed_off = True
            make = tool_events if gen.tools is not None else events
            return EventStream(make(gen, rid, created, body, prev, envelope, finish),
                               lambda completed: gen.close())
        finally:
            if not handed_off:
                gen.close()

    async def retrieve(request: Request) -> Response:
        return JSONResponse(store.get(request.path_params["rid"])[0])

    async def delete(request: Request) -> Response:
        rid = request.path_params["rid"]
        store.delete(rid)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    from localinfer.serve.http.app import handled

    out = []
    for prefix in ("/v1", ""):
        out += [Route(f"{prefix}/responses", handled(create, srv.runtime), methods=["POST"]),
                Route(prefix + "/responses/{rid}", handled(retrieve, srv.runtime), methods=["GET"]),
                Route(prefix + "/responses/{rid}", handled(delete, srv.runtime), methods=["DELETE"])]
    return out


def _writer():
    seq = 0

    def ev(kind: str, **fields) -> bytes:
        nonlocal seq
        data = json.dumps({"type": kind, "sequence_number": seq, **fields}, ensure_ascii=False)
        seq += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    return ev


async def tool_events(gen, rid: str, created: int, body: dict, prev, envelope, finish):
    """The stream of a reply that may call tools: output items as the chat deltas open them (responses_tools)."""
    ev = _writer()
    start = envelope(rid, body, "in_progress", [], None, None, prev, created)
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    te = ToolEvents(rid, ev)
    reason = None
    try:
        async for _, deltas, why in gen.pieces():
            reason = why or reason
            for frame in te.feed(deltas or []):
                yield frame
    except APIError as err:
        yield ev("error", code=err.code, message=err.message, param=err.param)
        return
    done = finish(*gen.tools[0].result(cut=reason == "length"), reason)
    for frame in te.done(done):
        yield frame
    yield ev("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)


async def events(gen, rid: str, created: int, body: dict, prev, envelope, finish):
    """The Responses API's stream: created, in_progress, the output item and text part, deltas, done, completed."""
    seq = 0
    item_id = "msg_" + rid[5:]

    def ev(kind: str, **fields) -> bytes:
        nonlocal seq
        data = json.dumps({"type": kind, "sequence_number": seq, **fields}, ensure_ascii=False)
        seq += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    start = envelope(rid, body, "in_progress", [], None, None, prev, created)
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}
    yield ev("response.output_item.added", output_index=0, item=item)
    yield ev("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
             part={"type": "output_text", "text": "", "annotations": []})
    parts, reason = [], None
    try:
        async for _, text, why in gen.pieces():
            reason = why or reason
            if text:
                parts.append(text)
                yield ev("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                         delta=text, logprobs=[])
    except APIError as err:
        yield ev("error", code=err.code, message=err.message, param=err.param)
        return
    text = "".join(parts)
    part = {"type": "output_text", "text": text, "annotations": []}
    yield ev("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text, logprobs=[])
    yield ev("response.content_part.done", item_id=item_id, output_index=0, content_index=0, part=part)
    done = finish(text, [], reason)
    yield ev("response.output_item.done", output_index=0, item=done["output"][0] if done["output"] else
             {"type": "message", "id": item_id, "status": "completed", "role": "assistant", "content": [part]})
    yield ev("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)

