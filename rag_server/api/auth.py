"""Who may call what: an optional API key on every route but `/health`, and admin routes.

Admin routes (`ADMIN_PATHS`) act on every client's requests and on the shared cache. With an
admin key (`picrag serve --admin-api-key`) they need it, presented like the API key (SGLang's
own admin key is sent as `Authorization: Bearer KEY`); an API key is refused there (403). Without
one they are open only to clients on the loopback interface that no proxy forwarded (the
operator's machine: scripts, tests, `picrag bench load`); anyone else gets 403. The admin key
also opens every other route.

Plain ASGI rather than an HTTP middleware, which would wrap (and buffer the disconnect
handling of) every streamed response. Keys are compared in constant time and never logged;
they are accepted only in headers, never in the query string, which ends up in access logs.
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi.responses import JSONResponse

from rag_server.api.page import PAGE_PATHS

API_KEY_ENV = "PICRAG_API_KEY"
ADMIN_API_KEY_ENV = "PICRAG_ADMIN_API_KEY"
# Liveness probes (load balancers, `picrag serve`'s own start-up wait) carry no credentials, nor
# does a browser opening the page, whose files hold no data (its calls carry the key).
OPEN_PATHS = frozenset({"/health", *PAGE_PATHS})
# The routes SGLang 0.5.23 marks admin (`@auth_level(AuthLevel.ADMIN_OPTIONAL)`) that the frontend
# serves; it serves none of SGLang's other admin routes.
ADMIN_PATHS = frozenset({"/flush_cache", "/abort_request"})
# Headers a reverse proxy adds: a request carrying one came from somewhere else.
_PROXY_HEADERS = (b"forwarded", b"x-forwarded-for", b"x-real-ip")


def presented_key(headers: dict[bytes, bytes]) -> bytes | None:
    """The key from `Authorization: Bearer KEY` or `X-API-Key: KEY`, if either is there."""
    authorization = headers.get(b"authorization", b"")
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return token.strip()
    return headers.get(b"x-api-key") or None


def is_local(scope, headers: dict[bytes, bytes]) -> bool:
    """The client is on this machine's loopback interface and no proxy forwarded its request."""
    client = scope.get("client")
    if not client or any(h in headers for h in _PROXY_HEADERS):
        return False
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


def _matches(key: bytes | None, expected: bytes | None) -> bool:
    return key is not None and expected is not None and hmac.compare_digest(key, expected)


def _refusal(status: int, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"detail": message}, status, headers=headers)


class AccessGuard:
    def __init__(self, app, api_key: str | None = None, admin_api_key: str | None = None):
        if api_key == "" or admin_api_key == "":
            raise ValueError("empty API key")
        if api_key is not None and api_key == admin_api_key:
            raise ValueError("the admin key must differ from the API key")
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._admin_key = admin_api_key.encode() if admin_api_key else None

    def __repr__(self) -> str:  # never the keys, e.g. in a traceback's locals
        return "AccessGuard(<keys>)"

    def refusal(self, scope) -> JSONResponse | None:
        """Why this request may not go on, as the answer to give; None when it may."""
        path = scope["path"]
        if path in OPEN_PATHS:
            return None
        headers = dict(scope["headers"])
        key = presented_key(headers)
        if _matches(key, self._admin_key):
            return None
        if path in ADMIN_PATHS:
            if self._admin_key is not None:
                if _matches(key, self._key):
                    return _refusal(403, "an admin route: the API key does not open it, the admin key does")
                return _refusal(401, "an admin route: missing or wrong admin key "
                                "(Authorization: Bearer KEY or X-API-Key: KEY)")
            if not is_local(scope, headers):
                return _refusal(403, "an admin route: open only to loopback clients on a server "
                                "without an admin key (picrag serve --admin-api-key)")
        if self._key is not None and not _matches(key, self._key):
            return _refusal(401, "missing or wrong API key (Authorization: Bearer KEY or X-API-Key: KEY)")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refused = self.refusal(scope)
            if refused is not None:
                return await refused(scope, receive, send)
        await self.app(scope, receive, send)
