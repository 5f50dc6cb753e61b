"""Issue 44, item 4: no schema, grammar or tool argument can kill or stall the server.

Each case was a SIGSEGV (a Lark chain of 3,000 rules, a GBNF chain of 4,000, a 4,000-step ``$defs`` chain, the
same inside a tool's parameters: llguidance's compiler recursing past an 8 MiB stack), a stall of every client
(a 649 KB grammar compiled on the event loop), or a 500 (tool-call arguments nested past the parser, a 5,000-digit
integer).  Now: bounded before compiling, compiled in a large-stack thread off the loop, answered in OpenAI's
error shape; the server keeps serving.
"""

from __future__ import annotations

import threading
import time

import pytest

from localinfer.generation.grammar_guard import MAX_GRAMMAR_BYTES, MAX_JSON_DEPTH
from tests.serve.test_http_support import MODEL_ID, LiveServer

httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")

from benchmarks.serve_hostile_grammars import defs_chain, gbnf_chain, lark_chain  # noqa: E402 (imports httpx)

CHAT = "/v1/chat/completions"
EMBED = "/v1/embeddings"
BASE = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def srv(default_model):
    s = LiveServer(default_model, parallel=2, max_queue=8, ctx=2048)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def _alive(http) -> None:
    r = http.post(CHAT, json=BASE)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("case", ["lark chain 4000", "gbnf chain 4000", "defs chain 4000", "tool defs chain 4000"])
def test_a_grammar_that_overflowed_the_compilers_stack_is_answered_and_the_server_lives(http, case):
    body = dict(BASE)
    if case.startswith("lark"):
        body["grammar"] = lark_chain(4000)
    elif case.startswith("gbnf"):
        body["grammar"] = gbnf_chain(4000)
    elif case.startswith("defs"):
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": defs_chain(4000)}}
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": defs_chain(4000)}}]
    r = http.post(CHAT, json=body)
    # it compiles (in a large stack) and is served, or is refused naming the field (the tool's schema, printed
    # into the prompt for a template without tools, may overflow the context instead)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] in ("grammar", "response_format.json_schema.schema",
                                              "tools[0].function.parameters", "max_completion_tokens"), r.text
    _alive(http)


def test_limits_answer_400_naming_the_field_and_the_limit(http):
    big = "start: " + " | ".join(f'"w{i}"' for i in range(MAX_GRAMMAR_BYTES // 8)) + "\n"
    r = http.post(CHAT, json=dict(BASE, grammar=big))
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"
    assert f"{MAX_GRAMMAR_BYTES:,}" in r.json()["error"]["message"]
    deep: dict = {"type": "string"}
    for _ in range(MAX_JSON_DEPTH + 5):
        deep = {"type": "object", "properties": {"a": deep}}
    r = http.post(CHAT, json=dict(BASE, response_format={"type": "json_schema",
                                                         "json_schema": {"name": "d", "schema": deep}}))
    assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"], r.text
    _alive(http)


def test_a_slow_compile_does_not_stall_health_or_other_clients(http, srv):
    # ≈ 200 KB of alternatives, under the byte limit: compiles for a while, in a thread off the event loop
    slow = "start: " + " | ".join(f'"w{i}"' for i in range(MAX_GRAMMAR_BYTES // 12)) + "\n"
    assert len(slow.encode()) < MAX_GRAMMAR_BYTES
    done = {}

    def post():
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            t = time.monotonic()
            done["status"] = c.post(CHAT, json=dict(BASE, grammar=slow)).status_code
            done["s"] = time.monotonic() - t

    th = threading.Thread(target=post)
    th.start()
    time.sleep(0.2)
    worst = 0.0
    while th.is_alive():
        t = time.monotonic()
        assert http.get("/health").status_code == 200
        worst = max(worst, time.monotonic() - t)
        time.sleep(0.05)
    th.join()
    assert done["status"] in (200, 400)
    assert worst < 1.0, f"/health took {worst:.2f} s while a grammar compiled for {done['s']:.2f} s"


@pytest.mark.parametrize("arguments, words", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": ' * (MAX_JSON_DEPTH + 10) + "1" + "}" * (MAX_JSON_DEPTH + 10), "nests deeper"),
    ('{"n": ' + "9" * 5000 + "}", "number that cannot be read"),
    ('{"a": ', "not valid JSON")])
def test_tool_call_arguments_in_the_history_are_bounded(http, arguments, words):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = http.post(CHAT, json=dict(BASE, messages=messages))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[1].tool_calls[0].function.arguments" and words in err["message"], err
    _alive(http)


def test_one_embeddings_request_may_hold_a_bounded_number_of_tokens(http):
    from localinfer.serve.http.embeddings import MAX_REQUEST_TOKENS

    r = http.post(EMBED, json={"model": MODEL_ID, "input": ["hello " * 2000] * 8})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_tokens", r.text
    assert str(MAX_REQUEST_TOKENS) in r.json()["error"]["message"]
    r = http.post(EMBED, json={"model": MODEL_ID, "input": ["hello"]})
    assert r.status_code == 200, r.text


def test_grammar_requests_waiting_for_a_compile_slot_do_not_hold_plain_ones(srv):
    """Both compile slots busy (held here, as two long compiles would): the grammar requests wait for one in
    threads of their own, and a plain request is answered meanwhile (before, they waited in the threads plain
    requests are parsed and tokenised in, and enough of them held those up for their 10 s)."""
    from localinfer.generation import grammar_guard

    small = 'start: "yes" | "no"\n'
    done: dict[str, float] = {}

    def post(name, body):
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            r = c.post(CHAT, json=body)
        done[name] = (time.monotonic(), r.status_code)

    for _ in range(grammar_guard.MAX_COMPILES):
        assert grammar_guard._slots.acquire(timeout=30)
    try:
        waiting = [threading.Thread(target=post, args=(f"grammar{i}", dict(BASE, grammar=small))) for i in range(8)]
        for t in waiting:
            t.start()
        pool = srv.app.state.prep.constrained
        deadline = time.monotonic() + 30
        while pool._work_queue.qsize() + len(pool._threads) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)          # two waiting for a slot, six queued behind them (more than the loop's executor has)
        time.sleep(0.2)
        post("plain", BASE)
        assert not any(k.startswith("grammar") for k in done), done     # the grammar requests are still waiting
    finally:
        for _ in range(grammar_guard.MAX_COMPILES):
            grammar_guard._slots.release()
    for t in waiting:
        t.join(60)
    assert done["plain"][1] == 200
    assert all(done[f"grammar{i}"][1] in (200, 503) for i in range(8)), done
