"""`serve`'s flags for issue 32: a missing, broken or blocking --chat-template refused at start in one line,
the connection limits and origins checked, and the API key read from a file."""

from __future__ import annotations

import argparse
import os
import threading

import pytest

pytest.importorskip("uvicorn")


def _main(argv, capsys, monkeypatch) -> tuple[int, str]:
    from localinfer.cli import main

    monkeypatch.delenv("LOCALINFER_API_KEY", raising=False)
    try:
        code = main(["serve", "--port", "0", *argv])
    except SystemExit as exc:                         # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--header-timeout", "0"], "--header-timeout"), (["--body-timeout", "-1"], "--body-timeout"),
    (["--keep-alive", "1e9"], "--keep-alive"), (["--max-connections", "0"], "--max-connections"),
    (["--allowed-origins", "evil.example"], "--allowed-origins"),
    (["--allowed-origins", "http://a.example/path"], "--allowed-origins"),
    (["--api-key", "k", "--api-key-file", "/dev/null"], "--api-key-file"),
])
def test_bad_limit_flags_exit_2_with_one_line(argv, words, capsys, monkeypatch):
    code, err = _main(argv, capsys, monkeypatch)
    assert code == 2, err
    assert words in err and "Traceback" not in err


def test_a_missing_broken_or_blocking_chat_template_is_refused_at_start(tmp_path, capsys, monkeypatch):
    """Bug 3: `serve` used to report ready, then answer every chat request 500; a FIFO hung it (item 7)."""
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    refuses = tmp_path / "refuses.jinja"
    refuses.write_text("{{ raise_exception('this template refuses everything') }}")
    fifo = tmp_path / "fifo.jinja"
    os.mkfifo(fifo)
    for path, words in ((tmp_path / "missing.jinja", "No such file"), (broken, "syntax error"),
                        (refuses, "one-message conversation"), (fifo, "not a regular file"), ("/dev/zero", "regular")):
        done: dict = {}

        def go(path=path, done=done):
            done["r"] = _main(["--chat-template", str(path)], capsys, monkeypatch)
        t = threading.Thread(target=go, daemon=True)
        t.start()
        t.join(60)
        assert "r" in done, f"serve hung on --chat-template {path}"
        code, err = done["r"]
        assert code != 0 and err.startswith("error:") and words in err, (path, err)
        assert "Traceback" not in err and "serving" not in err and len(err.strip().splitlines()) <= 2, err


def test_the_api_key_from_a_file(tmp_path, monkeypatch):
    from localinfer.commands import serve
    from localinfer.errors import UsageError

    monkeypatch.delenv("LOCALINFER_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    key = tmp_path / "key"
    key.write_text("s3cret-from-file\nignored\n")
    assert serve._check(parser.parse_args(["--api-key-file", str(key)])) == "s3cret-from-file"
    key.write_text("\n")
    with pytest.raises(UsageError, match="empty"):
        serve._check(parser.parse_args(["--api-key-file", str(key)]))
    with pytest.raises(UsageError, match="API key file"):
        serve._check(parser.parse_args(["--api-key-file", str(tmp_path / "none")]))


def test_origins_flag_parses_lists():
    from localinfer.commands.serve import origins

    assert origins(["http://a.example:3000, https://b.example/", "*"]) == \
        ("http://a.example:3000", "https://b.example", "*")


def test_a_second_sigint_cancels_at_once_and_every_reply_ends_in_json():
    """Item 8: a second SIGINT gave plain-text 500s and tracebacks; now it ends the grace period, streams get the
    shutdown error event and [DONE], replies not streamed a 503 in OpenAI's shape, and the exit status is 0."""
    import json
    import signal
    import time

    import httpx

    from tests.serve.test_http_support import exits_cleanly, reap, sse_events, start_cli

    p, url = start_cli("--grace", "60", "-t", "1")
    try:
        body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True}
        got = {}

        def whole():
            got["r"] = httpx.post(url + "/v1/completions", json=body, timeout=120)
        t = threading.Thread(target=whole)
        t.start()
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            it = r.iter_lines()
            lines.append(next(it))
            p.send_signal(signal.SIGINT)
            time.sleep(0.5)
            p.send_signal(signal.SIGINT)
            lines += list(it)
        t.join(60)
        events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", events[-3:]
        r = got["r"]
        assert r.status_code == 503 and json.loads(r.text)["error"]["code"] == "shutting_down", r.text
        exits_cleanly(p)
    finally:
        reap(p)


