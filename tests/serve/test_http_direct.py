"""Streamed token frames written by the relay thread, not the event loop (serve/http/direct.py): the same bytes the
loop writes, a slow reader handed back to the loop, and a client that leaves never written to under another's
connection."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer, assert_only_parked_kv

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def srv(default_model):
    s = LiveServer(default_model, parallel=2, ctx=2048)
    yield s
    s.stop()


def _stream(srv, path: str, body: dict) -> list[dict]:
    with httpx.Client(base_url=srv.url, timeout=120) as c, c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def _strip(frames: list[dict]) -> list[dict]:
    """Frames without their ids, timestamps and cached-token counts (the second run finds the first's prefix)."""
    out = [{k: v for k, v in f.items() if k not in ("id", "created")} for f in frames]
    for f in out:
        if f.get("usage"):
            f["usage"] = {k: v for k, v in f["usage"].items() if k != "prompt_tokens_details"}
    return out


def _counters(srv) -> tuple[float, float]:
    """(frames the relay wrote, its spills), once they stop changing: published after the steps that made them, and
    while idle every 0.5 s (``IDLE_WAIT_S``: a reply's last frame, written by the relay as its finish is published,
    shows at the next one), so two reads further apart than that."""
    got, deadline = None, time.monotonic() + 10
    while True:
        m = srv.metrics()
        now = m["localinfer_stream_frames_direct_total"], m["localinfer_stream_spills_total"]
        if now == got or time.monotonic() > deadline:
            return now
        got = now
        time.sleep(0.6)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 24}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24,
                              "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "One, two, three,", "max_tokens": 40, "stop": [" nine"]}),
])
def test_the_relays_frames_are_the_loops(srv, monkeypatch, path, body):
    """Greedy, the same request streamed with the frames written by the relay thread and (LOCALINFER_DIRECT_STREAM=0)
    all by the loop: frame for frame the same, ids and timestamps aside; the counter says the relay wrote most of
    the first stream's frames (all but those before the loop handed it over and from the finish on) and none of
    the second's; the text is the non-streamed reply's."""
    body = {"model": MODEL_ID, "temperature": 0, **body}
    before = _counters(srv)
    direct = _stream(srv, path, body)
    middle = _counters(srv)
    monkeypatch.setenv("LOCALINFER_DIRECT_STREAM", "0")
    loop = _stream(srv, path, body)
    after = _counters(srv)
    assert _strip(direct) == _strip(loop)
    deltas = [f for f in direct if f["choices"] and f["choices"][0]["finish_reason"] is None
              and f["choices"][0].get("delta", {}).get("content", f["choices"][0].get("text"))]
    assert len(deltas) >= 5
    assert middle[0] - before[0] >= len(deltas) // 2 and middle[1] == before[1], (before, middle, len(deltas))
    assert after == middle                                   # the loop wrote every frame of the second
    whole = httpx.post(srv.base_url + path.removeprefix("/v1"), json=body, timeout=120).json()["choices"][0]
    text = "".join(c["delta"].get("content", "") if "delta" in c else c["text"]
                   for c in (f["choices"][0] for f in direct if f["choices"]))
    assert text == whole.get("text", whole.get("message", {}).get("content"))


