"""OpenAI's Responses API (``/v1/responses``), the one the Agents SDK uses by default: text in, text out.

``input`` is a string or a list of messages (``role`` + string content or
``input_text``/``output_text`` parts); ``instructions`` becomes a system
message.  The reply is a ``response`` object with one ``message`` output item;
``stream: true`` sends the event sequence (``response.created`` …
``response.output_text.delta`` … ``response.completed``).  A stored response
(``store``, default true) keeps its conversation so a later request's
``previous_response_id`` continues it; at most ``MAX_STORED`` responses and
``MAX_STORED_CHARS`` characters are kept, the oldest dropped first.  ``GET`` and
``DELETE /v1/responses/{id}`` read and drop one.  Tools and structured output
are refused (400) until the server has them: they share the chat path.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localinfer.serve.http.errors import APIError, bad
from localinfer.serve.http.schemas import _kind, parse
from localinfer.serve.http.sse import EventStream

MAX_STORED = 1000
MAX_STORED_CHARS = 64 << 20
REFUSED = ("tools", "tool_choice", "reasoning", "prompt", "include", "background", "conversation")
TEXT_PARTS = ("input_text", "output_text", "text")


class Store:
    """Stored responses, least recently stored first out, bounded in count and characters."""

    def __init__(self, max_items: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS):
        self.items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.max_items, self.max_chars, self.chars = max_items, max_chars, 0

    def put(self, response: dict, messages: list[dict]) -> None:
        size = sum(len(m["content"]) for m in messages)
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
    for i, item in enumerate(v):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else _kind(item)
            raise bad(where, f"{where} must be a message (tool calls are not supported yet), got {kind!r}")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") not in TEXT_PARTS or not isinstance(p.get("text"), str):
                    raise bad(f"{where}.content[{j}]", f"{where}.content[{j}] must be a text part "
                                                      "{type: input_text, text}")
                texts.append(p["text"])
            content = "".join(texts)
        out.append({"role": item.get("role"), "content": content})
    return out


def routes(srv) -> list:
    store = Store()
    srv.responses_store = store

    def envelope(rid: str, body: dict, status: str, text: str | None, usage: dict | None, reason: str | None,
                 prev: str | None, created: int) -> dict:
        output = []
        if text is not None:
            output = [{"type": "message", "id": "msg_" + rid[5:], "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]}]
        return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "model": srv.config.model_id, "output": output, "parallel_tool_calls": True,
                "previous_response_id": prev, "reasoning": {"effort": None, "summary": None},
                "store": body.get("store", True) is not False, "temperature": body.get("temperature"),
                "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
                "top_p": body.get("top_p"), "truncation": "disabled", "usage": usage, "user": body.get("user"),
                "metadata": body.get("metadata") or {}}

    async def create(request: Request) -> Response:
        body = await srv.body(request)
        if not isinstance(body, dict):
            raise bad(None, f"the request body must be a JSON object, got {_kind(body)}")
        for name in REFUSED:
            if body.get(name) not in (None, [], {}, "", "auto", "none"):
                raise bad(name, f"{name} is not supported by this server yet", code="unsupported_parameter")
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        if fmt not in (None, {"type": "text"}):
            raise bad("text.format", "only text output is supported by this server yet",
                      code="unsupported_parameter")
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
              "temperature": body.get("temperature"), "top_p": body.get("top_p")}
        spec = parse(ob, chat=True)
        srv.check_model(spec.model)
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise bad("stream", f"stream must be true or false, got {_kind(stream)}")
        prompts = await srv.tokens(spec)
        gen = srv.generation(request, spec, prompts)
        rid, created = "resp_" + uuid.uuid4().hex, int(time.time())

        def finish(text: str, reason: str | None) -> dict:
            u = gen.usage()
            usage = {"input_tokens": u["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u["total_tokens"]}
            out = envelope(rid, body, "incomplete" if reason == "length" else "completed", text, usage, reason,
                           prev, created)
            if out["store"]:
                store.put(out, [*messages, {"role": "assistant", "content": text}])
            return out

        handed_off = False
        try:
            await gen.first()
            if not stream:
                parts, reason = [], None
                async for _, text, why in gen.pieces():
                    parts.append(text)
                    reason = why or reason
                return JSONResponse(finish("".join(parts), reason))
            handed_off = True
            return EventStream(events(gen, rid, created, body, prev, envelope, finish),
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


async def events(gen, rid: str, created: int, body: dict, prev, envelope, finish):
    """The Responses API's stream: created, in_progress, the output item and text part, deltas, done, completed."""
    seq = 0
    item_id = "msg_" + rid[5:]

    def ev(kind: str, **fields) -> bytes:
        nonlocal seq
        data = json.dumps({"type": kind, "sequence_number": seq, **fields}, ensure_ascii=False)
        seq += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    start = envelope(rid, body, "in_progress", None, None, None, prev, created)
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
    done = finish(text, reason)
    yield ev("response.output_item.done", output_index=0, item=done["output"][0])
    yield ev("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)

