"""``localinfer serve``: an OpenAI-compatible HTTP server on the step engine (:mod:`localinfer.serve.engine`).

Stack: Starlette (routing, requests, responses) on uvicorn (the ASGI server) —
the pair vLLM's and llama-cpp-python's OpenAI servers run on (through FastAPI,
which adds pydantic models on top of Starlette).  localinfer validates bodies
itself (:mod:`.schemas`) so every error is OpenAI's shape with a one-line
message naming the field, which FastAPI's 422 errors are not; Starlette alone
is enough.  uvicorn gives h11 parsing, keep-alive, graceful shutdown on
SIGINT/SIGTERM and a body-streaming ASGI interface we read with a size cap.

Threads: uvicorn's event loop runs the handlers; the engine (scheduler, block
manager, llama.cpp executor) runs in one thread of its own (:mod:`.runtime`).
Handlers hand it requests through a locked inbox and receive tokens through
``loop.call_soon_threadsafe`` — no handler ever waits on the engine, and
template rendering and tokenisation run in worker threads.

Modules: ``app`` (the OpenAI routes), ``guard`` (Host, Origin and CORS, API
key, body size), ``limits`` (header timeout and connection cap below the app),
``intake`` (the body read with a time limit, prompt tokens with byte checks and
admission), ``schemas`` (body validation), ``reply`` (one request's
choices and its answer), ``responses`` (OpenAI response objects), ``faces``
with ``embeddings`` (``/v1/embeddings``), ``responses_api`` (``/v1/responses``)
and ``ollama`` (Ollama's API), ``prepare`` and ``structured`` (prompt tokens and
grammars), ``pages`` and ``state`` (the browser pages and the engine view), ``runtime`` (the engine thread), ``config``
(scheduling settings and the engine they build), ``sampler`` (penalties,
logit bias and logprobs per request), ``step_timing`` (a step-time model fitted
online for deadline-aware admission), ``metrics`` (Prometheus), ``sse``
(server-sent events with disconnect detection), ``server`` (uvicorn with
signals and grace period).
"""