def test_queued_requests_get_their_503_at_once_while_the_running_one_keeps_its_grace():
    """Item 8: requests still queued at SIGINT waited out the whole grace period before their 503.  Now they get it
    (OpenAI's shape, code shutting_down) at once, streamed or not, while the running stream goes on yielding
    tokens; a second SIGINT then ends it with the shutdown error event, and the exit status is 0."""
    import json
    import signal
    import time

    import httpx

    from tests.serve.test_http_support import exits_cleanly, reap, sse_events, start_cli

    p, url = start_cli("--parallel", "1", "--grace", "120", "-t", "1")
    try:
        body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
        got = {}

        def queued(name, stream):
            got[name] = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 4, "stream": stream},
                                   timeout=120)
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            it = r.iter_lines()
            lines = [next(it)]
            waiting = [threading.Thread(target=queued, args=a) for a in (("whole", False), ("stream", True))]
            for t in waiting:
                t.start()
            deadline = time.monotonic() + 60
            while "localinfer_requests_waiting 2.0" not in httpx.get(url + "/metrics", timeout=10).text:
                assert time.monotonic() < deadline, "the two requests were not queued"
                time.sleep(0.05)
            p.send_signal(signal.SIGINT)
            for t in waiting:
                t.join(60)
            for name in ("whole", "stream"):
                assert got[name].status_code == 503, got[name].text
                assert json.loads(got[name].text)["error"]["code"] == "shutting_down"
            more = [next(it) for _ in range(8)]             # the running stream still yields tokens
            assert all(e["choices"][0]["text"] is not None for e in sse_events(more)), more
            p.send_signal(signal.SIGINT)
            lines += more + list(it)
        events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", events[-3:]
        exits_cleanly(p)
    finally:
        reap(p)


def test_a_signal_before_the_server_starts_exits_0_as_after(monkeypatch, capsys):
    """Item 8: SIGTERM while the plan was being made exited 143, once serving 0; now 0 in every phase."""
    from localinfer.commands import _common
    from localinfer.util.signals import Terminated

    def stopped(args):
        raise Terminated(15)
    monkeypatch.setattr(_common, "read_spec", stopped)
    code, err = _main([], capsys, monkeypatch)
    assert code == 0 and "stopped (signal 15)" in err and "Traceback" not in err


def test_a_reply_still_being_written_when_the_engine_stops_keeps_the_vocabulary(default_model):
    """The engine stopped (its requests cancelled at the end of the grace period) while the HTTP side was behind it,
    with tokens still to turn into text: the model closed at once and the stream died mid-body ("this engine is
    closed"; seen under load after a second SIGINT).  It closes when the server stops, after the replies."""
    import time

    import httpx

    from tests.serve.test_http_support import MODEL_ID, LiveServer, sse_events

    srv = LiveServer(default_model, parallel=1)
    try:
        body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            it = r.iter_lines()
            lines = [next(it)]
            srv.runtime._loop.call_soon_threadsafe(time.sleep, 1.0)     # the HTTP side falls behind the engine
            time.sleep(0.3)                                              # ... by some tokens
            srv.runtime.shutdown_after(0.0)
            lines += list(it)
        events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", events[-3:]
        assert sum(len(c["text"]) for e in events[:-2] for c in e["choices"]) > 0
    finally:
        srv.stop()


def test_at_shutdown_a_choice_waiting_behind_its_sibling_keeps_the_grace_period(default_model):
    """The 503 at once is for requests nobody started: a reply's second choice queued behind its first (n=2 on one
    slot) is part of a running reply and is served within the grace period, not refused (which failed the reply)."""
    import time

    import httpx

    from tests.serve.test_http_support import MODEL_ID, LiveServer

    srv = LiveServer(default_model, parallel=1)
    try:
        got = {}
        body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "n": 2,
                "ignore_eos": True}
        t = threading.Thread(target=lambda: got.update(r=httpx.post(srv.url + "/v1/completions", json=body,
                                                                    timeout=60)))
        t.start()
        sched, deadline = None, time.monotonic() + 30
        while True:
            sched = srv.runtime.engine.scheduler
            if len(sched.running) == 1 and len(sched.waiting) == 1:
                break
            assert time.monotonic() < deadline and t.is_alive(), "the second choice was never queued"
            time.sleep(0.001)
        srv.runtime.shutdown_after(30.0)
        t.join(60)
        r = got["r"]
        assert r.status_code == 200, r.text
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
    finally:
        srv.stop()
