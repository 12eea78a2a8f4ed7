"""The `picrag` field of a chat, completions or `/generate` body that is not a RAG request: the
client's say over chunk discovery (rag_server/service/prompt_discovery.py), never forwarded.

    "picrag": {"discover": false}                        SGLang's own route, prefix cache only
    "picrag": {"discover": true, "policy": "naive"}      discovered, linked with that policy
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from rag_server.api.rag_api import PolicyName
from rag_server.service.prompt_discovery import CONTROL_FIELD, DiscoveredPrompt, DiscoveryControl

# Every route's response to a discovered prompt carries it: "chunks=4; chunk_tokens=1957".
DISCOVERED_HEADER = "x-picrag-discovered"


class ControlBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    discover: bool = True
    policy: Optional[PolicyName] = None


def is_control(value: Any) -> bool:
    """A chat body's `picrag` field is a discovery control, not the RAG extension, when it names `discover`."""
    return isinstance(value, dict) and "discover" in value


def control_of(payload: dict[str, Any]) -> tuple[DiscoveryControl, Optional[str]]:
    """The body's control (the default where it has none), or why its `picrag` field is refused."""
    value = payload.get(CONTROL_FIELD)
    if value is None:
        return DiscoveryControl(), None
    try:
        body = ControlBody.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in (CONTROL_FIELD, *error["loc"]))
        return DiscoveryControl(), f"{where}: {error['msg'].removeprefix('Value error, ')}"
    return DiscoveryControl(body.discover, body.policy), None


def without_control(payload: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in payload.items() if key != CONTROL_FIELD}


def header_of(found: DiscoveredPrompt) -> dict[str, str]:
    return {DISCOVERED_HEADER: f"chunks={len(found.found.chunks)}; chunk_tokens={found.found.chunk_tokens}"}
