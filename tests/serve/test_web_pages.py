"""The pages' HTTP side: files, headers (CSP, nosniff), the API key and Host checks, the engine state JSON
against /metrics, prompt text only with --show-prompts; and, in headless Chromium, the key asked once."""

from __future__ import annotations

import json
import re
import threading
import time
from html.parser import HTMLParser

import httpx
import pytest

from localinfer.serve.http.pages import CSP
from localinfer.serve.http.state import VERSION, EngineWatch
from tests.serve.test_http_support import MODEL_ID, LiveServer
from tests.support.browser import chromium, wait_for

KEY = "sekrit-key-33"
AUTH = {"Authorization": f"Bearer {KEY}"}
UNSAFE = re.compile(r"\.(inner|outer)HTML|insertAdjacentHTML|document\.write|\beval\(|new Function|setAttribute\(.on")


@pytest.fixture(scope="module")
def keyed(default_model):
    s = LiveServer(default_model, parallel=2, max_queue=4, ctx=1024, api_key=KEY)
    yield s
    s.stop()


class _Scan(HTMLParser):
    def __init__(self):
        super().__init__()
        self.scripts, self.styles, self.inline, self.handlers = [], [], 0, []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.handlers += [k for k in a if k.startswith("on")]
        if tag == "script":
            self.scripts.append(a.get("src"))
            self._in_script = True
        if tag == "link" and a.get("rel") in ("stylesheet", "icon"):
            self.styles.append(a["href"])
        if "style" in a:
            self.inline += 1

    def handle_endtag(self, tag):
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.inline += 1


