"""Server-sent events (the WHATWG ``text/event-stream`` format: ``data: <json>\\n\\n``, ending ``data: [DONE]``)
and client-disconnect detection.

A disconnect must cancel the request at once, not when the next token fails
to send (after a long prefill, or while queued), so every generation runs a
watcher task that waits on the ASGI ``receive`` channel: after the body, the
next message a server sends there is ``http.disconnect``, when the peer goes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from localinfer.serve.http.direct import Spill

DONE = b"data: [DONE]\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def text(s: str) -> bytes:
    """A string as ``event`` writes it inside a frame (a frame cut around its text puts this between the parts)."""
    return json.dumps(s, ensure_ascii=False).encode()


def watch_disconnect(receive, on_disconnect: Callable[[], None]) -> asyncio.Task:
    """A task that calls ``on_disconnect`` when the client goes away (cancel it when the response is done)."""
    async def watch():
        while True:
            msg = await receive()
            if msg.get("type") == "http.disconnect":
                on_disconnect()
                return

    return asyncio.get_running_loop().create_task(watch())


class EventStream:
    """An ASGI response that sends ``body`` (SSE frames, or NDJSON lines with ``media_type``) and calls
    ``on_close(completed)`` however it ends; with ``direct``, a stream whose token frames the relay thread may
    write (``body`` then yields the ``Spill`` of a write the socket did not take whole too)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[bool], None],
                 media_type: str = "text/event-stream", direct=None):
        self.body, self.on_close, self.media_type = body, on_close, media_type
        self.direct = direct      # a DirectSink (http/direct.py): offered the stream after each send

    async def __call__(self, scope, receive, send) -> None:
        completed = False
        try:
            headers = [(b"content-type", self.media_type.encode() + b"; charset=utf-8")]
            headers += [(k.encode(), v.encode()) for k, v in HEADERS.items()]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for frame in self.body:
                if isinstance(frame, Spill):
                    self.direct.write_spill(frame)
                else:
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
                if self.direct is not None:
                    self.direct.try_on()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            completed = True
        except OSError:
            pass                                  # the client went away mid-send
        except Exception:
            logging.getLogger("localinfer.serve").exception("stream failed")
        finally:
            self.on_close(completed)
