"""The bounds a server enforces, and a request-body reader that keeps to them."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ApiError

# OpenAI accepts at most four stop sequences; each is held back while it may be forming,
# so a long one would delay every piece of streamed text by its length.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class Limits:
    """What one server takes on at once. Requests past a bound are refused, never left to pile up."""

    max_batch: int = 8  # sequences decoding together
    max_queue: int = 64  # requests waiting for a place in the batch; one more gets 429
    max_body_bytes: int = 1 << 20  # a request body larger than this gets 413

    def __post_init__(self):
        problems = [f"{name} must be >= 1, got {getattr(self, name)}"
                    for name in ("max_batch", "max_body_bytes") if getattr(self, name) < 1]
        if self.max_queue < 0:
            problems.append(f"max_queue must be >= 0, got {self.max_queue}")
        if problems:
            raise ValueError("invalid server limits: " + "; ".join(problems))


async def read_body(request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes: from its
    Content-Length when one is sent, else while it streams in (chunked uploads)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise ApiError(400, f"invalid Content-Length header: {declared[:40]!r}")
        if len(declared) > 18 or int(declared) > limit:  # 18 digits: no huge-int parse
            raise ApiError(413, f"the request body is {declared[:24]} bytes; this server takes at most {limit}",
                           code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)
