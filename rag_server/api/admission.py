"""Admission control: a bounded number of requests in flight, a small queue, 503 beyond.

Every admitted request holds memory in the frontend and the runtime (prompt, KV, streamed
output) until its response ends, so past `max_inflight` running and `max_queue` waiting the
frontend answers 503 with `Retry-After` at once instead of letting memory grow with the
offered load. Plain ASGI, so a streamed response keeps its slot until its last byte (or the
client's disconnect, or rag_server/api/client_timeouts.py giving up on it) and no response is
buffered.

A request is one slot; one that asks the runtime for several sequences (`n`, a batch of
prompts) takes one slot per sequence once its body is parsed (`take_sequences`): those are as
many requests in the scheduler. The extra slots are taken at once or not at all (then 503), so
that two such requests never wait for each other's slots.
"""

from __future__ import annotations

import asyncio
from collections import deque

from fastapi import Request
from fastapi.responses import JSONResponse

DEFAULT_MAX_INFLIGHT = 64
DEFAULT_MAX_QUEUE = 16
RETRY_AFTER_S = 1
# Probes and monitoring must still answer when the server is saturated: that is when they matter.
UNLIMITED_PATHS = frozenset({"/health", "/metrics"})
_TICKET = "admission"  # the request's Ticket in request.state


class Slots:
    """`capacity` slots: one at a time in arrival order (`take_one`), or several only when free now."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free = capacity
        self._waiting: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def take_one(self) -> None:
        if self.free and not self._waiting:
            self.free -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give(1)  # handed a slot just as the request went away
            else:
                self._waiting.remove(turn)
            raise

    def try_take(self, count: int) -> bool:
        if count > self.free:
            return False
        self.free -= count
        return True

    def give(self, count: int) -> None:
        self.free += count
        while self.free and self._waiting:
            turn = self._waiting.popleft()
            self.free -= 1
            turn.set_result(None)


class Ticket:
    """The slots one admitted request holds."""

    def __init__(self, slots: Slots):
        self.slots = slots
        self.held = 1

    def take(self, sequences: int) -> bool:
        """Hold one slot per sequence; False when the slots are not free now."""
        extra = sequences - self.held
        if extra <= 0:
            return True
        if not self.slots.try_take(extra):
            return False
        self.held += extra
        return True


def busy_response(retry_after_s: int = RETRY_AFTER_S, detail: str = "server busy: too many requests in flight, "
                  "retry later") -> JSONResponse:
    return JSONResponse({"detail": detail}, 503, headers={"Retry-After": str(retry_after_s)})


def take_sequences(request: Request, sequences: int, field: str) -> JSONResponse | None:
    """Count a request's `sequences` against --max-inflight: None once its slots are held, else
    the answer (400: more than the server ever runs at once; 503: not free now)."""
    ticket: Ticket | None = getattr(request.state, _TICKET, None)
    if ticket is None:  # an app without admission control
        return None
    if sequences > ticket.slots.capacity:
        return JSONResponse({"error": {"message": f"{field}: {sequences} sequences, over the {ticket.slots.capacity} "
                                       "this server runs at once (--max-inflight)", "type": "invalid_request"}}, 400)
    if not ticket.take(sequences):
        return busy_response(detail=f"server busy: no {sequences} free slots for {field}, retry later")
    return None


class Admission:
    def __init__(self, app, max_inflight: int = DEFAULT_MAX_INFLIGHT, max_queue: int = DEFAULT_MAX_QUEUE,
                 retry_after_s: int = RETRY_AFTER_S):
        if max_inflight < 1 or max_queue < 0:
            raise ValueError(f"need max_inflight >= 1 and max_queue >= 0, not {max_inflight}, {max_queue}")
        self.app = app
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.slots = Slots(max_inflight)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            return await self.app(scope, receive, send)
        if not self.slots.free and self.slots.waiting >= self.max_queue:
            return await busy_response(self.retry_after_s)(scope, receive, send)
        await self.slots.take_one()
        ticket = Ticket(self.slots)
        scope.setdefault("state", {})[_TICKET] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            self.slots.give(ticket.held)
