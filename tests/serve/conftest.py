"""Fixtures of the HTTP tests: the session's one live server and an `openai` client on it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def srv(default_model, request):
    """The live server the HTTP test modules share (started once, stopped when pytest ends)."""
    from tests.serve.test_http_support import shared

    return shared(default_model, request.config)


@pytest.fixture(scope="module")
def client(srv):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
