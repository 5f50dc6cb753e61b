"""Issue 44's weak items: what Ollama's own examples send, and start-up flags that could never work."""

from __future__ import annotations

import json

import pytest

from localinfer.cli import main
from tests.serve.test_http_support import MODEL_ID

httpx = pytest.importorskip("httpx")

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def test_api_show_takes_the_older_name_field_and_404s_a_model_it_does_not_have(http):
    r = http.post("/api/show", json={"name": MODEL_ID})
    assert r.status_code == 200, r.text
    assert r.json()["model_info"]["general.architecture"] == "llama"
    assert http.post("/api/show", json={"model": f"{MODEL_ID}:latest"}).status_code == 200
    r = http.post("/api/show", json={"model": "llama3:70b"})
    assert r.status_code == 404 and "not found" in r.json()["error"], r.text


@pytest.mark.parametrize("value, ok", [("5m", True), ("1h", True), (-1, True), (0, True), ("-1", True),
                                       ("1h30m", True), (".5h", True), ("banana", False), ("5 minutes", False),
                                       ("1h30", False), (True, False), ({}, False)])
def test_keep_alive_is_validated(http, value, ok):
    r = http.post("/api/chat", json={"model": MODEL_ID, "messages": CHAT, "stream": False, "keep_alive": value,
                                     "options": {"num_predict": 1, "temperature": 0}})
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and "keep_alive" in r.json()["error"], r.text


@pytest.mark.parametrize("path, body", [
    ("/api/chat", {"model": MODEL_ID, "messages": CHAT, "stream": False, "options": {"num_predict": 1}}),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": CHAT, "max_tokens": 1})])
def test_a_json_body_sent_the_way_curl_d_sends_it_is_read(http, path, body):
    # curl -d '{...}' labels the body application/x-www-form-urlencoded, as in Ollama's README examples
    r = http.post(path, content=json.dumps(body), headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text
    r = http.post(path, content=json.dumps(body), headers={"content-type": "image/png"})
    assert r.status_code == 415
    # a page on another site can send such a "simple" request without a preflight: the Origin check refuses it
    r = http.post(path, content=json.dumps(body), headers={"content-type": "application/x-www-form-urlencoded",
                                                           "origin": "https://evil.example"})
    assert r.status_code == 403


def test_a_key_no_client_can_send_is_refused_at_start(capsys):
    assert main(["serve", "--api-key", "schlüssel", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "ASCII" in err and "Traceback" not in err


def test_worker_on_an_ipv6_address_names_host(capsys):
    assert main(["worker", "--host", "::1"]) == 2
    err = capsys.readouterr().err
    assert "--host" in err and "--rpc" not in err and "127.0.0.1" in err
