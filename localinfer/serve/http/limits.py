"""Connection limits below the ASGI app: uvicorn's HTTP/1.1 protocol with header limits, and a connection cap.

uvicorn times a connection only between requests (``timeout_keep_alive``,
armed after a response); a client that opens a connection and sends nothing,
or trickles its request headers a byte at a time, holds a socket forever, and
enough of them exhaust the descriptors.  :func:`protocol_class` makes uvicorn's
``HttpToolsProtocol`` (llhttp, in C) where httptools imports, its pure-Python
``H11Protocol`` otherwise (``LOCALINFER_HTTP=h11`` asks for it), that

* gives each request ``header_timeout_s`` to deliver its whole request line and
  headers, counted from the connection's opening or from the first byte after
  the previous response (nginx's ``client_header_timeout``): then a 408 and the
  connection closes;
* refuses connections past ``max_connections`` at once (a 503, closed), and
  the cap never reaches the process's descriptor limit (:func:`connection_cap`);
* refuses request headers past ``MAX_HEAD_BYTES`` (431; h11 has its own cap at that size, answered 400);
* answers the HTTP parser's errors in OpenAI's JSON shape, not plain text.

httptools takes less of the event loop's CPU a streamed token than h11 (user time 0.24-0.28 against 0.30-0.35 ms
at one client, four alternated pairs, procfs), and the loop shares two cores with llama.cpp's threads here.

A client's end of input (FIN) still ends its request, as uvicorn has it: a half-close cannot be told from a
hang-up, and a hung-up request must free its slot and KV at once (Go's net/http, nginx and llama-server do the same).

The body's own time limit is applied where the app reads it (:mod:`.intake`).
"""

from __future__ import annotations

import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from localinfer.serve.http.errors import APIError
from localinfer.util import env

HEADER_TIMEOUT_S = 10.0       # request line + headers, from the first byte (or the connection's opening)
BODY_TIMEOUT_S = 60.0         # the whole body, once the headers are in
KEEP_ALIVE_S = 5              # an idle connection between requests (uvicorn's timeout_keep_alive)
MAX_CONNECTIONS = 512
MAX_HEAD_BYTES = 16 * 1024    # request line + headers (h11's max_incomplete_event_size)
FD_RESERVE = 64               # descriptors kept for the model files, logs and the engine


def connection_cap(wanted: int) -> int:
    """``wanted``, lowered so that the open connections stay below the descriptor limit (RLIMIT_NOFILE).

    The soft limit is first raised to the hard one (as most servers do: a shell's default of 1024, or 64 under
    some supervisors, is far below what the kernel allows the process); what is left after the reserve (half the
    limit at most, so a low limit still serves many) bounds the connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        target = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - min(FD_RESERVE, soft // 2)))


def raw_error(err: APIError) -> bytes:
    """A whole HTTP/1.1 response for ``err`` that closes the connection (written below the HTTP parser)."""
    body = err.json_bytes()
    phrase = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
              503: "Service Unavailable"}.get(err.status, "Error")
    head = (f"HTTP/1.1 {err.status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


def parser() -> type:
    """uvicorn's protocol class to build on: httptools' unless it does not import or ``LOCALINFER_HTTP=h11``."""
    wanted = env.choice("LOCALINFER_HTTP", ("auto", "httptools", "h11"), "localinfer.serve")
    if wanted != "h11":
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
            return HttpToolsProtocol
        except ImportError:
            pass
    return H11Protocol


class _H11Hooks:
    """Where h11 says what the guard needs: a cycle is made when a request's head is complete."""

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:
            self._headers_in()

    def _body_coming(self) -> bool:
        """A request's body is still to come (after an early reply too, where uvicorn's cycle does not say)."""
        return self.conn.their_state is h11.SEND_BODY


class _HttpToolsHooks:
    """llhttp's callbacks.  A chunk may hold the end of one message and the start of the next: the head then counts
    from the next chunk on (one read of slack), so the requests before it are not counted as its bytes."""

    _body_due = False                     # a request's body is still to come

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_bytes < 0:
            self._head_bytes, self._mid = 0, self._ended

    def on_headers_complete(self) -> None:
        self._headers_in()
        self._body_due = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._ended, self._body_due = True, False
        super().on_message_complete()

    def _body_coming(self) -> bool:
        return self._body_due


def protocol_class(header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                   on_refused=None, base: type | None = None) -> type:
    """A subclass of ``base`` (default :func:`parser`'s) with these limits; ``on_refused(status)`` counts what it
    refuses."""
    cap = connection_cap(max_connections)
    base = base or parser()
    hooks = _H11Hooks if issubclass(base, H11Protocol) else _HttpToolsHooks

    class Guarded(hooks, base):
        limit_header_s = header_timeout_s
        limit_connections = cap
        _header_timer = None
        _head_bytes = -1                      # bytes of the request head so far; -1: no head is being read
        _ended = False                        # a message ended inside this chunk (httptools says)
        _mid = False                          # this chunk's head began after another message in it (httptools says)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > self.limit_connections:
                self._refuse(APIError(503, f"the server holds {self.limit_connections} connections, its limit "
                                           "(--max-connections); retry later", code="too_many_connections",
                                      headers={"Retry-After": "1"}))
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            c = self.cycle
            if self._header_timer is None and (c is None or c.response_complete):
                self._arm()                       # the first byte of a next request: its headers are timed
            # a next request pipelined behind a response in flight waits unread, as h11 makes it wait (llhttp would
            # parse its head at once, with no cap and no timer: the head is counted only between responses)
            ahead = c is not None and not c.response_complete and not c.more_body
            self._ended = self._mid = False
            super().data_received(data)
            if self._head_bytes >= 0:             # inside a head after this chunk: all of it counted as head,
                self._head_bytes += 0 if self._mid else len(data)     # unless the head began after a message in it
                if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                    self._refuse(self._too_large())
            elif ahead and not self.transport.is_closing():
                self.flow.pause_reading()         # uvicorn resumes it when the response completes

        def send_400_response(self, msg: str) -> None:
            self._refuse(APIError(400, f"the request is not valid HTTP/1.1: {msg}", code="invalid_http"))

        def _too_large(self) -> APIError:
            return APIError(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes",
                            code="headers_too_large")

        # ---- the header timer ------------------------------------------------------
        def _arm(self) -> None:
            self._disarm()                        # a head already counted (behind a reply) keeps its count
            self._head_bytes = -1 if self._body_coming() else max(self._head_bytes, 0)
            self._header_timer = self.loop.call_later(self.limit_header_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_in(self) -> None:
            self._disarm()
            self._head_bytes = -1

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            if self._head_bytes > 0:              # part of a request came: say why it ends
                self._refuse(APIError(408, f"the request headers did not arrive within {self.limit_header_s:g} s "
                                           "(--header-timeout)", code="request_timeout"))
            else:
                self.transport.close()

        def _refuse(self, err: APIError) -> None:
            """Answer ``err`` and close; only close where a reply is in flight or its request's body still comes
            (a second status line would land inside a stream, or after an early 401/413)."""
            if on_refused is not None:
                on_refused(err.status)
            if not self.transport.is_closing():
                c = self.cycle
                if c is None or (c.response_complete and not self._body_coming()):
                    self.transport.write(raw_error(err))
                self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
