"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Messages are one line and name the field (``param``); nothing about the
server's files or stack ever goes into one.
"""

from __future__ import annotations

import json

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
         504: "server_error"}


class APIError(Exception):
    """An error answered with ``status`` and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = " ".join(str(message).split())
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()


def bad(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    """A 400 naming ``param``."""
    return APIError(400, message, param=param, code=code)
