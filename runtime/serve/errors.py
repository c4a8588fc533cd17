"""The OpenAI error object every refusal carries: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

# OpenAI's error types by HTTP status; anything else in 4xx is a request error.
_TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """A request the server refuses (4xx) or cannot serve now (503), with what to tell the client."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def encode(self) -> bytes:
        # ASCII escapes: a message may quote client input, lone surrogates included.
        return json.dumps(self.body(), ensure_ascii=True).encode("ascii")
