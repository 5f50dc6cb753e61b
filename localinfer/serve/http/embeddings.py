"""``POST /v1/embeddings`` (and ``/embeddings``): OpenAI's embeddings from llama.cpp's pooling.

The loaded model's weights get a second, small context with embeddings on
(the engine's ``embedder``: llama.cpp's, :mod:`localinfer.backends.llamacpp.embeddings`), made on the
first request, so generation's KV cells are never touched.  One thread runs it:
the inputs of every request waiting when it is free go into the same decodes
(batched across requests, ``EMBED_SEQS`` sequences at a time).  ``input`` is a
string, an array of strings, an array of token ids or an array of those;
``encoding_format`` is ``float`` (default) or ``base64`` (little-endian float32,
as OpenAI sends it); ``dimensions`` may only name the model's own width.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import queue
import threading

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from localinfer.serve.http.errors import APIError, bad
from localinfer.serve.http.intake import check_bytes
from localinfer.serve.http.schemas import _kind

log = logging.getLogger("localinfer.serve")
MAX_INPUTS = 2048                 # OpenAI's limit of inputs per request
EMBED_CTX = 4096                  # tokens per embeddings decode (and so per input), at most the model's context
EMBED_SEQS = 8
MAX_REQUEST_TOKENS = 8192         # tokens one request may embed: the thread is shared, one request must not hold it


class Embeddings:
    """The embeddings context and its thread; requests wait on futures resolved from it."""

    def __init__(self, runtime):
        self.runtime = runtime
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.embedder = None
        self.error: str | None = None

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name="localinfer-embed", daemon=True)
                self._thread.start()

    async def embed(self, inputs: list[tuple[int, ...]]):
        self._start()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((inputs, fut, loop))
        return await fut

    def _open(self):
        """The engine's embeddings context (``embedder``: the llama.cpp engine has one)."""
        return self.runtime.tokenizer.embedder(min(EMBED_CTX, self.context), EMBED_SEQS)

    @property
    def context(self) -> int:
        return min(EMBED_CTX, max(16, self.runtime.context_tokens))

    def _main(self) -> None:
        while True:
            jobs = [self._queue.get()]
            while not self._queue.empty():
                jobs.append(self._queue.get())
            if any(j is None for j in jobs):
                return
            try:
                if self.embedder is None:
                    self.embedder = self._open()
                flat = [t for inputs, _, _ in jobs for t in inputs]
                vectors = self.embedder.embed(flat)
                at = 0
                for inputs, fut, loop in jobs:
                    loop.call_soon_threadsafe(_resolve, fut, vectors[at:at + len(inputs)], None)
                    at += len(inputs)
            except Exception as exc:  # noqa: BLE001 - each waiting request gets the error
                log.error("embeddings failed: %s: %s", type(exc).__name__, exc)
                for _, fut, loop in jobs:
                    loop.call_soon_threadsafe(_resolve, fut, None, exc)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(30)
        if self.embedder is not None and (self._thread is None or not self._thread.is_alive()):
            self.embedder.close()
            self.embedder = None


def _resolve(fut, value, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def _inputs(v, param: str = "input") -> list:
    """The inputs as strings or token-id tuples."""
    if isinstance(v, str) or isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        v = [v]
    if not isinstance(v, list) or not v:
        raise bad(param, f"{param} must be a string, an array of strings or of token-id arrays, got {_kind(v)}")
    if len(v) > MAX_INPUTS:
        raise bad(param, f"{param} holds {len(v)} items; the limit is {MAX_INPUTS}")
    out = []
    for i, x in enumerate(v):
        if isinstance(x, str) and x:
            out.append(x)
        elif isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            out.append(tuple(x))
        else:
            raise bad(param, f"{param}[{i}] must be a non-empty string or array of token ids, got {_kind(x)}")
    return out


def _tokens(srv, items: list, param: str) -> list[tuple[int, ...]]:
    """Token ids per input (a worker thread), each within the embeddings context."""
    tok, ctx = srv.runtime.tokenizer, srv.embeddings.context
    out, total = [], 0
    for i, x in enumerate(items):
        if isinstance(x, str):
            check_bytes(tok, len(x.encode("utf-8", "replace")), ctx + 1, f"{param}[{i}]", param)
            ids = tuple(tok.tokenize(x, add_bos=True, special=False))
        else:
            ids = x
            if any(not 0 <= t < tok.n_vocab for t in ids):
                raise bad(param, f"{param}[{i}] holds token ids outside 0..{tok.n_vocab - 1}")
        if len(ids) > ctx:
            raise bad(param, f"{param}[{i}] is {len(ids)} tokens; an embedded input may have at most {ctx}",
                      code="context_length_exceeded")
        total += len(ids)
        if total > MAX_REQUEST_TOKENS:
            raise APIError(413, f"{param} is over {MAX_REQUEST_TOKENS} tokens by its item {i}; one embeddings "
                                f"request may hold at most {MAX_REQUEST_TOKENS}: send the rest in further requests",
                           param=param, code="too_many_tokens")
        out.append(ids)
    return out


async def compute(srv, body: dict, param: str = "input"):
    """(one vector per input, prompt tokens) for a checked body's ``param``; APIError otherwise."""
    runtime = srv.runtime
    items = _inputs(body.get(param), param)
    runtime.check_serving()
    if runtime.tokenizer is None or not runtime.tokenizer.embeds:
        raise APIError(501, "embeddings need the llama.cpp backend", code="unsupported")
    ids = await srv.prep.run(_tokens, srv, items, param, n=1)
    try:
        vectors = await srv.embeddings.embed(ids)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise APIError(500, f"embeddings failed: {type(exc).__name__}", code="engine_error") from None
    return vectors, sum(map(len, ids))


def routes(srv) -> list:
    srv.embeddings = Embeddings(srv.runtime)

    async def embeddings(request: Request):
        body = await srv.body(request)
        if not isinstance(body, dict):
            raise bad(None, f"the request body must be a JSON object, got {_kind(body)}")
        model = "" if body.get("model") is None else body["model"]
        if not isinstance(model, str):
            raise bad("model", f"model must be a string, got {_kind(model)}")
        srv.check_model(model)
        fmt = body.get("encoding_format", "float") or "float"
        if fmt not in ("float", "base64"):
            raise bad("encoding_format", f"encoding_format must be float or base64, got {_kind(fmt)}")
        dims = body.get("dimensions")
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)):
            raise bad("dimensions", f"dimensions must be an integer, got {_kind(dims)}")
        vectors, n = await compute(srv, body)
        if dims is not None and dims != vectors.shape[1]:
            raise bad("dimensions", f"this model's embeddings have {vectors.shape[1]} dimensions; dimensions "
                                    f"may only be that, got {dims}")
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64"
                 else [float(x) for x in v]} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": srv.config.model_id,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    from localinfer.serve.http.app import handled

    h = handled(embeddings, srv.runtime)
    return [Route("/v1/embeddings", h, methods=["POST"]), Route("/embeddings", h, methods=["POST"])]
