"""`localinfer serve` as a command: bad flags exit non-zero without a traceback, /health is 503 while loading,
and SIGTERM/SIGINT let the request in flight finish, then exit 0."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import pytest

from tests.serve.test_http_support import exits_cleanly, reap, sse_events, start_cli

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")


@pytest.mark.parametrize("argv, words", [
    (["--port", "70000"], "--port"), (["--parallel", "0"], "--parallel"), (["--max-queue", "-1"], "--max-queue"),
    (["--host", "0.0.0.0"], "API key"), (["--host", "192.168.1.5", "--api-key", ""], "API key"),
    (["--draft-max", "4"], "--lookup"), (["--lookup", "--draft-max", "0"], "--draft-max"), (["--chunk", "0"], "--chunk"), (["--itl-target", "-3"], "--itl-target"),
    (["--ctx", "100000"], "--ctx"), (["--backend", "mlx"], "llama.cpp or torch"), (["--grace", "-1"], "--grace"),
    (["--chunk", "8", "--itl-target", "5"], "not allowed with"), (["--prefix-cache", "maybe"], "invalid choice"),
    (["--api-key", "has space"], "API key"), (["--partial-slack", "half"], "--partial-slack"),
    (["--partial-slack", "-1"], "--partial-slack"), (["--decode-share", "nan"], "--decode-share"),
])
def test_bad_flags_exit_2_with_one_line(argv, words, capsys, monkeypatch):
    from localinfer.cli import main

    monkeypatch.delenv("LOCALINFER_API_KEY", raising=False)
    try:
        code = main(["serve", *argv])
    except SystemExit as exc:                         # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert words in err and "Traceback" not in err


@pytest.mark.parametrize("argv, want", [
    ([], {"token_budget": 512, "chunk_tokens": 512, "itl_target_s": None, "max_running": 4, "draft_max": 0}),
    (["--token-budget", "96", "--chunk", "32", "-np", "2"], {"token_budget": 96, "chunk_tokens": 32, "max_running": 2}),
    (["--itl-target", "40"], {"itl_target_s": 0.04}),
    (["--lookup", "--draft-max", "5"], {"draft_max": 5}),
    (["--partial-slack", "off"], {"partial_slack": None}), (["--partial-slack", "0.5"], {"partial_slack": 0.5}),
    (["--decode-share", "0.25"], {"decode_share": 0.25}), (["--decode-share", "0"], {"decode_share": 0.0}),
])
def test_serving_flags_reach_the_scheduler(argv, want):
    import argparse

    from localinfer.commands import serve
    from localinfer.serve.http.config import DEFAULT_DECODE_SHARE, DEFAULT_PARTIAL_SLACK, build_engine
    from localinfer.serve.simulated import SimulatedExecutor
    from localinfer.serve.step_model import LinearStepModel

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    config = serve.serve_config(parser.parse_args(argv), n_batch=512)
    _, engine, _ = build_engine(SimulatedExecutor(LinearStepModel(0.01, 1e-4, 0.0), n_slots=config.n_slots), config)
    got = engine.scheduler.config
    for name, value in {"partial_slack": DEFAULT_PARTIAL_SLACK, "decode_share": DEFAULT_DECODE_SHARE, **want}.items():
        assert getattr(got, name) == value, (name, getattr(got, name))


def test_health_is_503_while_loading(default_model):
    from localinfer.backends.engine import LoadPlan
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor
    from localinfer.serve.http.config import ServeConfig
    from localinfer.serve.http.runtime import Runtime

    go = threading.Event()

    def slow_open():
        go.wait(30)
        return LlamaCppExecutor(LoadPlan(str(default_model), n_ctx=256, n_seq=1, n_threads=1))

    runtime = Runtime(slow_open, ServeConfig.build(parallel=1))
    with _bare_server(runtime) as url:
        try:
            r = httpx.get(url + "/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and r.headers["retry-after"] == "1"
        finally:
            go.set()
        assert runtime.ready.wait(30)
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


@contextlib.contextmanager
def _bare_server(runtime):
    """uvicorn around ``runtime`` on a free port, in a thread: the root URL once it accepts."""
    from localinfer.serve.http.app import AppConfig
    from localinfer.serve.http.server import bind, make_server

    sock = bind("127.0.0.1", 0)
    server, _ = make_server(runtime, AppConfig(model_id="m", template=None))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        t.join(30)
        sock.close()


def _start(*flags):
    return start_cli("-t", "1", "--ctx", "512", "-fa", "on", *flags)


def test_sigterm_finishes_the_stream_in_flight_then_exits_0():
    p, url = _start("--grace", "20")
    try:
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Once upon a time", "max_tokens": 48,
                "temperature": 0, "stream": True, "ignore_eos": True}
        lines: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            it = r.iter_lines()
            lines.append(next(it))
            p.send_signal(signal.SIGTERM)
            lines += list(it)
        events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert p.wait(30) == 0
        err = p.stderr.read()
        assert "Traceback" not in err and "stopped (signal 15)" in err
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        reap(p)


def test_sigterm_during_a_prefill_stops_accepting_and_finishes_it():
    p, url = _start("--grace", "20")
    try:
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "one two three four " * 100, "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}
        got = {}

        def send():
            got["r"] = httpx.post(url + "/v1/completions", json=body, timeout=60)
            got["at"] = time.monotonic()

        t = threading.Thread(target=send)
        t.start()
        end = time.monotonic() + 30           # until it holds a slot (400 prompt tokens on 1 thread: well over a
        while time.monotonic() < end:         # second of prefill), not a fixed sleep a loaded machine overruns
            if "localinfer_requests_running 1.0" in httpx.get(url + "/metrics", timeout=10).text:
                break
            time.sleep(0.02)
        signalled = time.monotonic()
        p.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        try:                                  # a new request is refused: 503, or its connection is
            late = httpx.post(url + "/v1/completions", json={**body, "prompt": "hi"}, timeout=10).status_code
        except httpx.TransportError:
            late = "refused"
        t.join(60)
        r = got["r"]
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        assert got["at"] > signalled and late in (503, "refused"), late    # it was in flight at the signal
        assert p.wait(30) == 0 and "Traceback" not in p.stderr.read()
    finally:
        reap(p)


def test_sigint_when_idle_exits_0():
    p, url = _start("--api-key", "k")
    try:
        assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer k"}).json()["data"][0]["id"]
        p.send_signal(signal.SIGINT)
        exits_cleanly(p)
    finally:
        reap(p)


def test_json_error_shape_and_allowed_hosts_from_the_command(tmp_path):
    import socket

    p, url = _start("--allow-host", "Box.LAN")
    try:
        r = httpx.post(url + "/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
        assert r.status_code == 400 and json.loads(r.text)["error"]["code"] == "invalid_json"
        for host, status in (("box.lan:8080", 200), (socket.gethostname(), 200), ("evil.example", 403)):
            assert httpx.get(url + "/v1/models", headers={"host": host}).status_code == status, host
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0


def test_quantized_kv_an_alias_and_a_template_that_refuses(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system "
                        "messages here') }}{% endif %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")
    p, url = _start("-ctk", "q8_0", "-ctv", "q8_0", "--alias", "house-model", "--chat-template", str(template))
    try:
        user = {"role": "user", "content": "Name a colour."}
        r = httpx.post(url + "/v1/chat/completions", json={"model": "house-model", "messages": [user],
                                                            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        r = httpx.post(url + "/v1/chat/completions", json={"model": "house-model", "max_tokens": 4,
                                                            "messages": [{"role": "system", "content": "x"}, user]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "template_error" and err["param"] == "messages"
        assert "no system messages here" in err["message"]
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0


def test_sigterm_past_the_grace_period_cancels_and_still_ends_the_stream():
    p, url = _start("--grace", "1")
    try:
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Once upon a time", "max_tokens": 480,
                "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            it = r.iter_lines()
            lines = [next(it)]
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            lines += list(it)
        assert time.monotonic() - t0 < 1 + 6      # the grace period, then the cut: not 480 tokens (≈15 s here)
        events = sse_events(lines)
        # OpenAI's clients know only stop and length (and raise on an error event): the cut is an error
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", events[-3:]
        assert all(c["finish_reason"] is None for e in events[:-2] for c in e["choices"])
        assert p.wait(30) == 0
    finally:
        reap(p)


def test_a_signal_while_loading_stops_the_load(default_model):
    """SIGTERM as llama.cpp starts to load (the handler calls shutdown_after): the load stops through its
    progress callback and the runtime ends stopped, not failed (the CLI then exits 0)."""
    from localinfer.backends.engine import LoadPlan
    from localinfer.commands.serve import open_llamacpp
    from localinfer.serve.http.config import ServeConfig
    from localinfer.serve.http.runtime import Runtime

    plan = LoadPlan(str(default_model), n_ctx=256, n_seq=2, n_threads=1, options={"kv_unified": True})
    opened = []

    def signalled_then_open():
        runtime.shutdown_after(0.0)
        opened.append(open_llamacpp(plan))         # raises: the load was stopped

    runtime = Runtime(signalled_then_open, ServeConfig.build(parallel=1))
    runtime.start()
    assert runtime.ready.wait(30)
    runtime.stop()
    assert runtime.state == "stopped" and runtime.load_error is None and not opened


def test_a_model_llama_cpp_cannot_load_ends_the_server_with_1(tmp_path):
    """The header reads (so the fit check passes) but llama.cpp refuses the vocabulary: the server says why in
    one line and exits 1 instead of answering 503 forever; /health never shows the path."""
    import subprocess
    import sys

    from tests.support.ggufgen import write_tiny_llama

    bad = write_tiny_llama(tmp_path / "badtok.gguf", extra_kv={"tokenizer.ggml.model": "nonsense"})
    p = subprocess.Popen([sys.executable, "-m", "localinfer", "serve", str(bad), "--port", "0", "-t", "1"],
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.wait(60) == 1
    finally:
        reap(p)
    lines = [ln for ln in p.stderr.read().splitlines() if ln.startswith(("error", "Traceback", "stopped"))]
    assert lines == ["error: the model failed to load: llama.cpp could not load badtok.gguf: "
                     "error loading model vocabulary: unknown tokenizer: 'nonsense'"], lines


def test_a_failed_load_answers_503_without_the_error_text():
    from localinfer.serve.http.config import ServeConfig
    from localinfer.serve.http.runtime import Runtime

    def failing_open():
        raise OSError("cannot open /home/someone/secret/model.gguf")

    runtime = Runtime(failing_open, ServeConfig.build(parallel=1))
    with _bare_server(runtime) as url:
        assert runtime.ready.wait(30) and runtime.state == "failed"
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "failed"}
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "load_failed" and "secret" not in r.text


def test_a_plan_that_does_not_fit_is_refused_before_binding(capsys, tmp_path):
    from gguf_tools.skeleton import write_skeleton
    from localinfer.cli import main

    big = write_skeleton("qwen3-235b-a22b", tmp_path / "big.gguf")     # header only, sparse data
    code = main(["serve", str(big), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: needs") and "hint:" in err and "serving" not in err


def test_insecure_non_loopback_bind_warns(capsys, monkeypatch):
    import argparse

    from localinfer.commands import serve

    monkeypatch.delenv("LOCALINFER_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve._check(parser.parse_args(["--host", "0.0.0.0", "--insecure"])) is None
    assert "without an API key" in capsys.readouterr().err
    monkeypatch.setenv("LOCALINFER_API_KEY", "from-env")
    assert serve._check(parser.parse_args(["--host", "0.0.0.0"])) == "from-env"
    assert serve._check(parser.parse_args(["--api-key", "flag"])) == "flag"


def test_the_servers_llama_cpp_executor_parks_in_host_memory_only_when_it_has_ids_to_park_in(default_model):
    """--parked 0 or --prefix-cache off leave no ids past --parallel: no host tier, so no load-time probe."""
    from localinfer.backends.engine import LoadPlan
    from localinfer.commands.serve import _executor_factory

    for n_seq, parks in ((2, False), (3, True)):
        plan = LoadPlan(str(default_model), n_ctx=256, n_seq=n_seq, n_threads=1, options={"kv_unified": True})
        ex = _executor_factory("llama.cpp", plan, 2)()
        try:
            assert ex.parks_in_host is parks and (ex.position_bytes > 0) is parks
        finally:
            ex.close()
