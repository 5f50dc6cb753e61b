"""The access guard (pure ASGI, before routing): Host, Origin and CORS, the API key, the declared body size.

Checked in this order:

* the Host header against the allowed names (DNS rebinding: a page on
  evil.example resolving to 127.0.0.1 still sends ``Host: evil.example``; an IP
  address or a ``*.localhost`` name names nothing an attacker can rebind, so
  those always pass, as in Ollama's check);
* the Origin header, which browsers send with every cross-site request: a page
  on another site must not drive the user's local model, so a request from an
  origin not allowed is a 403 (as Ollama answers).  Allowed: the server's own
  origin (the Host it was reached by), ``http(s)://`` localhost, 127.0.0.1 and
  [::1] on any port, and those given with ``--allowed-origins`` (``*``: any).
  For those, CORS preflights (``OPTIONS`` with ``Access-Control-Request-Method``)
  are answered 200 and replies carry ``Access-Control-Allow-Origin``;
* the bearer token on every path but ``/health`` and the browser pages' (one ``Authorization`` header:
  two are a 400, not "the last wins");
* the declared body size.
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.responses import Response

from localinfer.serve.http import pages
from localinfer.serve.http.errors import APIError

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")
LOCAL_ORIGIN_HOSTS = ("localhost", "127.0.0.1", "[::1]")
ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
PREFLIGHT_MAX_AGE = "600"


def error_response(err: APIError) -> Response:
    return Response(err.json_bytes(), status_code=err.status, media_type="application/json", headers=err.headers)


class Guard:
    """Host and Origin checks, CORS, bearer token and declared body size, before any route runs."""

    def __init__(self, app, config, runtime):
        self.app, self.config, self.runtime = app, config, runtime
        self.key = None if config.api_key is None else config.api_key.encode()
        self.hosts = {h.lower() for h in config.allowed_hosts}
        self.origins = {o.lower().rstrip("/") for o in config.allowed_origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[str, str] = {}
        repeated = None
        for k, v in scope.get("headers", []):
            name = k.decode("latin-1").lower()
            if name in headers and name in ("authorization", "host", "origin", "content-length"):
                repeated = name
            headers[name] = v.decode("latin-1")
        origin = headers.get("origin")
        err = self._check(scope.get("path", ""), scope.get("method", ""), headers, repeated)
        if err is not None:
            self.runtime.metrics.reject(err.status)
            if origin is not None and err.param not in ("origin", "host") and \
                    self._origin_allowed(origin, headers.get("host", "")):    # an allowed page may read why (401)
                send = _with_cors(send, origin)
            return await error_response(err)(scope, receive, send)
        if origin is None:
            return await self.app(scope, receive, send)
        if scope.get("method") == "OPTIONS" and "access-control-request-method" in headers:
            return await self._preflight(origin, headers)(scope, receive, send)
        return await self.app(scope, receive, _with_cors(send, origin))

    def _check(self, path: str, method: str, headers: dict[str, str], repeated: str | None) -> APIError | None:
        if repeated is not None:
            return APIError(400, f"the request has more than one {repeated} header; send one",
                            param=repeated, code="invalid_header")
        host = _hostname(headers.get("host", ""))
        if not self._host_allowed(host):
            return APIError(403, f"Host {host[:80]!r} is not served here (--allow-host adds one)",
                            param="host", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, headers.get("host", "")):
            return APIError(403, f"Origin {origin[:80]!r} may not use this server (--allowed-origins adds one)",
                            param="origin", code="origin_not_allowed")
        if method == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
            return None                       # a preflight carries no credentials
        if self.key is not None and path != "/health" and not pages.public(path):   # pages ask for the key
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                return APIError(401, "missing or wrong API key: send Authorization: Bearer KEY" if auth
                                else "this server needs an API key: send Authorization: Bearer KEY",
                                code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, "Content-Length is not a number", param="content-length")
            if int(length) > self.config.max_body_bytes:
                return APIError(413, f"the request body is {int(length)} bytes; the limit is "
                                     f"{self.config.max_body_bytes} (--max-body)", code="body_too_large")
        return None

    def _host_allowed(self, host: str) -> bool:
        if "*" in self.hosts or host in self.hosts or host.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(host[1:-1] if host.startswith("[") else host)
        except ValueError:
            return False
        return True

    def _origin_allowed(self, origin: str, host_header: str) -> bool:
        o = origin.strip().lower().rstrip("/")
        if "*" in self.origins or o in self.origins:
            return True
        scheme, sep, rest = o.partition("://")
        if not sep or scheme not in ("http", "https") or "/" in rest or "@" in rest:
            return False
        if rest == host_header.strip().lower():           # the server's own pages (same origin)
            return True
        return _hostname(rest) in LOCAL_ORIGIN_HOSTS or _hostname(rest).endswith(".localhost")

    @staticmethod
    def _preflight(origin: str, headers: dict[str, str]):
        """200 (as llama-server and Starlette's CORS answer it), the names capitalised as browsers show them
        (header names are case-blind, but some clients read them from a plain dict)."""
        asked = headers.get("access-control-request-headers", "")
        allow = ", ".join(h.strip() for h in asked.split(",") if h.strip() and len(h) < 100) or "content-type"
        raw = [(b"Access-Control-Allow-Origin", origin.encode("latin-1")),
               (b"Access-Control-Allow-Methods", ALLOW_METHODS.encode()),
               (b"Access-Control-Allow-Headers", allow.encode("latin-1")),
               (b"Access-Control-Max-Age", PREFLIGHT_MAX_AGE.encode()), (b"Vary", b"Origin"),
               (b"content-length", b"0")]

        async def answer(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            await send({"type": "http.response.body", "body": b""})
        return answer


def _with_cors(send, origin: str):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            extra = [(b"Access-Control-Allow-Origin", origin.encode("latin-1")), (b"Vary", b"Origin")]
            message = dict(message, headers=[*message.get("headers", []), *extra])
        await send(message)
    return wrapped


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
