"""The Starlette app: routes, the access guard, and the glue from a body to a :class:`Generation`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /health`` (503 while loading, 200 when ready),
``GET /metrics`` (Prometheus text).  The guard (pure ASGI, before routing)
checks, in this order: the Host header against the allowed names (DNS
rebinding: a page on evil.example resolving to 127.0.0.1 still sends
``Host: evil.example``; an IP address or a ``*.localhost`` name names nothing
an attacker can rebind, so those always pass, as in Ollama's check), with or
without an API key; the bearer token on every path but ``/health``; the
declared body size.  No CORS headers are ever sent, so browsers keep other origins out.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localinfer.serve.http import pages
from localinfer.serve.http.errors import APIError, bad
from localinfer.serve.http.generation import Generation
from localinfer.serve.http.metrics import CONTENT_TYPE
from localinfer.serve.http.prepare import prepare
from localinfer.serve.http.runtime import Runtime, RuntimeState
from localinfer.serve.http.schemas import GenerationSpec, parse
from localinfer.serve.http.sse import EventStream

log = logging.getLogger("localinfer.serve")
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")
DEADLINE_HEADER = "x-localinfer-deadline-ms"


@dataclass
class AppConfig:
    model_id: str                                  # the name /v1/models lists and requests must give
    aliases: tuple[str, ...] = ()                  # other names accepted in "model"
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = LOOPBACK_NAMES
    max_body_bytes: int = 4 << 20
    template: object = None                        # a ChatTemplate, or a callable(tokenizer) -> ChatTemplate
    created: int = 0
    show_prompts: bool = False                     # the engine view shows prompt and output text (serve --show-prompts)
    extra: dict = field(default_factory=dict)


def error_response(err: APIError) -> Response:
    return Response(err.json_bytes(), status_code=err.status, media_type="application/json", headers=err.headers)


def build_app(runtime: Runtime, config: AppConfig) -> Starlette:
    prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localinfer-prep")   # templates, tokenizer

    async def health(request: Request) -> Response:
        state = runtime.state
        status = 200 if state is RuntimeState.READY else 503
        # no error text: /health answers without the API key, and a load error names the model's path
        return JSONResponse({"status": {"ready": "ok"}.get(state, state)}, status_code=status)

    async def models(request: Request) -> Response:
        card = {"id": config.model_id, "object": "model", "created": config.created, "owned_by": "localinfer"}
        card["max_model_len"] = runtime.context_tokens
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(request: Request) -> Response:
        return Response(runtime.metrics.exposition(), media_type=CONTENT_TYPE)

    async def generate(request: Request, chat: bool) -> Response:
        spec = parse(await read_json(request, config.max_body_bytes), chat=chat,
                     deadline_header=request.headers.get(DEADLINE_HEADER))
        if spec.model not in (config.model_id, *config.aliases):
            raise APIError(404, f"model {spec.model!r} does not exist; this server serves {config.model_id!r}",
                           param="model", code="model_not_found")
        runtime.check_serving()
        loop = asyncio.get_running_loop()
        ready = await loop.run_in_executor(prep, prepare, runtime, config, spec)
        max_tokens = _check_length(spec, len(ready.prompt), runtime.context_tokens)
        gen = Generation(runtime, spec, ready, max_tokens, config.model_id, request.receive,
                         runtime.tokenizer.eos_ids)
        handed_off = False
        try:
            await gen.first()
            if not spec.stream:
                return JSONResponse(await gen.response())
            handed_off = True
            return EventStream(gen.frames(), lambda completed: gen.close())
        finally:
            if not handed_off:
                gen.close()

    async def chat_completions(request: Request) -> Response:
        return await generate(request, True)

    async def completions(request: Request) -> Response:
        return await generate(request, False)

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/v1/chat/completions", _errors(chat_completions, runtime), methods=["POST"]),
              Route("/v1/completions", _errors(completions, runtime), methods=["POST"])]
    routes += pages.page_routes(runtime, config.show_prompts)      # /, /engine, /static/*, /v1/engine/state
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_exception, Exception: _internal})
    app.add_middleware(Guard, config=config, runtime=runtime)
    app.state.prep = prep
    return app


def _errors(handler, runtime: Runtime):
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as err:
            runtime.metrics.rejected.labels(str(err.status)).inc()
            return error_response(err)
    return wrapped


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    msg = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on {request.url.path}"}
    return error_response(APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail)), code="not_found"
                                   if exc.status_code == 404 else None))


async def _internal(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s", request.url.path)
    return error_response(APIError(500, f"internal error ({type(exc).__name__})", code="internal_error"))


# ---- the body --------------------------------------------------------------------
async def read_json(request: Request, cap: int):
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype not in ("application/json", ""):
        raise APIError(415, f"Content-Type must be application/json, got {ctype[:60]!r}", code="unsupported_media")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > cap:
            raise APIError(413, f"the request body is over the {cap}-byte limit (--max-body)", code="body_too_large")
    try:
        return json.loads(body)
    except UnicodeDecodeError:
        raise bad(None, "the request body is not UTF-8", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise bad(None, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                  code="invalid_json") from None


def _check_length(spec: GenerationSpec, n_prompt: int, context: int) -> int:
    name = "max_completion_tokens" if spec.chat else "max_tokens"
    if spec.max_tokens is None:
        if n_prompt >= context:
            raise bad("messages" if spec.chat else "prompt", f"the prompt is {n_prompt} tokens; the context holds "
                      f"{context}, leaving no room for a reply", code="context_length_exceeded")
        return context - n_prompt
    if n_prompt + spec.max_tokens > context:
        raise bad(name, f"the prompt ({n_prompt} tokens) + {name} ({spec.max_tokens}) = "
                        f"{n_prompt + spec.max_tokens} tokens is over the {context}-token context",
                  code="context_length_exceeded")
    return spec.max_tokens


# ---- the guard -------------------------------------------------------------------
class Guard:
    """Host check, bearer token and declared body size, before any route runs."""

    def __init__(self, app, config: AppConfig, runtime: Runtime):
        self.app, self.config, self.runtime = app, config, runtime
        self.key = None if config.api_key is None else config.api_key.encode()
        self.hosts = {h.lower() for h in config.allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        err = self._check(scope.get("path", ""), headers)
        if err is not None:
            self.runtime.metrics.rejected.labels(str(err.status)).inc()
            return await error_response(err)(scope, receive, send)
        return await self.app(scope, receive, send)

    def _check(self, path: str, headers: dict[str, str]) -> APIError | None:
        host = _hostname(headers.get("host", ""))
        if not self._host_allowed(host):
            return APIError(403, f"Host {host[:80]!r} is not served here (--allow-host adds one)",
                            param="host", code="host_not_allowed")
        if self.key is not None and path != "/health" and not pages.public(path):   # pages ask for the key
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                return APIError(401, "missing or wrong API key: send Authorization: Bearer KEY" if auth
                                else "this server needs an API key: send Authorization: Bearer KEY",
                                code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, "Content-Length is not a number", param="content-length")
            if int(length) > self.config.max_body_bytes:
                return APIError(413, f"the request body is {int(length)} bytes; the limit is "
                                     f"{self.config.max_body_bytes} (--max-body)", code="body_too_large")
        return None

    def _host_allowed(self, host: str) -> bool:
        if "*" in self.hosts or host in self.hosts or host.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(host[1:-1] if host.startswith("[") else host)
        except ValueError:
            return False
        return True


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
