"""Optional API key on every route but `/health`.

Plain ASGI rather than an HTTP middleware, which would wrap (and buffer the disconnect
handling of) every streamed response. The key is compared in constant time and never logged;
it is accepted only in headers, never in the query string, which ends up in access logs.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

API_KEY_ENV = "PICRAG_API_KEY"
# Liveness probes (load balancers, `picrag serve`'s own start-up wait) carry no credentials.
OPEN_PATHS = frozenset({"/health"})


def presented_key(headers: dict[bytes, bytes]) -> bytes | None:
    """The key from `Authorization: Bearer KEY` or `X-API-Key: KEY`, if either is there."""
    authorization = headers.get(b"authorization", b"")
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return token.strip()
    return headers.get(b"x-api-key") or None


class ApiKeyGuard:
    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("empty API key")
        self.app = app
        self._key = api_key.encode()

    def __repr__(self) -> str:  # never the key, e.g. in a traceback's locals
        return "ApiKeyGuard(<key>)"

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            key = presented_key(dict(scope["headers"]))
            if key is None or not hmac.compare_digest(key, self._key):
                response = JSONResponse(
                    {"detail": "missing or wrong API key (Authorization: Bearer KEY or X-API-Key: KEY)"},
                    401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
