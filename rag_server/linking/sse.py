"""The server-sent events SGLang's streaming /generate answers with: `data: {json}` lines, ended
by `data: [DONE]`.

A stream is read as it arrives, in time linear in its size (`Splitter`), and no event may grow
past MAX_EVENT_BYTES: a runtime that sends one is answered as a failed stream (`EventTooLarge`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any, Optional

import httpx

DONE = "[DONE]"
# The largest event of a relayed stream. SGLang's events repeat the text so far (and its
# logprobs when asked): a whole context window of 20 top logprobs a token stays well below.
MAX_EVENT_BYTES = 16 * 1024 * 1024


class EventTooLarge(httpx.DecodingError):
    """An event (or line) of the runtime's stream over MAX_EVENT_BYTES: a stream that cannot be read."""


class Splitter:
    """A byte stream split at `separator` as it arrives: each byte is searched and copied a
    bounded number of times, however the stream is cut into chunks."""

    def __init__(self, separator: bytes, max_bytes: int = MAX_EVENT_BYTES):
        self._separator = separator
        self._max_bytes = max_bytes
        self._pending = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        """What `chunk` completes: the bytes up to and including the last separator (b"" when none)."""
        # A separator may straddle the previous chunk's end, never lie earlier in what is pending.
        start = max(len(self._pending) - len(self._separator) + 1, 0)
        self._pending += chunk
        end = self._pending.rfind(self._separator, start)
        complete = b""
        if end >= 0:
            # Only the first piece this chunk completes began before it (a chunk is far below the cap).
            self._check(self._pending.find(self._separator, start))
            cut = end + len(self._separator)
            complete = bytes(self._pending[:cut])
            del self._pending[:cut]
        self._check(len(self._pending))
        return complete

    def _check(self, length: int) -> None:
        if length > self._max_bytes:
            raise EventTooLarge(f"the runtime sent an event over {self._max_bytes} bytes")

    def rest(self) -> bytes:
        """What came after the last separator."""
        return bytes(self._pending)


def data_of(line: str) -> Optional[str]:
    """The payload of a `data:` line, stripped; None for any other line."""
    return line[len("data:"):].strip() if line.startswith("data:") else None


def events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        data = data_of(line)
        if data == DONE:
            return
        if data is not None:
            yield json.loads(data)


async def aevents(lines: AsyncIterable[str]) -> AsyncIterator[dict[str, Any]]:
    async for line in lines:
        data = data_of(line)
        if data == DONE:
            return
        if data is not None:
            yield json.loads(data)


async def alines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The lines of a byte stream (a raw response body), without their line ends."""
    lines = Splitter(b"\n")
    async for chunk in chunks:
        for line in lines.feed(chunk).split(b"\n")[:-1]:
            yield line.rstrip(b"\r").decode(errors="replace")
    if rest := lines.rest():
        yield rest.rstrip(b"\r").decode(errors="replace")
