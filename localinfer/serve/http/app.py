"""The Starlette app: routes, and the glue from a body to a :class:`Reply`.

Routes (each also without the ``/v1`` prefix, as llama-server serves them):
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``; ``GET /health`` (503 while loading, 200 when ready)
and ``GET /metrics`` (Prometheus text); the other faces add theirs
(:mod:`.faces`).  With one model loaded any model name is served and the reply
names the real one (llama-server's behaviour, so clients that hard-code
``gpt-3.5-turbo`` work); ``strict_model_names`` (``--strict-model-names``)
answers 404 to a name that is neither the model's nor an alias (vLLM's).
The access guard (Host, Origin/CORS, API key, body size) is :mod:`.guard`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field, replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localinfer.serve.http import pages
from localinfer.serve.http.errors import APIError, bad
from localinfer.serve.http.reply import Reply
from localinfer.serve.http.guard import LOOPBACK_NAMES, Guard, error_response
from localinfer.serve.http.intake import Prep, read_json
from localinfer.serve.http.limits import BODY_TIMEOUT_S
from localinfer.serve.http.metrics import CONTENT_TYPE
from localinfer.serve.http.runtime import Runtime, RuntimeState
from localinfer.serve.http.schemas import GenerationSpec, _short, parse
from localinfer.serve.http.sse import EventStream

__all__ = ["LOOPBACK_NAMES", "AppConfig", "build_app", "error_response"]

log = logging.getLogger("localinfer.serve")
DEADLINE_HEADER = "x-localinfer-deadline-ms"


@dataclass
class AppConfig:
    model_id: str                                  # the name /v1/models lists and replies carry
    aliases: tuple[str, ...] = ()                  # other names accepted in "model" (with strict_model_names)
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = LOOPBACK_NAMES
    allowed_origins: tuple[str, ...] = ()          # besides the server's own and localhost's ('*': any)
    strict_model_names: bool = False               # 404 for a model name that is not the model's or an alias
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = BODY_TIMEOUT_S
    template: object = None                        # a ChatTemplate, or a callable(tokenizer) -> ChatTemplate
    created: int = 0
    show_prompts: bool = False                     # the engine view shows prompt and output text (serve --show-prompts)
    default_max_tokens: int | None = None          # a request that gives no max_tokens (None: until the context ends)
    extra: dict = field(default_factory=dict)


class Server:
    """What every face's handlers share: the runtime, the config and the prompt preparation."""

    def __init__(self, runtime: Runtime, config: AppConfig):
        self.runtime, self.config = runtime, config
        self.prep = Prep(runtime, config)
        self.embeddings = None          # the embeddings face's context holder (embeddings.routes sets it)

    def close(self) -> None:
        """Free what the faces hold on the model (before the engine closes it), then the prep threads."""
        if self.embeddings is not None:
            self.embeddings.close()
        self.prep.close()

    def card(self, model_id: str | None = None) -> dict:
        return {"id": model_id or self.config.model_id, "object": "model", "created": self.config.created,
                "owned_by": "localinfer", "max_model_len": self.runtime.context_tokens}

    def check_model(self, name: str) -> None:
        """Any name with one model loaded; with strict names only the model's and its aliases (else 404).
        No name (``""``) is the loaded model."""
        if self.config.strict_model_names and name and name not in (self.config.model_id, *self.config.aliases):
            raise APIError(404, f"model {_short(name)} does not exist; this server serves "
                                f"{self.config.model_id!r}", param="model", code="model_not_found")

    async def body(self, request: Request):
        return await read_json(request, self.config.max_body_bytes, self.config.body_timeout_s)

    async def tokens(self, spec: GenerationSpec) -> list:
        """The request made ready per prompt (:class:`.prepare.Prepared`, worker threads), logit_bias ids
        checked against the vocabulary."""
        self.runtime.check_serving()
        n = spec.n * max(1, len(spec.prompts))
        if spec.chat:
            out = [await self.prep.run(self.prep.chat, spec, n=n)]
        else:
            out = [await self.prep.run(self.prep.text, spec, p, n=n) for p in spec.prompts]
        n_vocab = self.runtime.tokenizer.n_vocab
        wrong = [t for t, _ in spec.logit_bias if t >= n_vocab]
        if wrong:
            raise bad("logit_bias", f"logit_bias token ids must lie in 0..{n_vocab - 1}, got {wrong[0]}")
        return out

    def generation(self, request: Request, spec: GenerationSpec, readies: list,
                   echo: list[str] | None = None, direct: bool = False) -> Reply:
        """The reply; ``direct``: its SSE stream's token frames may be written by the relay thread (:mod:`.direct`)."""
        prompts = [r.prompt for r in readies]
        if spec.max_tokens is None and self.config.default_max_tokens:
            ctx = self.runtime.context_tokens          # the default fills what the longest prompt leaves, at most
            free = ctx - max(map(len, prompts))
            spec = replace(spec, max_tokens=max(1, min(self.config.default_max_tokens, free))) if free > 0 else spec
        max_tokens = min(_check_length(spec, len(p), self.runtime.context_tokens) for p in prompts)
        return Reply(self.runtime, spec, readies, max_tokens, self.config.model_id, request.receive,
                     self.runtime.tokenizer.eos_ids, echo, scope=request.scope if direct else None)