def _read_chunked(s: socket.socket) -> tuple[bytes, bytes]:
    """A whole HTTP/1.1 chunked response read from ``s``: (head, body), the chunk framing checked and removed."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = s.recv(65536)
        assert got, "the connection closed before the head"
        buf += got
    head, _, rest = buf.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while True:
        while b"\r\n" not in rest:
            got = s.recv(65536)
            assert got, "the connection closed before a chunk's size"
            rest += got
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        while len(rest) < n + 2:
            got = s.recv(65536)
            assert got, "the connection closed mid-chunk"
            rest += got
        assert rest[n:n + 2] == b"\r\n", rest[:n + 8]
        body, rest = body + rest[:n], rest[n + 2:]
        if n == 0:
            return head, body


def test_a_reader_too_slow_for_the_socket_gets_every_frame_in_order(srv):
    """A client that reads nothing while a 300-token reply streams, through small socket buffers on both ends:
    the relay's writes stop being taken whole, each time the loop writes what was left and takes the stream
    back (uvicorn's flow control), handing it out again once drained.  Read at last, the response is well-formed
    chunked HTTP whose frames carry the non-streamed reply's text, in order."""
    sndbuf = srv.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)     # the next accepted socket's
    try:
        body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
                "ignore_eos": True}
        raw = json.dumps({**body, "stream": True}).encode()
        before = _counters(srv)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(60)
        s.connect(("127.0.0.1", srv.port))
        with s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            deadline = time.monotonic() + 60
            while _counters(srv)[1] == before[1]:      # a write the socket did not take whole
                assert time.monotonic() < deadline, "no write spilled"
                time.sleep(0.2)
            _, stream = _read_chunked(s)
    finally:
        srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    after = _counters(srv)
    assert after[1] > before[1] and after[0] > before[0], (before, after)
    frames = [json.loads(f.removeprefix(b"data: ")) for f in stream.split(b"\n\n") if f and f != b"data: [DONE]"]
    assert stream.endswith(b"data: [DONE]\n\n")
    whole = httpx.post(srv.base_url + "/completions", json=body, timeout=120).json()["choices"][0]["text"]
    assert "".join(f["choices"][0]["text"] for f in frames) == whole
    assert len(frames) >= 250


def test_a_client_leaving_mid_stream_is_never_written_to_under_another_connection(srv):
    """Clients that hang up while the relay writes their frames, each followed at once by a new
    connection (which may get the descriptor number the closed one had): every frame the new client reads is its
    own reply's, its text is the non-streamed reply's, and the hung-up requests are cancelled, their KV given
    back."""
    body = {"model": MODEL_ID, "prompt": "The quick brown fox", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    cancelled = srv.metrics()["localinfer_requests_cancelled_total"]
    for _ in range(3):
        with httpx.Client(base_url=srv.url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i > 20:
                    break                                 # leaves mid-stream: the connection closes
        follow = _stream(srv, "/v1/completions", {**body, "max_tokens": 12, "prompt": "A different prompt"})
        assert len({f["id"] for f in follow}) == 1
        text = "".join(f["choices"][0]["text"] for f in follow)
        ref = httpx.post(srv.base_url + "/completions", timeout=120,
                         json={**body, "max_tokens": 12, "prompt": "A different prompt", "stream": False})
        assert text == ref.json()["choices"][0]["text"]
    deadline = time.monotonic() + 10
    while srv.metrics()["localinfer_requests_cancelled_total"] < cancelled + 3:
        assert time.monotonic() < deadline, "a hung-up stream was not cancelled"
        time.sleep(0.05)
    assert_only_parked_kv(srv, srv.wait_idle())


def test_the_last_tokens_frame_is_the_relays_and_the_finish_the_loops():
    """A step that gives a reply its last token routes the token (a Frame) and the finish together: the relay writes
    the token's frame to the socket and only then turns the sink off, handing the finish to the loop (the finish
    used to turn the sink off as it was routed, so the last frame waited for the loop to wake).  A real
    socket pair; the sink's descriptor set as ``try_on`` sets it."""
    import os
    from types import SimpleNamespace

    from localinfer.serve.http.direct import DirectSink, Frame, loop_events, write_frames
    from localinfer.serve.http.runtime import Event
    from localinfer.serve.request import FinishReason

    a, b = socket.socketpair()
    with a, b:
        sink = DirectSink(None, lambda ev: b"data: %d\n\n" % ev.token)
        sink._fd = os.dup(a.fileno())
        h = SimpleNamespace(sink=sink)
        frame, finish = sink.route(Event(0, 7)), sink.route(Event(0, None, FinishReason.LENGTH))
        assert type(frame) is Frame and finish.reason is FinishReason.LENGTH and sink._fd >= 0
        assert write_frames([(h, frame), (h, finish)]) == [(h, finish)]
        assert b.recv(100) == b"9\r\ndata: 7\n\n\r\n" and sink._fd == -1 and sink.counts == [1, 0]
        assert not sink.try_on()                         # finished: never on again
        other = DirectSink(None, lambda ev: b"")          # the relay failed on a step: its finishes' sinks go off too
        other._fd = os.dup(a.fileno())
        g = SimpleNamespace(sink=other)
        events = [(g, other.route(Event(0, 8))), (g, other.route(Event(0, None, FinishReason.STOP)))]
        assert loop_events(events) == events[1:] and other._fd == -1
