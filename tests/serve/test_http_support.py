"""A real uvicorn server on 127.0.0.1 (a free port) around the embedded model, for the HTTP tests.

One thread, flash attention on, so a greedy request gives the same tokens alone
and inside any batch (see tests/backends/test_llamacpp_executor.py).  ``shared()``
starts one server per test session; ``LiveServer(...)`` starts one with its own
settings (API key, queue length) and ``stop()`` ends it.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

MODEL_ID = "smollm2"


class LiveServer:
    """``open_executor(config)``: the executor factory for the runtime (default: the server's llama.cpp executor,
    one unified cache of ``ctx`` cells, 1 thread, flash attention on, parked KV in host memory); ``app``: more
    AppConfig fields; ``limits``: make_server's connection limits."""

    def __init__(self, model, *, parallel: int = 4, max_queue: int = 8, ctx: int = 1024, api_key: str | None = None,
                 grace_s: float = 2.0, open_executor=None, show_prompts: bool = False, app: dict | None = None,
                 limits: dict | None = None, **serve):
        from localinfer.backends.engine import LoadPlan
        from localinfer.model.spec import ModelSpec
        from localinfer.model.templates import template_with_vocab
        from localinfer.serve.http.app import AppConfig
        from localinfer.serve.http.config import ServeConfig
        from localinfer.serve.http.runtime import Runtime
        from localinfer.serve.http.server import bind, make_server

        config = ServeConfig.build(parallel=parallel, max_queue=max_queue, **serve)
        if open_executor is None:
            from localinfer.backends.llamacpp import aside
            from localinfer.commands.serve import open_llamacpp

            plan = LoadPlan(str(model), n_ctx=ctx, n_seq=config.n_slots, n_threads=1, flash_attn=True,
                            options={"kv_unified": True,          # n_slots: --parallel + the parked sequences
                                     "prefill_aside": aside.wanted()})    # as serve's plan asks
            factory = lambda: open_llamacpp(plan)
        else:
            factory = open_executor(config)
        spec = ModelSpec.from_gguf(str(model))
        self.runtime = Runtime(factory, config)
        self.config = AppConfig(model_id=MODEL_ID, api_key=api_key, template=lambda tok: template_with_vocab(spec, tok),
                                show_prompts=show_prompts, **(app or {}))
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.server, self.app = make_server(self.runtime, self.config, grace_s=grace_s, **(limits or {}))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.server.started and self.runtime.ready.is_set()):
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        assert self.runtime.state == "ready", self.runtime.load_error

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[str, float]:
        """Unlabelled sample values from /metrics (name -> value)."""
        import httpx

        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds a block (AssertionError after timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["localinfer_requests_running"] == 0 and m["localinfer_requests_waiting"] == 0
                    and m["localinfer_kv_blocks_used"] == 0 and self.runtime.outstanding == 0)
            if idle or time.monotonic() > deadline:
                assert idle, {k: v for k, v in m.items() if "bucket" not in k}
                return m
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def assert_only_parked_kv(srv: LiveServer, m: dict[str, float], block_tokens: int = 16) -> None:
    """Idle metrics: no cell holds a token, the parked requests' whole blocks are in host memory, a copy each (a
    prefix two of them share is held twice), and the cached blocks are those the parked requests keep."""
    assert m["localinfer_kv_blocks_used"] == 0 and m["localinfer_kv_cells_used"] == 0
    parked = srv.runtime.engine.blocks.parked
    assert m["localinfer_kv_host_tokens"] == sum(map(len, parked.values())) * block_tokens
    assert m["localinfer_kv_blocks_cached"] == len({b for blocks in parked.values() for b in blocks})
    assert m["localinfer_kv_sequences_parked"] == len(parked)


_shared: LiveServer | None = None


def shared(model, config) -> LiveServer:
    """The session's server (stopped when pytest finishes: ``config`` is the pytest config)."""
    global _shared
    if _shared is None:
        _shared = LiveServer(model)
        config.add_cleanup(_stop_shared)
    return _shared


def _stop_shared() -> None:
    global _shared
    if _shared is not None:
        _shared.stop()
        _shared = None


def start_cli(*flags, timeout: float = 60.0):
    """``python -m localinfer serve --port 0 FLAGS`` as a subprocess: (process, root URL) once /health is 200."""
    import os
    import re
    import subprocess
    import sys

    import httpx

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("LOCALINFER_API_KEY", None)
    p = subprocess.Popen([sys.executable, "-m", "localinfer", "serve", "--port", "0", *flags],
                         stderr=subprocess.PIPE, text=True, env=env)
    seen, m = "", None
    for _ in range(20):                               # the address line, after any notes
        line = p.stderr.readline()
        seen += line
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if m or not line:
            break
    assert m, seen
    url = f"http://127.0.0.1:{m.group(1)}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return p, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and p.poll() is None, seen + p.stderr.read()
        time.sleep(0.1)


def exits_cleanly(p, timeout: float = 30.0) -> None:
    """The server process ends with status 0 and no traceback on its stderr."""
    assert p.wait(timeout) == 0
    assert "Traceback" not in p.stderr.read()


def reap(p) -> None:
    """Kill the server process if it still runs (a test's ``finally``)."""
    if p.poll() is None:
        p.kill()
        p.wait()


def sse_events(lines) -> list:
    """Decoded ``data:`` payloads of an SSE body (``[DONE]`` kept as the string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
