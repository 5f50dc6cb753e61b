"""A streamed reply's token frames rendered and written to its socket off the event loop, by the relay thread.

Each streamed token used to cross three threads: the engine thread handed it to the relay, the relay woke the
event loop, and the loop's Python turned it into an SSE frame and wrote it (uvicorn's send path; uvloop makes
the write holding the GIL): ~0.3 ms of loop CPU and ~0.08 of the relay's a token at one client, on the cores
ggml's threads compute on.  A :class:`DirectSink` has the relay thread, which the engine thread wakes after each
step anyway, render the frame and write it with one ``write(2)`` (which lets go of the GIL): the loop is not woken
for the token at all, and the engine thread's own work a token stays a lock and a check.  Neither the rendering
nor the write is the engine thread's: the write wakes the client, which on a busy machine can take the writer's
core for ~0.5 ms, and a write made between steps delays the next one by that much (timed: 70-100 µs or 430-620;
benchmarks/results/serve_closed_loop_cpu.txt, tenth session).

The loop stays the owner of the connection.  It writes the head and every frame up to the point where it turns
the sink on (``try_on``, after a send, when every event it was handed has been written and uvicorn's transport
buffers nothing), and every frame from the reply's finish on (the frames of tokens routed before the finish are
the relay's: the reply's last token does not wait for the loop to wake).  In between the engine thread routes each
token as a :class:`Frame` and the relay renders and writes it, chunk-framed as uvicorn's HTTP/1.1 stream is, on a
duplicate of the socket's descriptor (a connection the loop closes meanwhile can never be written under a reused
descriptor number).  A write the socket does not take whole (a slow reader) turns the sink off: the bytes left, and
the frames of tokens routed before that, are handed to the loop as :class:`Spill` s, which it writes raw ahead of the
next frames (those under uvicorn's flow control), turning the sink on again once its buffer has drained.  A
write that fails (the client left) turns it off too; the loop's disconnect watcher cancels the request.  Changes of
hands happen under the sink's lock and every hand-off runs through the relay's one queue, so frames leave in the
order their tokens were made, and a reply's text state is touched by one thread at a time: the relay for tokens
routed while on, the loop for the others.

The bytes skip every ASGI layer between the app and uvicorn: no middleware that rewrites a response body
(compression) may be added to the app while this is on.  Only uvicorn's httptools protocol over plain TCP (no TLS),
on POSIX, for one-choice streams whose frames are plain text deltas (no tools, no logprobs) is served so;
``LOCALINFER_DIRECT_STREAM=0`` keeps every frame on the loop (to compare, or to debug).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable

from localinfer.util import env

log = logging.getLogger("localinfer.serve")
SCOPE_KEY = "localinfer.http_cycle"     # uvicorn's request cycle, put in the ASGI scope by ``capture``


def enabled() -> bool:
    return os.name == "posix" and _wanted(os.environ.get("LOCALINFER_DIRECT_STREAM", ""))


@functools.lru_cache(maxsize=4)
def _wanted(value: str) -> bool:
    """(Cached by the value: a wrong one is warned of once, not per request.)"""
    return env.choice("LOCALINFER_DIRECT_STREAM", ("1", "0"), "localinfer.serve") != "0"


def capture(app):
    """``app`` with uvicorn's httptools request cycle (whose ``send`` it is given) named in each HTTP scope."""
    async def asgi(scope, receive, send):
        if scope["type"] == "http":
            cycle = getattr(send, "__self__", None)
            if type(cycle).__module__ == "uvicorn.protocols.http.httptools_impl" and hasattr(cycle, "transport"):
                scope[SCOPE_KEY] = cycle
        try:
            await app(scope, receive, send)
        finally:
            scope.pop(SCOPE_KEY, None)     # the cycle holds the scope: no cycle of references left per request
    return asgi


@dataclasses.dataclass(frozen=True)
class Frame:
    """A token event routed while the sink is on: the relay thread renders and writes its frame."""

    sink: DirectSink
    event: object


@dataclasses.dataclass(frozen=True)
class Spill:
    """A frame's bytes the relay did not write (or not whole): the loop writes them as they are.  ``failed``: the
    relay could not render a token's frame, and the stream ends in error (as it did when the loop rendered it)."""

    data: bytes
    failed: bool = False
    token = None                  # what the loop's delivery reads of an event
    reason = None