def build_app(runtime: Runtime, config: AppConfig) -> Starlette:
    srv = Server(runtime, config)

    async def health(request: Request) -> Response:
        state = runtime.state
        status = 200 if state is RuntimeState.READY else 503
        # no error text: /health answers without the API key, and a load error names the model's path
        return JSONResponse({"status": {"ready": "ok"}.get(state, state)}, status_code=status)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [srv.card()]})

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        srv.check_model(name)
        return JSONResponse(srv.card(name))

    async def metrics(request: Request) -> Response:
        # the engine thread publishes when a request comes, goes or is admitted, else every 50 ms while it steps;
        # requests handed to it since (or still being tokenised)
        # count as waiting now, so a long prefill step does not show 0 running and 0 waiting
        m = runtime.metrics
        behind = runtime.outstanding + srv.prep.preparing - m.gauge("requests_running")
        if behind > m.gauge("requests_waiting"):
            m.publish({**m.snapshot.values, "requests_waiting": behind})
        return Response(m.exposition(), media_type=CONTENT_TYPE)

    async def generate(request: Request, chat: bool) -> Response:
        body = await srv.body(request)
        # off the event loop: a schema or grammar compiles here (bounded: generation/grammar_guard.py), and
        # /health and the other clients go on meanwhile
        spec = await srv.prep.parse(body, functools.partial(parse, body, chat=chat,
                                                            deadline_header=request.headers.get(DEADLINE_HEADER)))
        srv.check_model(spec.model)
        prompts = await srv.tokens(spec)
        echo = None
        if spec.echo:
            echo = [p if isinstance(p, str) else runtime.tokenizer.detokenize(list(p)) for p in spec.prompts]
        gen = srv.generation(request, spec, prompts, echo, direct=True)
        return await answer(gen, spec.stream)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, True)

    async def completions(request: Request) -> Response:
        return await generate(request, False)

    routes = [Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"])]
    for prefix in ("/v1", ""):
        routes += [Route(f"{prefix}/models", handled(models, runtime), methods=["GET"]),
                   Route(prefix + "/models/{model:path}", handled(model, runtime), methods=["GET"]),
                   Route(f"{prefix}/chat/completions", handled(chat_completions, runtime), methods=["POST"]),
                   Route(f"{prefix}/completions", handled(completions, runtime), methods=["POST"])]
    from localinfer.serve.http import faces

    routes += faces.routes(srv)
    routes += pages.page_routes(runtime, config.show_prompts)      # /, /engine, /static/*, /v1/engine/state
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_exception, Exception: _internal})
    app.add_middleware(Guard, config=config, runtime=runtime)
    app.state.prep = srv.prep
    app.state.server = srv
    return app


async def answer(gen: Reply, stream: bool) -> Response:
    """The OpenAI answer of a built generation: JSON, or SSE frames; the generation closed however it ends."""
    handed_off = False
    try:
        await gen.first()
        if not stream:
            return JSONResponse(await gen.response())
        handed_off = True
        return EventStream(gen.frames(), lambda completed: gen.close(), direct=gen.sink)
    finally:
        if not handed_off:
            gen.close()


def handled(handler, runtime: Runtime):
    """The handler with its APIErrors answered in OpenAI's shape (and counted)."""
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as err:
            runtime.metrics.reject(err.status)
            return error_response(err)
    return wrapped


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    path = _short(request.url.path)
    msg = {404: f"no route {path}", 405: f"method {request.method} is not allowed on {path}"}
    return error_response(APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail)), code="not_found"
                                   if exc.status_code == 404 else None))


async def _internal(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s", request.url.path)
    return error_response(APIError(500, f"internal error ({type(exc).__name__})", code="internal_error"))


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
