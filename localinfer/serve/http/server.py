"""uvicorn around the app: a socket we bind ourselves, the engine thread's lifespan, and a graceful stop.

SIGINT/SIGTERM/SIGHUP: the first one stops accepting connections and makes
new requests on open connections answer 503, lets in-flight requests finish
for up to ``grace_s``, then cancels what is left (their KV freed; a stream
gets an error event, code ``shutting_down``, and ``[DONE]``; a reply not
streamed a 503), stops
the engine thread and returns normally (the CLI exits 0).  A second signal ends the
grace period at once (what runs is cancelled, every reply still ends in JSON or a
stream's error event); a third is uvicorn's force exit.  uvicorn re-raises a
captured signal after shutdown; this server does not, so the exit status is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time

import uvicorn
from starlette.applications import Starlette

from localinfer.serve.http import direct
from localinfer.serve.http.app import AppConfig, build_app
from localinfer.serve.http.limits import HEADER_TIMEOUT_S, KEEP_ALIVE_S, MAX_CONNECTIONS, protocol_class
from localinfer.serve.http.runtime import Runtime
from localinfer.util import env


def event_loop() -> str:
    """uvicorn's event loop: "auto", which is uvloop where it imports (the serve extra asks for it, except on
    Windows; the loop takes ~0.1 ms less CPU a streamed token from llama.cpp's threads there:
    benchmarks/results/serve_closed_loop_cpu.txt, fifth session) and the standard library's otherwise.
    ``LOCALINFER_EVENT_LOOP=asyncio`` keeps the standard library's (to compare, or to debug); ``auto`` and
    ``uvloop`` give the default, which is the standard library's where uvloop does not import."""
    wanted = env.choice("LOCALINFER_EVENT_LOOP", ("auto", "asyncio", "uvloop"), "localinfer.serve")
    return "asyncio" if wanted == "asyncio" else "auto"


SIGNALS = tuple(s for s in (signal.SIGINT, getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None))
                if s is not None)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, runtime: Runtime, grace_s: float):
        super().__init__(config)
        self.runtime, self.grace_s = runtime, grace_s
        self.stopped_by: int | None = None
        self.signals = 0
        self.prep = None                              # the app's Prep: prompts being tokenised

    def handle_exit(self, sig: int, frame) -> None:
        self.signals += 1
        if self.signals == 2:                         # stop now, still cleanly: every reply ends in JSON
            self._stop_engine(0.0)
            return
        if self.signals == 1:
            self.runtime.drain()                      # new requests: 503 from now on
            self._stop_engine(self.grace_s)           # the engine cancels what is left; streams end cleanly
        self.stopped_by = self.stopped_by or sig
        super().handle_exit(sig, frame)               # a third: uvicorn's force exit

    def _stop_engine(self, grace_s: float) -> None:
        """``runtime.shutdown_after`` once no prompt is being tokenised (within the grace period): an idle engine
        told to stop closes the model, and no tokeniser thread may be inside llama.cpp then."""
        at = time.monotonic() + grace_s

        def attempt():
            if self.prep is not None and self.prep.preparing and time.monotonic() < at:
                threading.Timer(0.02, attempt).start()
                return
            self.runtime.shutdown_after(max(0.0, at - time.monotonic()))
        attempt()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {s: signal.signal(s, self.handle_exit) for s in SIGNALS}
        try:
            yield
        finally:
            for s, handler in original.items():
                signal.signal(s, handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one).

    Made with ``proto=IPPROTO_TCP``: asyncio turns Nagle off (TCP_NODELAY) only on
    connections accepted from such a socket.  With proto 0 every keep-alive request
    after a connection's first waited ~40 ms for the client's delayed ACK (uvicorn
    writes a response's head and body separately), as did each streamed chunk.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(runtime: Runtime, app_config: AppConfig, *, grace_s: float = 10.0, log_level: str = "warning",
                header_timeout_s: float = HEADER_TIMEOUT_S, keep_alive_s: float = KEEP_ALIVE_S,
                max_connections: int = MAX_CONNECTIONS) -> tuple[_Server, Starlette]:
    """The server and its app; the connection limits are :mod:`.limits`'."""
    app = build_app(runtime, app_config)
    protocol = protocol_class(header_timeout_s, max_connections,
                              on_refused=runtime.metrics.reject)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        runtime.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            app.state.server.close()          # the embeddings context goes before the model it uses
            stopper = threading.Thread(target=runtime.stop, args=(0.0,), name="localinfer-stop", daemon=True)
            stopper.start()
            while stopper.is_alive():                       # not run_in_executor: works during interpreter exit
                await asyncio.sleep(0.02)

    app.router.lifespan_context = lifespan
    # uvicorn waits a little longer than the engine, so cancelled streams still send their last chunk
    # direct.capture: each HTTP scope names uvicorn's request cycle, whose socket a plain stream's frames go to
    config = uvicorn.Config(direct.capture(app), log_level=log_level, timeout_graceful_shutdown=grace_s + 2.0,
                            access_log=False, lifespan="on", server_header=False, date_header=True,
                            timeout_keep_alive=keep_alive_s, http=protocol, loop=event_loop(),
                            limit_concurrency=protocol.limit_connections + 1)   # the protocol caps
    server = _Server(config, runtime, grace_s)
    server.prep = app.state.prep
    return server, app


def serve(runtime: Runtime, app_config: AppConfig, sock: socket.socket, *, grace_s: float = 10.0,
          log_level: str = "warning", announce=None, **limits) -> int | None:
    """Serve on ``sock`` until a signal (or ``server.should_exit``); the signal number that stopped it."""
    server, _ = make_server(runtime, app_config, grace_s=grace_s, log_level=log_level, **limits)
    if announce is not None:
        announce(server)
    logging.getLogger("localinfer.serve").setLevel(logging.INFO if log_level in ("info", "debug") else logging.WARNING)
    server.run(sockets=[sock])
    sys.stderr.flush()
    return server.stopped_by
