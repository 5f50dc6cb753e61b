"""The chat page in headless Chromium with the embedded model: a streamed conversation, Stop cancelling the
request on the server (its KV blocks freed), regenerate, conversations kept across a reload, and model output
holding HTML shown as text, never as markup, and the JSON schema / tools panel (bad JSON refused inline, a reply
held to a schema, a streamed tool call shown as a block)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer
from tests.support.browser import chromium, wait_for

LAST = "() => { const m = document.querySelectorAll('.msg.assistant'); return m[m.length - 1]; }"
LAST_TEXT = f"() => ({LAST})().querySelector('.body').textContent"
LAST_FINISH = f"() => ({LAST})().dataset.finish"
HOSTILE = ("<script>window.pwned = 1</script> and <img src=x onerror=\"window.pwned = 2\">\n\n"
           "# <b>title</b>\n- <iframe src=javascript:alert(1)></iframe>\n"
           "[click](javascript:window.pwned=3) [ok](https://example.com/a) `<svg onload=x>` **<i>bold</i>**\n"
           "```html\n<img src=y onerror=\"window.pwned = 4\">\n```")


@pytest.fixture(scope="module")
def server(default_model):
    s = LiveServer(default_model, parallel=2, max_queue=4, ctx=2048)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def page(server):
    with chromium() as browser:
        ctx = browser.new_context(viewport={"width": 1200, "height": 800})
        page = ctx.new_page()
        page.errors = []
        page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
        page.goto(server.url + "/", timeout=20_000)
        wait_for(page, f"() => document.getElementById('model').textContent.startsWith('{MODEL_ID}')")
        yield page
        ctx.close()


def _settings(page, temperature: str, max_tokens: str) -> None:
    page.fill("#temperature", temperature)
    page.fill("#max_tokens", max_tokens)


def test_a_streamed_reply_stopped_midway_frees_its_blocks_on_the_server(server, page):
    _settings(page, "0", "400")
    page.fill("#input", "Tell me a long story about a dragon who learns to cook.")
    page.press("#input", "Enter")
    wait_for(page, f"() => ({LAST_TEXT})().length > 30", 30)
    n = len(page.evaluate(LAST_TEXT))
    wait_for(page, f"() => ({LAST_TEXT})().length > {n}")            # streamed: the text grows as tokens come
    m = server.metrics()
    assert m["localinfer_requests_running"] == 1 and m["localinfer_kv_blocks_used"] > 0
    cancelled = m.get("localinfer_requests_cancelled_total", 0)
    assert page.is_visible("#stop") and page.is_hidden("#send")
    page.click("#stop")
    assert wait_for(page, LAST_FINISH) == "stopped"
    m = server.wait_idle(10)                                          # the server cancelled it: no block in use
    assert m["localinfer_kv_blocks_used"] == 0 and m["localinfer_requests_running"] == 0
    assert m["localinfer_requests_cancelled_total"] == cancelled + 1
    stopped = page.evaluate(LAST_TEXT)
    assert len(stopped) > n and page.is_visible("#send")


def test_the_conversation_goes_on_regenerates_and_survives_a_reload(server, page):
    _settings(page, "0", "24")
    page.fill("#input", "Thank you. Now name two fruits.")
    page.click("#send")
    assert wait_for(page, LAST_FINISH, 30) in ("stop", "length")
    first = page.evaluate(LAST_TEXT)
    meta = page.evaluate(f"() => ({LAST})().querySelector('.meta').textContent")
    assert first and "tokens" in meta and "cached" in meta            # the earlier turns came from the prefix cache
    page.click("#regen")                                              # greedy: the same answer again, in its place
    wait_for(page, f"() => ({LAST_FINISH})() === undefined || ({LAST_FINISH})() === ''", 10, 0.01)
    assert wait_for(page, LAST_FINISH, 30) in ("stop", "length")
    assert page.evaluate(LAST_TEXT) == first
    assert page.evaluate("() => document.querySelectorAll('.msg').length") == 4
    page.reload()
    wait_for(page, f"() => document.getElementById('model').textContent.startsWith('{MODEL_ID}')")
    assert page.evaluate("() => document.querySelectorAll('.msg').length") == 4
    assert page.evaluate(LAST_TEXT) == first
    assert page.evaluate("() => JSON.parse(localStorage.getItem('localinfer.chats')).chats[0].messages.length") == 4
    server.wait_idle(10)


def test_html_in_a_reply_is_text(server, page):
    """The renderer fed hostile text, and the model itself asked for HTML (greedy: its answer is fixed)."""
    out = page.evaluate("""(text) => {
        const box = document.createElement('div');
        document.body.appendChild(box);
        LI.renderMarkdown(text, box);
        const tags = [...box.querySelectorAll('*')].map((e) => e.tagName.toLowerCase());
        return {tags, text: box.textContent, links: [...box.querySelectorAll('a')].map((a) => a.href)};
    }""", HOSTILE)
    assert not {"script", "img", "iframe", "svg", "b", "i"} & set(out["tags"])
    assert {"p", "h2", "li", "code", "pre", "strong", "a"} <= set(out["tags"])
    for piece in ("<script>window.pwned = 1</script>", 'onerror="window.pwned = 2"', "<b>title</b>",
                  "<iframe src=javascript:alert(1)></iframe>", "<svg onload=x>", "<i>bold</i>",
                  '<img src=y onerror="window.pwned = 4">'):
        assert piece in out["text"]
    assert out["links"] == ["https://example.com/a"]                  # a javascript: link stays text
    page.click("#newchat")
    _settings(page, "0", "60")
    page.fill("#input", "Write an HTML img tag with an onerror attribute.")
    page.click("#send")
    assert wait_for(page, LAST_FINISH, 30) in ("stop", "length")
    text = page.evaluate(LAST_TEXT)
    body = {"model": MODEL_ID, "temperature": 0, "max_tokens": 60,
            "messages": [{"role": "user", "content": "Write an HTML img tag with an onerror attribute."}]}
    reply = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    model_text = reply["choices"][0]["message"]["content"]
    assert "<img" in model_text and "onerror" in model_text           # the model did write HTML ...
    assert "<img" in text and "onerror" in text                       # ... and the page shows it as text
    assert page.evaluate(f"() => ({LAST})().querySelectorAll('img, script, iframe').length") == 0
    page.wait_for_timeout(300)                                        # an onerror would have fired by now
    assert page.evaluate("() => window.pwned === undefined")
    assert not [e for e in page.errors if "Content Security Policy" in e]
    server.wait_idle(10)


def _panel(page, schema: str = "", tools: str = "", choice: str = "auto", parallel: bool = True) -> None:
    page.evaluate("() => { document.getElementById('structured').open = true; }")
    page.fill("#schema", schema)
    page.fill("#tools", tools)
    page.select_option("#tool_choice", choice)
    page.set_checked("#parallel_tools", parallel)


def test_the_schema_panel_constrains_the_reply_and_refuses_bad_json(server, page):
    sent = []
    page.on("request", lambda r: sent.append(r.post_data) if r.url.endswith("/v1/chat/completions") else None)
    page.click("#newchat")
    _settings(page, "0", "120")
    _panel(page, schema="{bad json")
    page.fill("#input", "What is the capital of France?")
    page.click("#send")
    assert "not valid JSON" in page.text_content("#schema_error")     # shown inline, nothing sent
    assert not sent and page.evaluate("() => document.querySelectorAll('.msg').length") == 0
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    _panel(page, schema=json.dumps(schema))
    page.click("#send")
    assert wait_for(page, LAST_FINISH, 60) == "stop"
    reply = json.loads(page.evaluate(LAST_TEXT))
    assert set(reply) == {"answer"} and isinstance(reply["answer"], str)
    body = json.loads(sent[-1])
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "schema", "schema": schema, "strict": True}}
    assert json.loads(page.evaluate("() => JSON.parse(localStorage.getItem('localinfer.settings')).schema")) == schema
    _panel(page)
    server.wait_idle(10)


def test_the_tools_panel_shows_a_streamed_tool_call(server, page):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    page.click("#newchat")
    _settings(page, "0", "120")
    _panel(page, tools=json.dumps(tools), choice="required", parallel=False)    # one call, then the end
    page.fill("#input", "What is the weather in Paris?")
    page.click("#send")
    assert wait_for(page, LAST_FINISH, 60) == "tool_calls"
    calls = page.evaluate(f"""() => [...({LAST})().querySelectorAll('.toolcall')].map((b) =>
        [b.querySelector('.toolname').textContent, b.querySelector('.toolargs').textContent])""")
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    assert isinstance(json.loads(calls[0][1])["city"], str)
    page.reload()                                                     # the panel and the call survive a reload
    wait_for(page, f"() => document.getElementById('model').textContent.startsWith('{MODEL_ID}')")
    assert page.input_value("#tool_choice") == "required" and not page.is_checked("#parallel_tools")
    assert json.loads(page.input_value("#tools")) == tools
    assert page.evaluate(f"() => ({LAST})().querySelector('.toolname').textContent") == "get_weather"
    _panel(page)
    server.wait_idle(10)
