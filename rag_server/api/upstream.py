"""The frontend's HTTP client to the runtime, with a bound on every call.

Three limits, so that a hung runtime cannot hold admission slots forever:
- connect: opening a connection to the runtime;
- first byte: the longest wait for any byte of the answer, the first one included, and so
  also the longest silence between two chunks of a stream (also used for sending the request
  and waiting for a pooled connection);
- total: the whole call, from sending the request to the last byte of the answer.
httpx bounds the first two; the total is enforced by a transport wrapper (`DeadlineTransport`),
so every caller of the client (proxy, link pipeline, chunk compiler) gets it. A limit reached
raises `httpx.TimeoutException`, which callers already handle as a failed runtime call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

# A prompt of several thousand tokens takes minutes to prefill on a small CPU, and a
# non-streamed answer's first byte comes only after its last token.
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_FIRST_BYTE_TIMEOUT_S = 600.0
DEFAULT_TOTAL_TIMEOUT_S = 3600.0
# Connections to the runtime (httpx's default); a request waiting for one waits at most the
# first-byte timeout. Admission keeps the requests in flight below it by default.
MAX_CONNECTIONS = 100


@dataclass(frozen=True)
class UpstreamTimeouts:
    connect_s: float = DEFAULT_CONNECT_TIMEOUT_S
    first_byte_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S
    total_s: float = DEFAULT_TOTAL_TIMEOUT_S

    def __post_init__(self):
        if min(self.connect_s, self.first_byte_s, self.total_s) <= 0:
            raise ValueError(f"upstream timeouts must be positive: {self}")


class _DeadlineStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, deadline: float, request: httpx.Request, total_s: float):
        self._inner = inner
        self._deadline = deadline
        self._request = request
        self._total_s = total_s

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = aiter(self._inner)
        while True:
            try:
                # Each read bounded on its own: a timeout scope must not span the yield.
                async with asyncio.timeout_at(self._deadline):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise _total_timeout(self._request, self._total_s) from None
            except httpx.TimeoutException as exc:
                raise _explained(exc, self._request) from exc
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def _total_timeout(request: httpx.Request, total_s: float) -> httpx.ReadTimeout:
    return httpx.ReadTimeout(f"timeout: the runtime did not finish within {total_s:g} s", request=request)


# httpx's timeouts often carry no message: which bound ran out, in words.
_BOUNDS: dict[type[httpx.TimeoutException], tuple[str, str]] = {
    httpx.ConnectTimeout: ("connect", "could not connect to the runtime"),
    httpx.ReadTimeout: ("read", "no byte from the runtime"),
    httpx.WriteTimeout: ("write", "could not send the request to the runtime"),
    httpx.PoolTimeout: ("pool", "no free connection to the runtime"),
}


def _explained(exc: httpx.TimeoutException, request: httpx.Request) -> httpx.TimeoutException:
    key, what = _BOUNDS.get(type(exc), ("", "the runtime timed out"))
    seconds = request.extensions.get("timeout", {}).get(key)
    within = f" within {seconds:g} s" if isinstance(seconds, (int, float)) else ""
    return type(exc)(f"timeout: {what}{within}", request=request)


class DeadlineTransport(httpx.AsyncBaseTransport):
    """`inner`, with every request and its response body bounded by `total_s` together."""

    def __init__(self, inner: httpx.AsyncBaseTransport, total_s: float):
        self._inner = inner
        self._total_s = total_s

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        deadline = asyncio.get_running_loop().time() + self._total_s
        try:
            async with asyncio.timeout_at(deadline):
                response = await self._inner.handle_async_request(request)
        except TimeoutError:
            raise _total_timeout(request, self._total_s) from None
        except httpx.TimeoutException as exc:
            raise _explained(exc, request) from exc
        response.stream = _DeadlineStream(response.stream, deadline, request, self._total_s)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def runtime_client(base_url: str, timeouts: UpstreamTimeouts) -> httpx.AsyncClient:
    """A client to the runtime at `base_url` whose every call is bounded by `timeouts`."""
    limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS)
    return httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(timeouts.first_byte_s, connect=timeouts.connect_s),
        transport=DeadlineTransport(httpx.AsyncHTTPTransport(limits=limits), timeouts.total_s),
    )
