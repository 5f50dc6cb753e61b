"""The routes of the server's other faces, each in its own module: embeddings (``/v1/embeddings``),
the Responses API (``/v1/responses``) and Ollama's API (``/api/...``)."""

from __future__ import annotations


def routes(srv) -> list:
    out: list = []
    for name in ("embeddings", "responses_api", "ollama"):
        try:
            module = __import__(f"localinfer.serve.http.{name}", fromlist=["routes"])
        except ModuleNotFoundError as exc:
            if exc.name != f"localinfer.serve.http.{name}":
                raise
            continue
        out += module.routes(srv)
    return out
