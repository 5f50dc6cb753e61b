"""The browser's pages: the chat page at ``/``, the engine view at ``/engine``, their files, and the engine state.

The pages and their files (``static/``: HTML, CSS, JS, no build step, nothing fetched from elsewhere) load
without the API key, so a browser can show the form that asks for it; every data call they make
(``/v1/...``, ``/metrics``) sends it, and the Host check covers them all.  Every response here carries a
Content-Security-Policy that allows only this origin's scripts, styles and connections (no inline script,
no framing) and ``X-Content-Type-Options: nosniff``.  ``GET /v1/engine/state`` is the engine view's JSON
(:func:`localinfer.serve.http.state.engine_state`, documented in docs/serving.md), with prompt text only
under ``serve --show-prompts``.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localinfer.serve.http.errors import APIError
from localinfer.serve.http.state import engine_state

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}
TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
PAGES = {"/": "chat.html", "/engine": "engine.html"}
FRESH_WAIT_S = 1.0       # a first read waits this long at most for the engine thread's first snapshot


def public(path: str) -> bool:
    """Paths served without the API key: the pages and their files (they hold no data)."""
    return path in PAGES or path.startswith("/static/")


def static_files() -> dict[str, bytes]:
    """The pages' files by name, read once from the package."""
    root = resources.files("localinfer.serve.http.static")
    return {f.name: f.read_bytes() for f in root.iterdir()
            if f.is_file() and any(f.name.endswith(ext) for ext in TYPES)}


def page_routes(runtime, show_prompts: bool = False) -> list[Route]:
    files = static_files()

    def send(name: str) -> Response:
        ext = name[name.rfind("."):]
        return Response(files[name], media_type=TYPES[ext], headers=HEADERS)

    async def page(request: Request) -> Response:
        return send(PAGES[request.url.path])

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in files:
            err = APIError(404, f"no file {name[:80]!r} in the pages' files", code="not_found")
            return Response(err.json_bytes(), status_code=404, media_type="application/json", headers=HEADERS)
        return send(name)

    async def state(request: Request) -> Response:
        watch = runtime.watch
        fresh = watch is None or not watch.watched       # nobody polled lately: the snapshot is old or absent
        out = engine_state(runtime, show_prompts)
        if fresh and runtime.state == "ready":
            end = time.monotonic() + FRESH_WAIT_S
            while not runtime.watch.fresh.is_set() and time.monotonic() < end:
                await asyncio.sleep(0.02)
            out = engine_state(runtime, show_prompts)
        return JSONResponse(out, headers=HEADERS)

    return [Route("/", page, methods=["GET"]), Route("/engine", page, methods=["GET"]),
            Route("/static/{name}", asset, methods=["GET"]),
            Route("/v1/engine/state", state, methods=["GET"])]
