"""The server-sent events SGLang's streaming /generate answers with: `data: {json}` lines, ended
by `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any, Optional

DONE = "[DONE]"


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
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode(errors="replace")
    if pending:
        yield pending.rstrip(b"\r").decode(errors="replace")
