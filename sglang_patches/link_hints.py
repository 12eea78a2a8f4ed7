"""The wire format that carries chunk boundaries and the link policy to SGLang's scheduler.

picrag rides SGLang 0.5.23's per-request KV-hint envelope (`kv_hints` on `/generate`, typed
and versioned actions, delivered to the tree cache as `req.kv_hints`). Two action types:

``picrag.link`` (version "1"): this prompt holds reusable chunks::

    {"action_id": "link", "action_type": "picrag.link", "action_version": "1",
     "payload": {"policy": "naive", "chunks": [[start, end], ...]}}

  ``chunks`` are token spans of ``input_ids``, ascending and disjoint; ``policy`` is one of
  POLICIES. Tokens outside chunks (system prompt, question) are ordinary tokens.

``picrag.compile`` (version "1"): the whole prompt is one chunk to compute alone at positions
0..n-1 and store in the chunk cache (send it with ``max_new_tokens`` 0 or 1).

A request without picrag actions behaves exactly like vanilla SGLang.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Optional

LINK_ACTION = "picrag.link"
COMPILE_ACTION = "picrag.compile"
ACTION_VERSION = "1"
PROTOCOL_VERSION = "1"

# full: nothing reused, nothing stored (the quality baseline).
# prefix: SGLang's own exact-prefix radix cache.
# naive: every chunk's cached KV re-positioned and reused; only the non-chunk tail is computed.
POLICIES = ("full", "prefix", "naive")
CHUNK_POLICIES = ("naive",)


class LinkHintError(ValueError):
    pass


@dataclass(frozen=True)
class LinkRequest:
    policy: str
    chunks: tuple[tuple[int, int], ...] = ()
    compile: bool = False

    def validate(self, prompt_len: int) -> None:
        if self.policy not in POLICIES:
            raise LinkHintError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        previous_end = 0
        for start, end in self.chunks:
            if not (0 <= start < end <= prompt_len):
                raise LinkHintError(f"chunk span [{start}, {end}) outside the prompt of {prompt_len} tokens")
            if start < previous_end:
                raise LinkHintError(f"chunk spans overlap or are unordered at [{start}, {end})")
            previous_end = end


def _field(obj: Any, name: str) -> Any:
    # The scheduler holds SGLang's typed msgspec envelope; the frontend holds plain JSON.
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def parse_link_request(kv_hints: Any) -> Optional[LinkRequest]:
    """The picrag action of a request's KV-hint envelope, or None for a vanilla request."""
    if kv_hints is None:
        return None
    actions = _field(kv_hints, "actions") or ()
    if not isinstance(actions, (list, tuple)):
        raise LinkHintError("kv_hints.actions must be a list")
    for action in actions:
        action_type = _field(action, "action_type")
        if action_type == COMPILE_ACTION:
            return LinkRequest(policy="naive", compile=True)
        if action_type == LINK_ACTION:
            version = _field(action, "action_version")
            if version != ACTION_VERSION:
                raise LinkHintError(
                    f"{LINK_ACTION} version {version!r} not supported (want {ACTION_VERSION!r})"
                )
            payload = _field(action, "payload") or {}
            if not isinstance(payload, dict):
                raise LinkHintError(f"{LINK_ACTION} payload must be an object")
            try:
                chunks = tuple((int(s), int(e)) for s, e in payload.get("chunks", ()))
            except (TypeError, ValueError) as exc:
                raise LinkHintError(f"malformed chunk spans: {exc}") from exc
            return LinkRequest(policy=str(payload.get("policy", "naive")), chunks=chunks)
    return None


def _envelope(action_type: str, payload: dict) -> dict:
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": uuid.uuid4().hex,
        "actions": [
            {"action_id": action_type.split(".")[-1], "action_type": action_type,
             "action_version": ACTION_VERSION, "payload": payload}
        ],
    }


def link_hints(policy: str, chunks: list[tuple[int, int]]) -> dict:
    return _envelope(LINK_ACTION, {"policy": policy, "chunks": [list(c) for c in chunks]})


def compile_hints() -> dict:
    return _envelope(COMPILE_ACTION, {})