class DirectSink:
    """One streamed choice's socket, written by the relay thread while on (module docstring).

    ``render(event)`` is the frame's body for a token event (None when the token adds nothing to send): run by the
    relay for tokens routed while the sink is on, by the loop for the others, never by both at once."""

    def __init__(self, cycle, render: Callable[[object], bytes | None]):
        self._cycle, self._render = cycle, render
        self._lock = threading.Lock()
        self._fd = -1             # a duplicate of the socket's descriptor while on
        self._writing = False     # the relay is writing on _fd (outside the lock): a close waits for it to end
        self._doomed = -1         # a descriptor to close once that write has ended
        self._pending = 0         # events and spills handed to the loop and not yet taken there
        self._closed = False      # finished, or the client left: never on again
        self.counts = [0, 0]      # frames written whole, and writes the socket did not take whole (the runtime's)

    @classmethod
    def for_scope(cls, scope, render) -> DirectSink | None:
        cycle = scope.get(SCOPE_KEY)
        if cycle is None or not enabled():
            return None
        return cls(cycle, render)

    # ---- the engine thread ------------------------------------------------------
    def route(self, ev):
        """A token event while on: a :class:`Frame` for the relay; otherwise (off, or a finish) the event itself,
        for the loop."""
        with self._lock:
            if self._fd >= 0 and ev.token is not None:
                return Frame(self, ev)
            if ev.token is None:           # a finish: the loop writes it and everything after, the relay the frames
                self._closed = True        # routed before it (write_frames turns the sink off as it passes it on)
            self._pending += 1
            return ev

    # ---- the relay thread -------------------------------------------------------
    def write(self, ev) -> Spill | None:
        """Render and write the frame of a token routed while on: None when it is written (or adds no text, or the
        client left), else the :class:`Spill` the loop writes: the bytes the socket did not take (a slow reader:
        the sink goes off), or all of them when it went off since (a finish, an earlier spill)."""
        try:
            body = self._render(ev)
        except Exception:  # noqa: BLE001 - logged; the stream ends (its token's text may be half applied)
            log.exception("rendering a streamed frame failed")
            self.close()
            with self._lock:
                self._pending += 1
            return Spill(b"", failed=True)
        if not body:
            return None
        data = b"%x\r\n%b\r\n" % (len(body), body)
        with self._lock:
            fd = self._fd
            if fd < 0:
                self._pending += 1
                return Spill(data)
            self._writing = True
        try:
            n = os.write(fd, data)            # outside the lock: the engine thread never waits for a write
        except BlockingIOError:
            n = 0
        except OSError:                       # the client went away: its watcher cancels the request
            n = -1
        with self._lock:
            self._writing = False
            if self._doomed >= 0:
                os.close(self._doomed)
                self._doomed = -1
            if n == len(data):
                self.counts[0] += 1
                return None
            self._off()
            if n < 0:
                self._closed = True
                return None
            self._pending += 1
            self.counts[1] += 1
            return Spill(data[n:])

    # ---- the loop ---------------------------------------------------------------
    def consumed(self) -> None:
        """The loop took an event it was handed (its frames are written before it takes the next)."""
        with self._lock:
            self._pending = max(0, self._pending - 1)

    def try_on(self) -> bool:
        """After a send: hand the token frames to the relay if nothing handed to the loop is unwritten and the
        transport buffers nothing.  True when the sink is on."""
        with self._lock:
            if self._fd >= 0:
                return True
            c = self._cycle
            if (self._closed or self._pending or self._writing or c.response_complete or c.disconnected
                    or not c.chunked_encoding or c.transport.is_closing() or c.transport.get_write_buffer_size()
                    or c.transport.get_extra_info("sslcontext") is not None):
                return False
            sock = c.transport.get_extra_info("socket")
            if sock is None:
                return False
            try:
                self._fd = os.dup(sock.fileno())
            except OSError:                  # out of descriptors: the loop keeps the stream
                return False
            return True

    def write_spill(self, spill: Spill) -> None:
        """Bytes the relay did not write, written as they are (they are already chunk-framed); nothing once the
        client has gone (uvicorn's send would not write either)."""
        if spill.failed:
            raise RuntimeError("the relay could not render a streamed frame (logged above)")
        c = self._cycle
        if spill.data and not c.disconnected and not c.transport.is_closing():
            c.transport.write(spill.data)

    def close(self) -> None:
        """The stream ended or the client left (any thread): off for good."""
        with self._lock:
            self._off()
            self._closed = True

    def _off(self) -> None:
        """(Under the lock) no more direct writes; the descriptor is closed now, or after the write in progress."""
        if self._fd >= 0:
            if self._writing:
                self._doomed = self._fd
            else:
                os.close(self._fd)
            self._fd = -1


def loop_events(out: list[tuple[object, object]]) -> list[tuple[object, object]]:
    """(Relay thread) What the loop gets of a step's events when :func:`write_frames` failed on them: all but the
    frames, each finish's sink off first (as ``write_frames`` turns it off)."""
    return write_frames([(h, ev) for h, ev in out if type(ev) is not Frame])


def write_frames(out: list[tuple[object, object]]) -> list[tuple[object, object]]:
    """(Relay thread) Render and write the :class:`Frame` s among a step's (handle, event) pairs: what is left is
    the loop's, in order (a frame not written whole becomes its :class:`Spill`)."""
    left = []
    for h, ev in out:
        if type(ev) is Frame and (ev := ev.sink.write(ev.event)) is None:
            continue
        if ev.reason is not None and h.sink is not None:      # a finish: its frames are written, the loop's from here
            h.sink.close()
        left.append((h, ev))
    return left