@pytest.mark.parametrize("path", ["/", "/engine"])
def test_pages_load_without_the_key_with_csp_and_only_their_own_files(keyed, path):
    r = httpx.get(keyed.url + path, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["content-security-policy"] == CSP and "script-src 'self'" in CSP and "unsafe" not in CSP
    assert r.headers["x-content-type-options"] == "nosniff"
    scan = _Scan()
    scan.feed(r.text)
    assert scan.scripts and None not in scan.scripts           # every script is a file: nothing inline
    assert scan.inline == 0 and scan.handlers == []            # no inline script, style or on* handler
    for src in scan.scripts + scan.styles:
        assert src.startswith("/static/")                       # no CDN: this server's own files
        f = httpx.get(keyed.url + src, timeout=10)
        assert f.status_code == 200 and f.headers["x-content-type-options"] == "nosniff", src
        assert f.headers["content-security-policy"] == CSP
        assert f.headers["content-type"].split(";")[0] in ("text/javascript", "text/css", "image/svg+xml")
        if not src.endswith(".svg"):      # model text goes in as textContent; nothing is fetched from elsewhere
            assert not UNSAFE.search(f.text) and "://" not in f.text, src


def test_unknown_files_and_escapes_are_404(keyed):
    for path in ("/static/nope.js", "/static/..%2Fapp.py", "/static/__init__.py", "/static/"):
        r = httpx.get(keyed.url + path, timeout=10)
        assert r.status_code == 404, path
        assert r.json()["error"]["code"] == "not_found"


def test_data_calls_need_the_key_and_every_path_the_host_check(keyed):
    assert httpx.get(keyed.url + "/v1/engine/state", timeout=10).status_code == 401
    assert httpx.get(keyed.url + "/v1/models", timeout=10).status_code == 401
    r = httpx.get(keyed.url + "/v1/engine/state", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["version"] == VERSION
    assert r.headers["x-content-type-options"] == "nosniff"
    for path in ("/", "/engine", "/static/chat.js", "/v1/engine/state"):   # DNS rebinding: a foreign Host
        r = httpx.get(keyed.url + path, headers={**AUTH, "Host": "evil.example"}, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", path


def _state(s: LiveServer) -> dict:
    r = httpx.get(s.url + "/v1/engine/state", headers=AUTH, timeout=10)
    assert r.status_code == 200
    return r.json()


def _metric_lines(s: LiveServer) -> dict[str, float]:
    text = httpx.get(s.url + "/metrics", headers=AUTH, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "_bucket{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _chat(s: LiveServer, content: str, max_tokens: int = 24, **kw) -> httpx.Response:
    return httpx.post(s.base_url + "/chat/completions", headers=AUTH, timeout=120,
                      json={"model": MODEL_ID, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "temperature": 0, **kw})


def test_state_is_the_metrics_of_one_moment_and_its_grid_adds_up(keyed):
    assert _chat(keyed, "Name three colours.").status_code == 200
    keyed.wait_idle()
    deadline = time.monotonic() + 5
    while True:               # the engine thread snapshots when it goes idle (or within one idle wait)
        state = _state(keyed)
        snap = state["snapshot"]
        metrics = _metric_lines(keyed)
        if snap and snap["metrics"] == metrics or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert state["state"] == "ready" and state["show_prompts"] is False and state["error"] is None
    assert snap["metrics"] == metrics                  # every sample /metrics exports (buckets aside), equal
    pool, grid = snap["pool"], snap["pool"]["grid"]
    assert len(grid) == pool["blocks"] >= pool["capacity"] == metrics["localinfer_kv_blocks_total"]
    assert pool["used"] == metrics["localinfer_kv_blocks_used"] == sum(1 for g in grid if g >= 0 or g == -4) == 0
    assert pool["cached"] == metrics["localinfer_kv_blocks_cached"] == grid.count(-2) + grid.count(-3) > 0
    assert snap["parked"]["sequences"] == metrics["localinfer_kv_sequences_parked"] >= 1
    assert snap["requests"] == [] and snap["running"] == snap["waiting"] == 0
    done = snap["finished"][-1]
    assert done["reason"] == "length" and done["output_tokens"] == 24 and done["refused"] is False
    assert done["ttft_s"] > 0 and done["itl_s"] > 0


def test_state_shows_no_prompt_text_unless_asked(keyed):
    marker = "Zanzibar-quokka"
    for show in (False, True):
        keyed.runtime.watch = EngineWatch(show_prompts=show)     # as serve --show-prompts would build it
        t = threading.Thread(target=_chat, args=(keyed, f"Tell a story about {marker}.", 200))
        t.start()
        try:
            deadline, seen = time.monotonic() + 30, None
            while time.monotonic() < deadline and t.is_alive():
                state = _state(keyed)
                snap = state["snapshot"]
                if snap and snap["requests"] and snap["requests"][0]["output_tokens"] > 2:
                    seen = state
                    break
                time.sleep(0.05)
        finally:
            t.join(120)
        assert seen is not None and seen["show_prompts"] is show
        text = json.dumps(seen)
        assert (marker in text) is show
        req = seen["snapshot"]["requests"][0]
        assert ("prompt" in req and "output" in req) is show
        if show:
            assert marker in req["prompt"] and req["output"]
    keyed.runtime.watch = EngineWatch()       # never None again: the engine thread reads the attribute unlocked


def test_the_page_asks_for_the_key_once_per_session(keyed):
    with chromium() as browser:
        ctx = browser.new_context()
        page = ctx.new_page()
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(keyed.url + "/", timeout=20_000)
        page.wait_for_selector("#keybox:not(.hidden)", timeout=10_000)
        page.fill("#keyinput", "wrong-key")
        page.click("#keysave")
        wait_for(page, "() => document.getElementById('keynote').textContent.includes('refused')")
        page.fill("#keyinput", KEY)
        page.press("#keyinput", "Enter")
        wait_for(page, f"() => document.getElementById('model').textContent.startsWith('{MODEL_ID}')")
        assert page.evaluate("sessionStorage.getItem('localinfer.apiKey')") == KEY
        page.goto(keyed.url + "/engine", timeout=20_000)        # the same tab's session: not asked again
        wait_for(page, "() => window.LI && LI.engine && LI.engine.polls >= 1", 15)
        assert page.is_hidden("#keybox")
        assert page.evaluate("LI.engine.last.version") == VERSION
        assert not [e for e in errors if "Content Security Policy" in e]
        ctx.close()


def test_the_engine_thread_keeps_no_step_records_once_nobody_watches(keyed, monkeypatch):
    from localinfer.serve.http import state

    monkeypatch.setattr(state, "WATCHED_S", 1.5)     # more than one idle wait (0.5 s)
    keyed.runtime.watch = EngineWatch()                          # not read yet: it keeps nothing
    assert _state(keyed)["snapshot"] is not None                 # the first read waits for a fresh snapshot
    assert _chat(keyed, "Say yes.", 4).status_code == 200
    assert keyed.runtime.engine.records is not None               # watched: the engine records steps (drained each)
    deadline = time.monotonic() + 5
    while keyed.runtime.engine.records is not None:                # unwatched: the next idle wait stops them
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_serve_show_prompts_reaches_the_engine_view(default_model):
    from tests.serve.test_http_support import start_cli

    for flags, shown in (((), False), (("--show-prompts",), True)):
        p, url = start_cli(str(default_model), "-t", "1", "--ctx", "512", "--parallel", "1", "--parked", "0", *flags)
        try:
            r = httpx.get(url + "/v1/engine/state", timeout=10)
            assert r.status_code == 200 and r.json()["show_prompts"] is shown
        finally:
            p.terminate()
            p.wait(30)


def test_the_keyless_file_paths_reach_no_data_route(keyed):
    """Paths the guard lets through without the key (under /static/) but that name a data route once dots or
    encoded slashes are undone: raw on the socket, as a client that does not normalise would send them."""
    import socket

    for path in ("/static/../v1/models", "/static/..%2F..%2Fv1%2Fmodels", "/static/%2e%2e/v1/engine/state",
                 "/static//v1/models"):
        with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as c:
            c.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := c.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 404"), (path, data[:200])
        assert b'"data"' not in data and b"snapshot" not in data
