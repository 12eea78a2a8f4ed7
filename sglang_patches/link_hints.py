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

import dataclasses
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
# legolink: naive, plus the first k tokens of every chunk recomputed against the real context
#   (EPIC); "legolink:K" names k, "legolink" means k = DEFAULT_LEGOLINK_K.
# legolink0: chunks compiled behind SINK_TOKENS copies of a sink token (the model's BOS) whose
#   KV is dropped, so no chunk starts with an attention sink; only the question is computed.
# cacheblend: layers 0 and 1 on every token, then only the fraction r of chunk tokens whose
#   layer-1 V deviates most from the cache (plus the question) in later layers (CacheBlend);
#   "cacheblend:R" names r, "cacheblend" means r = DEFAULT_CACHEBLEND_RATIO.
# cacherepair: naive, plus a learned residual on every chunk token's K and V (CacheRepair); needs
#   a checkpoint trained for the served model (picrag serve --repair-checkpoint).
POLICIES = ("full", "prefix", "naive", "legolink", "legolink0", "cacheblend", "cacherepair")
CHUNK_POLICIES = ("naive", "legolink", "legolink0", "cacheblend", "cacherepair")
SINK_TOKENS = 3
DEFAULT_LEGOLINK_K = 16
DEFAULT_CACHEBLEND_RATIO = 0.15
REORDERED_LAYOUT = "legolink"


def split_policy(name: str) -> tuple[str, float]:
    """'legolink:4' -> ('legolink', 4); 'cacheblend:0.3' -> ('cacheblend', 0.3); other names
    -> (name, 0); unknown names raise."""
    base, _, arg = name.partition(":")
    if base not in POLICIES:
        raise LinkHintError(
            f"unknown policy {name!r}; known: {', '.join(POLICIES)} (legolink:K, cacheblend:R)"
        )
    if base == "legolink":
        if not arg:
            return base, DEFAULT_LEGOLINK_K
        if not arg.isdigit():
            raise LinkHintError(f"legolink:K needs a whole number K >= 0, got {arg!r}")
        return base, int(arg)
    if base == "cacheblend":
        return base, DEFAULT_CACHEBLEND_RATIO if not arg else _ratio(arg)
    if arg:
        raise LinkHintError(f"policy {base!r} takes no parameter")
    return base, 0


def _ratio(text: str) -> float:
    try:
        ratio = float(text)
    except ValueError:
        raise LinkHintError(f"cacheblend:R needs a number 0 <= R <= 1, got {text!r}") from None
    if not 0.0 <= ratio <= 1.0:
        raise LinkHintError(f"cacheblend:R needs a number 0 <= R <= 1, got {text!r}")
    return ratio


class LinkHintError(ValueError):
    pass


@dataclass(frozen=True)
class LinkRequest:
    policy: str
    chunks: tuple[tuple[int, int], ...] = ()
    compile: bool = False
    k: int = 0  # legolink: tokens recomputed at the head of every chunk
    layout: str = "original"  # "legolink": input_ids arrive reordered (sglang_patches.legolink_layout)
    sink_token: Optional[int] = None  # legolink0: the token compiled SINK_TOKENS times before each chunk
    ratio: float = 0.0  # cacheblend: fraction of chunk tokens recomputed after the check layer

    @classmethod
    def of(cls, policy: str, chunks, sink_token: Optional[int] = None) -> LinkRequest:
        base, param = split_policy(policy)
        return cls(
            policy=base, chunks=tuple((int(s), int(e)) for s, e in chunks),
            k=int(param) if base == "legolink" else 0,
            ratio=float(param) if base == "cacheblend" else 0.0,
            sink_token=sink_token if base == "legolink0" else None,
        )

    def stored_chunk(self, chunk_tokens: list[int]) -> list[int]:
        """The tokens a chunk is compiled and stored as under this policy."""
        if self.policy == "legolink0":
            return [self.sink_token] * SINK_TOKENS + list(chunk_tokens)
        return list(chunk_tokens)

    def validate(self, prompt_len: int) -> None:
        if self.policy not in POLICIES:
            raise LinkHintError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        previous_end = 0
        for start, end in self.chunks:
            if not (0 <= start < end <= prompt_len):
                raise LinkHintError(f"chunk span [{start}, {end}) outside the prompt of {prompt_len} tokens")
            if start < previous_end:
                raise LinkHintError(f"chunk spans overlap or are unordered at [{start}, {end})")
            if self.policy == "legolink" and previous_end and start != previous_end:
                raise LinkHintError("legolink needs back-to-back chunk spans (no tokens between chunks)")
            previous_end = end
        if self.k < 0:
            raise LinkHintError(f"legolink k must be >= 0, got {self.k}")
        if not 0.0 <= self.ratio <= 1.0:
            raise LinkHintError(f"cacheblend ratio must be within [0, 1], got {self.ratio}")
        if self.policy == "legolink0" and self.sink_token is None:
            raise LinkHintError("legolink0 needs a sink_token (the frontend fills in the model's BOS)")


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
            policy, param = split_policy(str(payload.get("policy", "naive")))
            try:
                chunks = tuple((int(s), int(e)) for s, e in payload.get("chunks", ()))
                k = int(payload.get("k", param if policy == "legolink" else 0))
                ratio = float(payload.get("ratio", param if policy == "cacheblend" else 0.0))
            except (TypeError, ValueError) as exc:
                raise LinkHintError(f"malformed chunk spans, k or ratio: {exc}") from exc
            sink = payload.get("sink_token")
            return LinkRequest(
                policy=policy, chunks=chunks, k=k, ratio=ratio,
                layout=str(payload.get("layout", "original")),
                sink_token=int(sink) if isinstance(sink, int) else None,
            )
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
    """Hints for a prompt in its original order; `policy` may be 'legolink:K'."""
    link = LinkRequest.of(policy, chunks)
    return hints_of(link)


def hints_of(link: LinkRequest) -> dict:
    payload = {"policy": link.policy, "chunks": [list(c) for c in link.chunks]}
    if link.policy == "legolink":
        payload["k"] = link.k
    if link.policy == "cacheblend":
        payload["ratio"] = link.ratio
    if link.layout != "original":
        payload["layout"] = link.layout
    if link.sink_token is not None:
        payload["sink_token"] = link.sink_token
    return _envelope(LINK_ACTION, payload)


def runtime_request(input_ids: list[int], link: LinkRequest) -> tuple[list[int], dict]:
    """The input_ids and kv_hints the runtime gets for a prompt in its original order: LegoLink
    prompts are reordered so the tokens it recomputes form the extend (legolink_layout)."""
    if link.policy != "legolink" or not link.chunks:
        return input_ids, hints_of(link)
    from sglang_patches.legolink_layout import legolink_layout

    layout = legolink_layout(len(input_ids), list(link.chunks), link.k)
    reordered = dataclasses.replace(link, layout=REORDERED_LAYOUT)
    return layout.reorder(input_ids), hints_of(reordered)


def compile_hints() -> dict:
    return _envelope(COMPILE_ACTION, {})
