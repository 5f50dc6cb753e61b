"""Bounds on compiling a grammar: what one request's schema or grammar may cost the process that compiles it.

llguidance's compiler recurses once per rule in a chain (and per ``$ref`` step of a JSON schema), so a chain of a
few thousand rules overflows an 8 MiB thread stack and the process dies with SIGSEGV; and a grammar of 100k
alternatives compiles for seconds.  So every compile here:

- is refused before it starts when its text is over :data:`MAX_GRAMMAR_BYTES` (Lark, GBNF, regex) or
  :data:`MAX_SCHEMA_BYTES` (a JSON schema as JSON), or its JSON nests deeper than :data:`MAX_JSON_DEPTH`;
- runs in a thread of its own with a :data:`COMPILE_STACK` stack (a 20,000-rule chain, more than the byte
  limit admits, compiles in 0.3 s there), at most :data:`MAX_COMPILES` at once;
- is given up after :data:`COMPILE_TIMEOUT_S` (the thread finishes in the background, holding its slot).

Each refusal is a :class:`~localinfer.errors.GrammarError` naming the field and the limit (``busy`` set when
no slot came free: the server answers that with 503).  The limits inside llguidance (its ``LLParserLimits``:
500,000 grammar items, 250,000 lexer states, lexer fuel) stay at their defaults and answer in its own words.
"""

from __future__ import annotations

import json
import threading

from localinfer.errors import GrammarError

MAX_GRAMMAR_BYTES = 256 << 10
MAX_SCHEMA_BYTES = 512 << 10
MAX_JSON_DEPTH = 64
COMPILE_STACK = 512 << 20          # virtual: the pages a compile touches are all it costs
COMPILE_TIMEOUT_S = 10.0
MAX_COMPILES = 2

_slots = threading.BoundedSemaphore(MAX_COMPILES)
_stack_lock = threading.Lock()


def json_depth(value, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``value`` nests (objects and arrays), counted without recursion and only up to ``limit + 1``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > limit:
                return d
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_json(value, field: str, what: str = "JSON") -> None:
    """GrammarError naming ``field`` when ``value`` nests deeper than MAX_JSON_DEPTH."""
    if json_depth(value) > MAX_JSON_DEPTH:
        raise GrammarError(f"{field} nests deeper than {MAX_JSON_DEPTH} levels of {what}; flatten it", field=field,
                           limit="depth")


def check_size(kind: str, value, field: str) -> None:
    """Refuse a grammar or schema over its byte limit (or nested too deeply) before anything compiles it."""
    if isinstance(value, str):
        n = len(value.encode("utf-8", "replace"))
        if n > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"{field} is {n:,} bytes; a {kind} grammar may be {MAX_GRAMMAR_BYTES:,}", field=field,
                               limit="bytes")
    elif isinstance(value, (dict, list)):
        check_json(value, field, "schema")
        n = len(json.dumps(value))
        if n > MAX_SCHEMA_BYTES:
            raise GrammarError(f"{field} is {n:,} bytes of JSON; a schema may be {MAX_SCHEMA_BYTES:,}", field=field,
                               limit="bytes")


def guarded(fn, field: str):
    """``fn()`` (a compile) in a large-stack thread of its own, within the slot and time limits (see the module)."""
    if not _slots.acquire(timeout=COMPILE_TIMEOUT_S):
        raise GrammarError(f"{field}: {MAX_COMPILES} grammars are compiling already; retry shortly", field=field,
                           busy=True, limit="compiles")
    box: dict = {}
    released = threading.Lock()          # the slot goes back once, whichever path lets it go

    def release():
        if released.acquire(blocking=False):
            _slots.release()

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc
        finally:
            release()

    try:
        with _stack_lock:               # threading.stack_size is process-wide: set it for this thread alone
            old = threading.stack_size(COMPILE_STACK)
            try:
                t = threading.Thread(target=run, name="localinfer-grammar", daemon=True)
                t.start()
            finally:
                threading.stack_size(old)
    except RuntimeError as exc:         # no room for the stack (RLIMIT_AS, strict overcommit): say so by field
        release()
        raise GrammarError(f"{field}: no thread could be started to compile it ({exc}); retry shortly",
                           field=field, busy=True, limit="threads") from None
    except BaseException:
        release()
        raise
    t.join(COMPILE_TIMEOUT_S)
    if t.is_alive():
        raise GrammarError(f"{field} did not compile within {COMPILE_TIMEOUT_S:g} s; simplify it", field=field,
                           limit="time")
    if "error" in box:
        raise box["error"]
    return box["value"]
