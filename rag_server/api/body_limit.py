"""Refuse oversized request bodies before reading them (pydantic then limits the fields)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class BodyLimit:
    """413 for a body over `max_bytes` under `prefix`, as its Content-Length announces.

    Plain ASGI rather than an HTTP middleware, which would wrap every streamed response."""

    def __init__(self, app, prefix: str, max_bytes: int):
        self.app = app
        self.prefix = prefix
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            length = dict(scope["headers"]).get(b"content-length", b"0")
            if length.isdigit() and int(length) > self.max_bytes:
                response = JSONResponse({"detail": f"request body over {self.max_bytes} bytes"}, 413)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
