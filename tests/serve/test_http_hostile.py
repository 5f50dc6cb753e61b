"""Issue 32's bugs, each with its repro: long chat prompts, slow and hostile clients, foreign origins, huge prompts."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer

httpx = pytest.importorskip("httpx")

CHAT = "/v1/chat/completions"
OK = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
HEADER_S, BODY_S, CAP = 1.0, 1.0, 12


@pytest.fixture(scope="module", params=["httptools", "h11"])
def big(default_model, request):
    """ctx 4096, two slots and the default 32 parked ids (so llama.cpp's per-sequence n_ctx is 4096 // 34),
    short timeouts and a small connection cap, one extra allowed origin; on each HTTP parser uvicorn has."""
    pytest.importorskip(request.param)
    before = os.environ.get("LOCALINFER_HTTP")
    os.environ["LOCALINFER_HTTP"] = request.param
    try:
        srv = LiveServer(default_model, parallel=2, max_queue=4, ctx=4096,
                         app={"allowed_origins": ("https://app.example",), "body_timeout_s": BODY_S},
                         limits={"header_timeout_s": HEADER_S, "max_connections": CAP})
    finally:
        if before is None:
            os.environ.pop("LOCALINFER_HTTP")
        else:
            os.environ["LOCALINFER_HTTP"] = before
    try:
        assert request.param in srv.server.config.http.__name__.lower()  # GuardedHttpToolsProtocol, GuardedH11Protocol
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(big):
    with httpx.Client(base_url=big.url, timeout=60) as c:
        yield c


def _raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_all(s: socket.socket, limit_s: float = 10.0) -> bytes:
    s.settimeout(limit_s)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return got


def test_a_20_kb_chat_prompt_that_fits_is_answered(http):
    """Bug 1: the byte pre-check measured llama.cpp's per-sequence share (4096 // 34 = 120 tokens) and the
    ContextFullError it raised was a 500; a prompt of 20 KB in about 3,400 tokens fits the 4096-token context."""
    text = "hello " * 3400
    r = http.post(CHAT, json=dict(OK, messages=[{"role": "user", "content": text}], max_tokens=1))
    assert r.status_code == 200, r.text
    assert 3400 <= r.json()["usage"]["prompt_tokens"] < 4096
    r = http.post(CHAT, json=dict(OK, messages=[{"role": "user", "content": "hello " * 5000}], max_tokens=1))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "4096" in r.json()["error"]["message"]


def test_a_4_mb_prompt_is_refused_by_its_bytes_before_tokenizing(http, big):
    """Bug 5: the size alone proves it cannot fit; the tokenizer is never called."""
    tok = big.runtime.tokenizer
    calls = []
    real = tok.tokenize
    tok.tokenize = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for path, body in (("/v1/completions", {"model": MODEL_ID, "prompt": "x" * 4_000_000}),
                           (CHAT, dict(OK, messages=[{"role": "user", "content": "y" * 4_000_000}]))):
            r = http.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert "4,000,000 bytes" in r.json()["error"]["message"]
        assert not calls
    finally:
        del tok.tokenize
    assert http.post(CHAT, json=OK).status_code == 200


def test_foreign_origins_are_refused_and_allowed_ones_get_cors(http, big):
    """Bug 6: a page on another site cannot drive the local model, not even with a request that needs no
    preflight (no Content-Type); localhost's pages, the server's own origin and --allowed-origins can."""
    body = json.dumps(OK).encode()
    for origin in ("http://evil.example", "null", "http://localhost.evil.example", "file://"):
        r = http.post(CHAT, content=body, headers={"origin": origin})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", (origin, r.text)
        r = http.options(CHAT, headers={"origin": origin, "access-control-request-method": "POST"})
        assert r.status_code == 403, origin
    for origin in ("http://localhost:3000", "http://127.0.0.1:5173", f"http://127.0.0.1:{big.port}",
                   "https://app.example", "http://[::1]:8000"):
        r = http.options(CHAT, headers={"origin": origin, "access-control-request-method": "POST",
                                        "access-control-request-headers": "content-type, authorization"})
        assert r.status_code == 200, (origin, r.text)
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"]
        r = http.post(CHAT, content=body, headers={"origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, origin
    assert "access-control-allow-origin" not in http.post(CHAT, json=OK).headers   # no Origin: no CORS
    r = http.post(CHAT, content=b"{", headers={"origin": "http://localhost:3000"})
    assert r.status_code == 400 and r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_slow_headers_and_bodies_time_out_while_others_are_served(http, big):
    """Bug 4: connections that send nothing, trickle their headers or their body are closed after the timeouts
    (408 when a request had begun), and normal requests are answered meanwhile."""
    idle, trickle, body = _raw(big.port), _raw(big.port), _raw(big.port)
    trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    payload = json.dumps(OK).encode()
    body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload[:10])
    start = time.monotonic()
    for _ in range(3):                                  # a byte now and then does not keep the headers alive
        trickle.sendall(b"X")
        assert http.post(CHAT, json=OK).status_code == 200
        time.sleep(HEADER_S / 3)
    assert b" 408 " in _read_all(trickle).split(b"\r\n")[0]
    reply = _read_all(body)
    assert b" 408 " in reply.split(b"\r\n")[0] and b"request_timeout" in reply and b"--body-timeout" in reply
    assert _read_all(idle) == b""                       # closed without a word: it asked nothing
    assert time.monotonic() - start < 30                # closed by the timeouts, not by the test's reads
    for s in (idle, trickle, body):
        s.close()
    assert http.post(CHAT, json=OK).status_code == 200


def test_connections_past_the_cap_get_503_and_the_cap_frees(http, big):
    """Bug 4: at most CAP connections; one more is a 503 in JSON, and the idle ones go after the timeout."""
    held = [_raw(big.port) for _ in range(CAP + 1)]     # the test client's keep-alive connection may count too
    try:
        replies = [_read_all(s, 3 * HEADER_S) for s in held]
        refused = [r for r in replies if r]
        assert refused and all(b" 503 " in r.split(b"\r\n")[0] and b"too_many_connections" in r for r in refused)
        assert len(held) - len(refused) >= CAP - 1       # every connection up to the cap was kept, then timed out
    finally:
        for s in held:
            s.close()
    assert http.post(CHAT, json=OK).status_code == 200


def test_parser_errors_are_json(big):
    """Bug 8: the HTTP parser's 400 is OpenAI's JSON, not plain text."""
    with _raw(big.port) as s:
        s.sendall(b"GARBAGE\r\n\r\n")
        head, _, body = _read_all(s).partition(b"\r\n\r\n")
        assert b" 400 " in head.split(b"\r\n")[0] and b"application/json" in head
        assert json.loads(body)["error"]["code"] == "invalid_http"


def test_oversized_request_headers_are_refused_at_once_and_others_are_served(http, big):
    """Headers past MAX_HEAD_BYTES end the connection with a JSON error: the server's 431 on httptools, whose llhttp
    has no cap (without the server's count a client could send them until the header timeout), h11's own 400."""
    from localinfer.serve.http.limits import MAX_HEAD_BYTES

    with _raw(big.port) as s:
        start = time.monotonic()
        pad = b"".join(b"X-Pad: " + b"a" * 1015 + b"\r\n" for _ in range(MAX_HEAD_BYTES // 1024 + 2))
        try:                                                # just past the cap, in one write
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + pad)
        except (BrokenPipeError, ConnectionResetError):
            pass
        head, _, body = _read_all(s, 5).partition(b"\r\n\r\n")
        assert time.monotonic() - start < HEADER_S          # refused for its size, not timed out
    httptools = "httptools" in big.server.config.http.__name__.lower()
    assert (b" 431 " if httptools else b" 400 ") in head.split(b"\r\n")[0], head[:80]
    assert json.loads(body)["error"]["code"] == ("headers_too_large" if httptools else "invalid_http")


def test_a_head_after_a_large_body_in_the_same_chunk_is_not_charged_with_it(big):
    """A chunk holding a whole request with a 20 KB body and the start of the next request's head: the head is not
    charged with the bytes before it (a false 431 there closed the connection before the first request's reply).
    The first request is answered (its prompt is too long for this server: a 400), and nothing is a 431."""
    body = json.dumps(dict(OK, messages=[{"role": "user", "content": "hi " * 7000}], max_tokens=1)).encode()
    with _raw(big.port) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                  + b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        time.sleep(0.3)                                     # the rest of the second head in a later chunk
        try:
            s.sendall(b"Connection: close\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        got = _read_all(s, 20)
    lines = [line for line in got.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    assert lines and b" 400 " in lines[0] and b"context" in got and b" 431 " not in got, got[:300]


def test_a_head_pipelined_behind_a_stream_is_capped_and_never_lands_inside_it(big):
    """A second request's head sent while a streamed reply is in flight: llhttp parses it at once, so past the cap
    the connection closes and the stream is cut (no status line written inside it); h11 reads nothing until the
    stream is done, then refuses the head (its parser's 400, the head being read before our count starts).  The
    server goes on serving."""
    body = json.dumps(dict(OK, max_tokens=200, stream=True, ignore_eos=True)).encode()
    with _raw(big.port) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 2:
            got += s.recv(65536)
        try:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            for _ in range(64):                             # 4x the cap, a line at a time
                s.sendall(b"X-Pad: " + b"a" * 1015 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        got += _read_all(s, 30)
    stream, done, after = got.partition(b"data: [DONE]")
    assert b" 200 " in got.split(b"\r\n")[0] and stream.count(b"HTTP/1.1 ") == 1
    if "httptools" in big.server.config.http.__name__.lower():
        assert not done, "the head past the cap should have closed the connection mid-stream"
    else:
        assert done and after.count(b"HTTP/1.1 4") == 1     # refused once the stream is done (h11's own 400 there)
    with httpx.Client(base_url=big.url, timeout=30) as c:
        assert c.get("/health").status_code == 200


def test_two_authorization_headers_are_refused(big):
    with _raw(big.port) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer a\r\n"
                  b"Authorization: Bearer b\r\n\r\n")
        reply = _read_all(s, 3)
        assert b" 400 " in reply.split(b"\r\n")[0] and b"more than one authorization" in reply


def test_metrics_count_requests_handed_to_the_engine_during_a_long_step(http, big):
    """Bug 8: /metrics said 0 running, 0 waiting while requests were outstanding behind a long prefill step."""
    import threading

    def send(content):
        httpx.post(big.url + CHAT, json=dict(OK, messages=[{"role": "user", "content": content}], max_tokens=4),
                   timeout=120)
    threads = [threading.Thread(target=send, args=("hello " * 1500,))]
    threads += [threading.Thread(target=send, args=(f"short {i}",)) for i in range(3)]
    for t in threads:
        t.start()
    seen = []
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        before = big.runtime.outstanding
        m = big.metrics()
        after = big.runtime.outstanding
        if min(before, after) >= 3:                     # clearly busy during the whole scrape
            seen.append(m["localinfer_requests_running"] + m["localinfer_requests_waiting"])
        time.sleep(0.05)
    for t in threads:
        t.join(60)
    assert seen and min(seen) >= 1, seen
