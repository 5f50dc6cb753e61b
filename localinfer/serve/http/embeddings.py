"""``POST /v1/embeddings`` (and ``/embeddings``): OpenAI's embeddings from llama.cpp's pooling.

The loaded model's weights get a second, small context with embeddings on
(the engine's ``embedder``: llama.cpp's, :mod:`localinfer.backends.llamacpp.embeddings`), made on the
first request, so generation's KV cells are never touched.  The engine thread runs it between its steps,
one turn of at most the step's token budget at a time, the waiting requests' inputs taken in turn
(batched across requests, ``EMBED_SEQS`` sequences a decode), so one large request holds neither the
other embeddings requests nor generation; one request holds at most ``MAX_REQUEST_TOKENS`` tokens (413).  ``input`` is a
string, an array of strings, an array of token ids or an array of those;
``encoding_format`` is ``float`` (default) or ``base64`` (little-endian float32,
as OpenAI sends it); ``dimensions`` may only name the model's own width.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import threading

import numpy as np

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
MAX_REQUEST_TOKENS = 8192         # tokens one request may embed (413 over it): the whole request is held in memory


class _Job:
    """One request's inputs, their vectors as they come, and the future its handler awaits."""

    def __init__(self, inputs: list[tuple[int, ...]], fut: asyncio.Future, loop: asyncio.AbstractEventLoop):
        self.inputs, self.fut, self.loop = inputs, fut, loop
        self.vectors: list = [None] * len(inputs)
        self.next = 0


class Embeddings:
    """The embeddings context, stepped by the engine thread between its steps (``Runtime.attach``).

    Each turn embeds at most the engine's per-step token budget (``--token-budget``, else ``--chunk``; at least one
    input, at most ``EMBED_SEQS`` of them), taking the waiting requests' inputs in turn, one each per round: a small
    request waits one turn behind a large one, not all of it, and generation goes on between turns.
    """

    def __init__(self, runtime):
        self.runtime = runtime
        self._jobs: collections.deque[_Job] = collections.deque()
        self._lock = threading.Lock()
        self._closed: str | None = None   # why new requests are refused (the server is stopping)
        self.embedder = None
        runtime.attach(self)

    async def embed(self, inputs: list[tuple[int, ...]]):
        loop = asyncio.get_running_loop()
        job = _Job(inputs, loop.create_future(), loop)
        with self._lock:
            if self._closed:
                raise APIError(503, self._closed, code="shutting_down")
            self._jobs.append(job)
        self.runtime.wake()
        return await job.fut

    def _open(self):
        """The engine's embeddings context (``embedder``: the llama.cpp engine has one)."""
        return self.runtime.tokenizer.embedder(self.context, EMBED_SEQS)

    @property
    def context(self) -> int:
        return min(EMBED_CTX, max(16, self.runtime.context_tokens))

    # ---- the engine thread (Runtime's side work) -----------------------------
    def pending(self) -> bool:
        return bool(self._jobs)

    def _turn(self, budget: int) -> list[tuple[_Job, int]]:
        """The inputs of this turn: the jobs' next inputs round-robin, within ``budget`` tokens (one at least)."""
        picked: list[tuple[_Job, int]] = []
        used = 0
        with self._lock:
            jobs = list(self._jobs)
            self._jobs.rotate(-1)                    # the next turn starts with the next request
        taken = {id(j): j.next for j in jobs}
        while len(picked) < EMBED_SEQS:
            grew = False
            for j in jobs:
                i = taken[id(j)]
                if i >= len(j.inputs) or len(picked) >= EMBED_SEQS:
                    continue
                n = len(j.inputs[i])
                if picked and used + n > budget:
                    continue
                picked.append((j, i))
                taken[id(j)], used, grew = i + 1, used + n, True
            if not grew:
                break
        for j in jobs:
            j.next = taken[id(j)]
        return picked

    def work(self, budget: int) -> None:
        """Embed one turn's inputs; the requests they complete are answered."""
        picked = self._turn(min(budget, self.context))
        if not picked:
            return
        try:
            if self.embedder is None:
                self.embedder = self._open()
            vectors = self.embedder.embed([j.inputs[i] for j, i in picked])
        except Exception as exc:  # noqa: BLE001 - each request in the turn gets the error
            log.error("embeddings failed: %s: %s", type(exc).__name__, exc)
            self._drop({id(j): j for j, _ in picked}.values(), exc)
            return
        done = []
        for (j, i), v in zip(picked, vectors):
            j.vectors[i] = v
            if j.next >= len(j.inputs) and all(x is not None for x in j.vectors):
                done.append(j)
        with self._lock:
            for j in done:
                if j in self._jobs:
                    self._jobs.remove(j)
        for j in done:
            j.loop.call_soon_threadsafe(_resolve, j.fut, np.stack(j.vectors), None)

    def _drop(self, jobs, exc: Exception) -> None:
        with self._lock:
            for j in jobs:
                if j in self._jobs:
                    self._jobs.remove(j)
        for j in jobs:
            if not j.loop.is_closed():
                j.loop.call_soon_threadsafe(_resolve, j.fut, None, exc)

    def finish(self) -> None:
        """The engine thread ends: the requests still waiting get a 503, the context is freed."""
        self.close()
        if self.embedder is not None:
            self.embedder.close()
            self.embedder = None

    # ---- the loop thread ------------------------------------------------------
    def close(self) -> None:
        """Refuse further requests and answer the waiting ones 503 (the server is stopping)."""
        with self._lock:
            self._closed = self._closed or "the server is shutting down"
            jobs = list(self._jobs)
        self._drop(jobs, APIError(503, self._closed, code="shutting_down"))


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
