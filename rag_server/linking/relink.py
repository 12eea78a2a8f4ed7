"""Link again when a compiled chunk was evicted before its link ran.

Compile and link are two requests, so under memory pressure a chunk compiled for a prompt can
be evicted before the link arrives (and a compile skipped because the frontend compiled the
chunk earlier finds it gone). The engine then computes the chunk as ordinary tokens: correct
attention, but not the policy asked for, and an answer that differs from the same request on a
quiet server. The link's first response already reports its chunk misses (`meta_info`), so
such a response is dropped before anything reaches the client (dropping a stream aborts the
request in the runtime), the chunks are compiled again, and the link is sent again, at most
MAX_RELINKS times; the last attempt is answered as it is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Optional

from rag_server.linking import sse

MAX_RELINKS = 3


def chunk_misses(meta_info: Optional[dict[str, Any]]) -> int:
    details = (meta_info or {}).get("cached_tokens_details") or {}
    return int(details.get("picrag_chunk_misses", 0) or 0)


def response_misses(body: bytes) -> int:
    """Chunk misses reported by a non-streamed /generate answer (one object or a list)."""
    try:
        data = json.loads(body)
    except ValueError:
        return 0
    outputs = data if isinstance(data, list) else [data]
    return sum(chunk_misses(out.get("meta_info")) for out in outputs if isinstance(out, dict))


async def first_event(chunks: AsyncIterator[bytes]) -> tuple[bytes, Optional[dict[str, Any]]]:
    """Read a server-sent-event stream up to its first `data:` event: (the bytes read, that
    event's JSON, or None when the stream ended or the event is not JSON)."""
    buffered = b""
    async for chunk in chunks:
        buffered += chunk
        complete, separator, _ = buffered.rpartition(b"\n\n")
        for line in complete.decode(errors="replace").split("\n") if separator else ():
            data = sse.data_of(line)
            if data is not None:
                try:
                    return buffered, json.loads(data)
                except ValueError:
                    return buffered, None
    return buffered, None
