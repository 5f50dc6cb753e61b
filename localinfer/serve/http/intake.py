"""From a request body to prompt tokens: the JSON read with a size cap and a time limit, and tokenising bounded.

``read_json`` reads the body within ``body_timeout_s`` (a client trickling its
body gets a 408 and the connection closes), refuses more than the cap (413),
and turns every way JSON can fail — syntax, bytes that are not UTF-8, nesting
too deep for the parser, an integer of thousands of digits — into a 400.

:class:`Prep` makes prompt tokens in worker threads (never on the event loop
nor the engine thread): text is refused by its byte count before it is
tokenised when it cannot fit the per-request context (no token is longer than
the vocabulary's longest, so ``bytes / longest`` tokens is a lower bound), and
requests beyond what the server would queue are refused with 429 before their
tokenising starts.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor

from localinfer.serve.http.errors import APIError, bad

PREP_WORKERS = 2          # tokenising threads: a long prompt does not hold up a short one behind it


async def read_json(request, cap: int, timeout_s: float | None = None):
    """The decoded JSON body; APIError 400/408/413/415."""
    from starlette.requests import ClientDisconnect

    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    # curl -d sends application/x-www-form-urlencoded (Ollama's and OpenAI's curl examples do): the body is JSON
    if ctype not in ("application/json", "", "application/x-www-form-urlencoded", "text/plain"):
        raise APIError(415, f"Content-Type must be application/json, got {ctype[:60]!r}", code="unsupported_media")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > cap:
                    raise APIError(413, f"the request body is over the {cap}-byte limit (--max-body)",
                                   code="body_too_large")
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout)",
                       code="request_timeout", headers={"connection": "close"}) from None
    except ClientDisconnect:
        raise APIError(499, "the client closed the request", code="client_closed") from None
    return loads(bytes(body))


def loads(body: bytes):
    """json.loads with every failure a 400 naming what is wrong."""
    return loads_field(body, None)


def loads_field(text: bytes | str, field: str | None):
    """json.loads of the request body (``field`` None) or of a JSON string inside it (``field`` names it), every
    failure a 400: not UTF-8, not JSON, nested past the parser's depth, a number with too many digits."""
    what = "the request body" if field is None else field
    try:
        return json.loads(text)
    except UnicodeDecodeError:
        raise bad(field, f"{what} is not UTF-8", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise bad(field, f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                  code="invalid_json") from None
    except RecursionError:
        raise bad(field, f"{what} is nested too deeply to parse", code="invalid_json") from None
    except ValueError as exc:           # an integer over sys.get_int_max_str_digits() digits
        raise bad(field, f"{what} holds a number that cannot be read: {str(exc)[:80]}",
                  code="invalid_json") from None


def check_bytes(tokenizer, n_bytes: int, context: int, what: str, param: str) -> None:
    """Refuse text of ``n_bytes`` that is certainly ``context`` tokens or more (400), before tokenising it."""
    if n_bytes <= context:
        return
    least = -(-n_bytes // max(1, tokenizer.longest_token_bytes()))
    if least >= context:
        raise bad(param, f"{what} is {n_bytes:,} bytes, so at least {least:,} tokens; the context holds {context} "
                         "per request", code="context_length_exceeded")


class ServerVocab:
    """The tokenizer as the chat template sees it: its byte pre-check measures the per-request context
    (the llama.cpp engine's own ``n_ctx`` is one sequence's share of the cells)."""

    def __init__(self, tokenizer, context: int):
        self._tok, self._context = tokenizer, context

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def check_text_fits(self, n_bytes: int, what: str = "the prompt") -> None:
        check_bytes(self._tok, n_bytes, self._context, what, "messages")


class Prep:
    """Prompt tokens in worker threads, with admission checked first."""

    def __init__(self, runtime, config, workers: int = PREP_WORKERS):
        self.runtime, self.config = runtime, config
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="localinfer-prep")
        # requests with a grammar, schema or tools: their compiles wait for a slot (generation/grammar_guard.py)
        # in threads of their own, so a plain request's tokens are never queued behind them
        self.constrained = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="localinfer-prep-grammar")
        self._lock = threading.Lock()
        self._template = None
        self.preparing = 0

    def admit(self, n: int) -> None:
        """429 when ``n`` more requests would not be queued anyway (checked before any tokenising)."""
        cfg = self.runtime.config
        limit = cfg.parallel + cfg.max_queue
        busy = self.runtime.outstanding + self.preparing
        if n <= limit and busy + n > limit:
            wait = min(60, max(1, math.ceil(busy / cfg.parallel)))
            raise APIError(429, f"the server has {busy} requests outstanding, its limit (--parallel + --max-queue) "
                                f"is {limit}; retry later", code="queue_full", headers={"Retry-After": str(wait)})

    async def run(self, fn, *args, n: int = 1):
        """``fn(*args)`` in a worker thread (of the constrained pool when an argument is a spec with a
        ``structure``), counted against the queue limit while it runs."""
        self.admit(n)
        self.preparing += n
        pool = self.constrained if any(getattr(a, "structure", None) is not None for a in args) else self.pool
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        finally:
            self.preparing -= n

    async def parse(self, body, fn):
        """``fn()``, a body's parse (which compiles its grammar or schema), off the event loop: in the constrained
        pool when the body asks for structure, else the loop's default executor, so that requests waiting for a
        compile slot never hold up a plain request's parse."""
        from localinfer.serve.http.structured import constrains

        pool = self.constrained if isinstance(body, dict) and constrains(body) else None
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    def vocab(self) -> ServerVocab:
        return ServerVocab(self.runtime.tokenizer, self.runtime.context_tokens)

    def template(self):
        """The chat template, built once from the factory (it needs the loaded tokenizer), under a lock: the
        worker threads share it (``config.template`` holds it from then on, as :func:`.prepare` expects)."""
        with self._lock:
            if self._template is None:
                tpl = self.config.template
                self._template = tpl if hasattr(tpl, "tokens") else tpl(self.runtime.tokenizer)
                self.config.template = self._template
            return self._template

    def chat(self, spec):
        """The chat request made ready (:func:`.prepare`): its text refused by its bytes first."""
        from localinfer.errors import LocalinferError
        from localinfer.serve.http.prepare import prepare

        text = sum(len(m["content"].encode("utf-8", "replace")) for m in spec.messages
                   if isinstance(m.get("content"), str))
        check_bytes(self.runtime.tokenizer, text, self.runtime.context_tokens, "the messages' text", "messages")
        self.template()
        try:
            return prepare(self.runtime, self.config, spec, vocab=self.vocab())
        except LocalinferError as exc:
            raise bad("messages", f"the chat template refused these messages: {exc}", code="template_error") from None

    def text(self, spec, prompt, param: str = "prompt"):
        """One completions prompt made ready (:func:`.prepare`): text refused by its bytes first."""
        from dataclasses import replace

        from localinfer.serve.http.prepare import prepare

        if isinstance(prompt, str):
            check_bytes(self.runtime.tokenizer, len(prompt.encode("utf-8", "replace")), self.runtime.context_tokens,
                        "the prompt", param)
        return prepare(self.runtime, self.config, replace(spec, prompt=prompt))

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.constrained.shutdown(wait=False)
