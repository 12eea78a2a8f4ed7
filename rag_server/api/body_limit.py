"""Refuse oversized request bodies on every route, before the app reads them.

A body announced by Content-Length over the route's limit is refused unread. A body without
one (`Transfer-Encoding: chunked`) is read here up to the limit and refused as soon as it goes
over, so the rest is never read; a body within the limit is handed to the app as one message.
pydantic and the routes then limit the fields.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi.responses import JSONResponse

# A /generate prompt at the largest context window of any preset is well under 2 MiB as JSON
# token ids; a batch of prompts or a long chat still fits.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


class BodyLimit:
    """413 for a body over `max_bytes`, or over the limit of the first of `prefix_limits`
    (path prefix -> bytes) its path starts with, whichever is lower.

    Plain ASGI rather than an HTTP middleware, which would wrap every streamed response."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES, prefix_limits: Mapping[str, int] | None = None):
        if max_bytes < 1:
            raise ValueError(f"body limit must be positive, not {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.prefix_limits = dict(prefix_limits or {})

    def limit_of(self, path: str) -> int:
        for prefix, limit in self.prefix_limits.items():
            if path.startswith(prefix):
                return min(limit, self.max_bytes)
        return self.max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_of(scope["path"])
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:  # the server holds the client to it
            if length.isdigit() and int(length) > limit:
                return await _too_large(limit)(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                first = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await _too_large(limit)(scope, receive, send)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        await self.app(scope, _replay(first, receive), send)


def _too_large(limit: int) -> JSONResponse:
    # Closing the connection stops the rest of the body, which the server would otherwise read
    # (and drop) to find the next request on the connection.
    return JSONResponse({"detail": f"request body over {limit} bytes"}, 413, headers={"Connection": "close"})


def _replay(first: dict, receive):
    """`receive` that answers `first`, then what the server sends (a disconnect)."""
    pending = [first]

    async def replayed() -> dict:
        return pending.pop() if pending else await receive()

    return replayed
