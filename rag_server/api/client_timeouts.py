"""A slow client cannot hold an admission slot: it may leave the server waiting at most
`idle_timeout_s` for the next piece of its request body, or for room to send it the next piece
of its answer.

An admitted request holds its slot until its response ends (rag_server/api/admission.py), and
uvicorn bounds neither a body that trickles in nor a response the client stops reading (a write
then waits for the socket to drain, for ever). Past the timeout, a request whose body stalled
gets 408 and its connection closed; an answer the client stopped reading is dropped and its
connection closed (closing the runtime's stream, so SGLang aborts the request). Either way its
slot is free again. Waiting for a disconnect after the body was read is not bounded: that is
how a streamed response notices a client that left.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import HTTPException
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

DEFAULT_CLIENT_IDLE_TIMEOUT_S = 60.0


class ClientTooSlow(Exception):
    """The client stopped reading its answer for longer than the idle timeout."""


class BodyTooSlow(HTTPException):
    """No request body bytes for longer than the idle timeout. An HTTPException, so that the
    route reading the body (FastAPI's own body parsing too) answers 408 with it."""

    def __init__(self, idle_timeout_s: float):
        super().__init__(408, f"no request body bytes for {idle_timeout_s:g} s", headers={"Connection": "close"})


class ClientTimeouts:
    """Plain ASGI (an HTTP middleware would buffer streamed responses)."""

    def __init__(self, app, idle_timeout_s: float = DEFAULT_CLIENT_IDLE_TIMEOUT_S):
        if idle_timeout_s <= 0:
            raise ValueError(f"client idle timeout must be positive, not {idle_timeout_s}")
        self.app = app
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_read = False
        response_started = False

        async def timed_receive() -> dict:
            nonlocal body_read
            if body_read:
                return await receive()
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    message = await receive()
            except TimeoutError:
                raise BodyTooSlow(self.idle_timeout_s) from None
            body_read = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def timed_send(message: dict) -> None:
            nonlocal response_started
            response_started = True
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    await send(message)
            except TimeoutError:
                raise ClientTooSlow(f"the client read nothing for {self.idle_timeout_s:g} s") from None

        try:
            await self.app(scope, timed_receive, timed_send)
        except (ClientTooSlow, BodyTooSlow) as exc:
            logger.warning("%s %s: %s: connection closed", scope["method"], scope["path"], exc)
            if not response_started:  # the body stalled where no route reads it (rag_server/api/body_limit.py)
                # uvicorn closes the connection after a response with `Connection: close`, and
                # one cut off mid-response (the app returned without ending it) as well.
                refusal = JSONResponse({"detail": getattr(exc, "detail", str(exc))}, 408, headers={"Connection": "close"})
                await refusal(scope, receive, send)
