"""Ollama's API on the same engine, for tools that speak only it.

``POST /api/chat`` and ``POST /api/generate`` (NDJSON streaming by default, as
Ollama: one JSON object a line, the last with ``done: true``, the reason and
the counts and durations in nanoseconds), ``POST /api/embed`` and the older
``/api/embeddings``, ``GET /api/tags``, ``GET /api/ps``, ``POST /api/show`` and
``GET /api/version``.  A request becomes an OpenAI body checked by
:func:`.schemas.parse` (``options`` map to its sampling fields, ``num_predict``
to ``max_tokens``), so the same rules and limits hold; ``/api/generate`` puts
the prompt (and ``system``) through the chat template unless ``raw``.  What
this server cannot do (``format``, ``tools``, ``images``, ``suffix``,
``template``, ``context``) is refused with a 400.  Errors are Ollama's
``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import time
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localinfer.serve.http.errors import APIError, bad
from localinfer.serve.http.schemas import _kind, parse
from localinfer.serve.http.sse import EventStream

VERSION = "0.6.0"                 # the Ollama API version whose shapes these are
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "typical_p": "typical_p", "mirostat": "mirostat",
           "repeat_last_n": "repeat_last_n", "tfs_z": "tfs_z", "num_keep": "n_keep"}
REFUSED = ("images", "suffix", "template", "context", "logprobs")
NDJSON = "application/x-ndjson"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


_DURATION = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)$|^-?((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))+$")   # Go's durations


def _keep_alive(v) -> None:
    """Ollama's keep_alive: seconds (a number) or a Go duration ("5m", "1h", "-1"); the model stays loaded
    here whatever it says, but a value Ollama would refuse is a 400 naming it."""
    if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
        return
    if not isinstance(v, str) or not _DURATION.match(v.strip()):
        raise bad("keep_alive", f"keep_alive must be a number of seconds or a duration such as \"5m\", got "
                                f"{_kind(v)}")


def _refuse(body: dict) -> None:
    for name in REFUSED:
        v = body.get(name)
        if v not in (None, "", [], {}, False):
            raise bad(name, f"{name} is not supported by this server", code="unsupported_parameter")
    for i, m in enumerate(body.get("messages") or []):
        if isinstance(m, dict) and m.get("images"):
            raise bad(f"messages[{i}].images", "images are not supported by this server", code="unsupported_parameter")


def _openai_body(body: dict, *, chat: bool) -> dict:
    """The OpenAI body an Ollama request stands for (checked again by parse)."""
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise bad("options", f"options must be an object, got {_kind(opts)}")
    out = {"model": body.get("model")}
    for name, field in OPTIONS.items():
        if opts.get(name) is not None:
            out[field] = opts[name]
    n = opts.get("num_predict")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise bad("options.num_predict", f"options.num_predict must be an integer, got {_kind(n)}")
        if n > 0:
            out["max_tokens"] = n
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad("format", f"format must be \"json\" or a JSON schema object, got {_kind(fmt)}")
    if body.get("tools") not in (None, []):
        if not chat:
            raise bad("tools", "tools are for /api/chat")
        out["tools"] = body["tools"]
    if chat:
        out["messages"] = _messages(body.get("messages") or []) or None
    return out


def _messages(messages: list) -> list:
    """Ollama's messages as OpenAI's: an assistant's ``tool_calls`` (no ids, arguments an object) get ids, and each
    ``tool`` message answers the earliest call not yet answered (Ollama's messages name no call)."""
    out, pending, k = [], [], 0
    for m in messages if isinstance(messages, list) else [messages]:
        if not isinstance(m, dict):
            out.append(m)
            continue
        o = {"role": m.get("role"), "content": m.get("content")}
        calls = m.get("tool_calls")
        if o["role"] == "assistant" and isinstance(calls, list) and calls:
            o["tool_calls"] = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                cid = (c.get("id") if isinstance(c, dict) else None) or f"call_{k}"
                k += 1
                o["tool_calls"].append({"id": cid, "type": "function", "function": fn})
                pending.append(cid)
        if o["role"] == "tool":
            given = m.get("tool_call_id")
            if given in pending:
                pending.remove(given)
            o["tool_call_id"] = given or (pending.pop(0) if pending else f"call_{k}")
            if isinstance(m.get("tool_name") or m.get("name"), str):
                o["name"] = m.get("tool_name") or m.get("name")
        out.append(o)
    return out


def _ollama_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's tool calls in Ollama's shape: ``{function: {name, arguments: {...}}}`` (an object, not a string)."""
    out = []
    for c in calls:
        out.append({"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}})
    return out


def routes(srv) -> list:
    runtime, config = srv.runtime, srv.config

    def model_spec():
        """The loaded model's header facts (None before it loads)."""
        return None if runtime.tokenizer is None else runtime.tokenizer.spec

    def details() -> dict:
        spec = model_spec()
        d = {"parent_model": "", "format": "gguf", "family": "" if spec is None else spec.arch, "families": None,
             "parameter_size": "", "quantization_level": ""}
        if spec is not None:
            d["families"] = [spec.arch]
            n = spec.n_params
            d["parameter_size"] = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n else ""
            try:
                import gguf

                d["quantization_level"] = gguf.LlamaFileType(spec.file_type).name.removeprefix("MOSTLY_")
            except (ValueError, TypeError, ImportError):
                pass
        return d

    def card() -> dict:
        spec = model_spec()
        modified = datetime.fromtimestamp(config.created or 0, UTC).isoformat().replace("+00:00", "Z")
        name = f"{config.model_id}:latest"
        return {"name": name, "model": name, "modified_at": modified, "size": 0 if spec is None else spec.file_size,
                "digest": hashlib.sha256(f"{config.model_id}:{config.created}".encode()).hexdigest(),
                "details": details()}

    async def body_of(request: Request) -> dict:
        body = await srv.body(request)
        if not isinstance(body, dict):
            raise bad(None, f"the request body must be a JSON object, got {_kind(body)}")
        if body.get("model") is None and body.get("name") is not None:
            body = {**body, "model": body["name"]}       # Ollama's older field (/api/show, /api/pull, ...)
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise bad("model", f"model must be a non-empty string, got {_kind(name)}")
        srv.check_model(name.removesuffix(":latest"))      # the name /api/tags lists is the model's with :latest
        _keep_alive(body.get("keep_alive"))
        return body

    async def generate(request: Request, chat: bool) -> Response:
        t0 = time.perf_counter_ns()
        body = await body_of(request)
        _refuse(body)
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise bad("stream", f"stream must be true or false, got {_kind(stream)}")
        raw = bool(body.get("raw")) and not chat
        if not chat and not body.get("prompt") and not body.get("system"):
            runtime.check_serving()          # an empty prompt loads the model: it is loaded
            return JSONResponse({"model": body["model"], "created_at": _now(), "response": "", "done": True,
                                 "done_reason": "load"})
        ob = _openai_body(body, chat=chat)
        if not chat:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad("prompt", f"prompt must be a string, got {_kind(prompt)}")
            if raw:
                ob["prompt"] = prompt
            else:
                system = body.get("system")
                ob["messages"] = ([{"role": "system", "content": system}] if system else []) + \
                    [{"role": "user", "content": prompt}]
        # off the event loop: format and tools compile a grammar here (bounded: generation/grammar_guard.py)
        spec = await srv.prep.parse(ob, lambda: parse(ob, chat=chat or not raw))
        prompts = await srv.tokens(spec)
        gen = srv.generation(request, spec, prompts)
        key = "message" if chat else "response"

        def line(text: str, calls: list[dict] | None = None, **more) -> bytes:
            obj = {"model": body["model"], "created_at": _now()}
            obj[key] = {"role": "assistant", "content": text} if chat else text
            if calls:
                obj[key]["tool_calls"] = _ollama_calls(calls)
            return json.dumps({**obj, **more}, ensure_ascii=False).encode() + b"\n"

        def final(reason: str | None, t_first: int | None, text: str = "", calls: list[dict] | None = None) -> bytes:
            t1 = time.perf_counter_ns()
            t_first = t_first or t1
            return line(text, calls, done=True, done_reason="stop" if reason in (None, "tool_calls") else reason,
                        total_duration=t1 - t0, load_duration=0, prompt_eval_count=len(prompts[0].prompt),
                        prompt_eval_duration=t_first - t0, eval_count=gen.completion_tokens(),
                        eval_duration=t1 - t_first)

        def tool_reply(reason: str | None) -> tuple[str, list[dict]]:
            # complete calls only (Ollama's arguments are an object); a reply cut inside its call is its text
            content, calls = gen.tools[0].result()
            if not calls and not content and reason == "length":
                content = gen.tools[0].text
            return content or "", calls

        handed_off = False
        try:
            await gen.first()
            if not stream:
                parts, reason, t_first = [], None, None
                async for _, text, why in gen.pieces():
                    t_first = t_first or time.perf_counter_ns()
                    parts.append(text)
                    reason = why or reason
                if gen.tools is not None:
                    return Response(final(reason, t_first, *tool_reply(reason)), media_type="application/json")
                return Response(final(reason, t_first, "".join(parts)), media_type="application/json")

            async def lines():
                t_first = None
                try:
                    async for _, text, why in gen.pieces():
                        t_first = t_first or time.perf_counter_ns()
                        if gen.tools is not None:     # the reply whole at its end: Ollama sends a call whole too
                            if why is not None:
                                yield final(why, t_first, *tool_reply(why))
                            continue
                        if why is not None:
                            if text:
                                yield line(text, done=False)
                            yield final(why, t_first)
                        elif text:
                            yield line(text, done=False)
                except APIError as err:
                    yield json.dumps({"error": err.message}).encode() + b"\n"
            handed_off = True
            return EventStream(lines(), lambda completed: gen.close(), media_type=NDJSON)
        finally:
            if not handed_off:
                gen.close()

    async def chat(request: Request) -> Response:
        return await generate(request, True)

    async def gen_route(request: Request) -> Response:
        return await generate(request, False)

    async def tags(request: Request) -> Response:
        return JSONResponse({"models": [card()]})

    async def ps(request: Request) -> Response:
        c = card()
        c.update(expires_at="9999-12-31T23:59:59Z", size_vram=0, context_length=runtime.context_tokens)
        return JSONResponse({"models": [c]})

    async def show(request: Request) -> Response:
        body = await body_of(request)
        # chat and generate serve any name (one model is loaded); show answers what /api/tags lists, as Ollama does:
        # clients ask it whether a model exists
        name = body["model"].removesuffix(":latest")
        if name not in (config.model_id, *config.aliases):
            raise APIError(404, f"model '{body['model'][:80]}' not found; this server has "
                                f"'{config.model_id}:latest'", param="model", code="model_not_found")
        spec = model_spec()
        tpl = srv.prep.template() if runtime.state == "ready" else None
        info = {}
        if spec is not None:
            info = {"general.architecture": spec.arch, "general.name": spec.name,
                    f"{spec.arch}.context_length": spec.n_ctx_train, f"{spec.arch}.embedding_length": spec.n_embd,
                    f"{spec.arch}.block_count": spec.n_layers}
        return JSONResponse({"modelfile": f"FROM {os.path.basename(config.model_id if spec is None else spec.path)}\n",
                             "parameters": "", "template": "" if tpl is None else tpl.source, "details": details(),
                             "model_info": info, "capabilities": ["completion", "embedding"],
                             "modified_at": card()["modified_at"]})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def embed(request: Request, legacy: bool) -> Response:
        t0 = time.perf_counter_ns()
        body = await body_of(request)
        from localinfer.serve.http.embeddings import compute

        vectors, n = await compute(srv, body, "prompt" if legacy else "input")
        if legacy:
            return JSONResponse({"embedding": [float(x) for x in vectors[0]]})
        return JSONResponse({"model": body["model"], "embeddings": [[float(x) for x in row] for row in vectors],
                             "total_duration": time.perf_counter_ns() - t0, "load_duration": 0,
                             "prompt_eval_count": n})

    def ollama_errors(handler):
        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as err:
                runtime.metrics.reject(err.status)
                return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)
        return wrapped

    async def embed_new(request):
        return await embed(request, False)

    async def embed_old(request):
        return await embed(request, True)

    return [Route("/api/chat", ollama_errors(chat), methods=["POST"]),
            Route("/api/generate", ollama_errors(gen_route), methods=["POST"]),
            Route("/api/embed", ollama_errors(embed_new), methods=["POST"]),
            Route("/api/embeddings", ollama_errors(embed_old), methods=["POST"]),
            Route("/api/tags", ollama_errors(tags), methods=["GET"]),
            Route("/api/ps", ollama_errors(ps), methods=["GET"]),
            Route("/api/show", ollama_errors(show), methods=["POST"]),
            Route("/api/version", ollama_errors(version), methods=["GET"])]
