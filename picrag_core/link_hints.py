"""The wire format that carries chunk boundaries and the link policy to SGLang's scheduler.

picrag rides SGLang 0.5.23's per-request KV-hint envelope (`kv_hints` on `/generate`, typed
and versioned actions, delivered to the tree cache as `req.kv_hints`). Two action types:

``picrag.link`` (version "1"): this prompt holds reusable chunks::

    {"action_id": "link", "action_type": "picrag.link", "action_version": "1",
     "payload": {"policy": "naive", "chunks": [[start, end], ...]}}

  ``chunks`` are token spans of ``input_ids``, ascending and disjoint; ``policy`` names a family
  of picrag_core.policies (or a whole policy name, "legolink:4"). Its parameter travels as
  ``k`` or ``ratio`` (the selecting families carry both), a prompt reordered by
  `runtime_request` carries ``"layout": "legolink"``, families that store chunks behind sinks
  carry ``sink_token`` (the model's BOS), and the selecting families carry the prompt positions
  they recompute beyond the first k of every chunk as ``"recompute": [[start, end], ...]``
  (original order, each run inside a chunk). Tokens
  outside chunks (system prompt, question) are ordinary tokens. Any other field, or a field of
  the wrong type, is refused. ``"on_miss": "refuse"`` asks the engine to answer at once, with
  no compute, when a chunk is not in the store as the request arrives (`MISS_REFUSAL`): the
  frontend then compiles it again and relinks, and no prefill is thrown away. Without it a
  missing chunk is computed as ordinary tokens. ``"context_attention": true`` asks for the
  attention the question pays to every prompt position (sglang_patches.steps.context_attention), from
  which the frontend picks what a selecting family recomputes. ``"tail": [id, ...]`` (at most
  `MAX_TAIL_TOKENS`) are tokens the last chunk is compiled and stored with after it that the
  prompt does not hold there: a passage found last in a prompt, where the blank line that ends
  every other passage is missing, is then the same stored chunk as in any other position. Its
  own tokens' KV comes from that chunk's causal prefix (the tail is never grafted).
  ``"span_logprobs": K`` (1 to `MAX_SPAN_POSITIONS`) asks for the next token's log-probabilities
  over the whole vocabulary after each of the prompt's last K positions, all after the last
  chunk (sglang_patches.steps.span_report): sent with an answer's first K - 1 tokens at the end
  of the prompt, one request measures a policy teacher-forced on that answer.

``picrag.compile`` (version "1", empty payload): the whole prompt is one chunk to compute alone
at positions 0..n-1 and store in the chunk cache (send it with ``max_new_tokens`` 0 or 1).

A request carries at most one picrag action. A request without one behaves exactly like
vanilla SGLang.
"""

from __future__ import annotations

import bisect
import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from picrag_core.policies import (K, POLICY_FAMILIES, RATIO, ParamKind, Policy, PolicyError, PolicyFamily,
                                     parse_policy)

LINK_ACTION = "picrag.link"
COMPILE_ACTION = "picrag.compile"
ACTION_VERSION = "1"
PROTOCOL_VERSION = "1"
ORIGINAL_LAYOUT = "original"
# The value of "layout" for a prompt sent reordered (families with reordered_layout: LegoLink's order first).
REORDERED_LAYOUT = "legolink"
LINK_FIELDS = ("policy", "chunks", K.name, RATIO.name, "layout", "sink_token", "on_miss", "first_token_logprobs",
               "recompute", "context_attention", "tail", "span_logprobs")
ON_MISS_COMPUTE = "compute"
ON_MISS_REFUSE = "refuse"
# The start of the engine's answer to an `on_miss: refuse` link whose chunks are not all stored
# (SGLang's abort finish reason, status MISS_REFUSAL_STATUS); the frontend relinks on it.
MISS_REFUSAL = "picrag: chunks not in the store"
MISS_REFUSAL_STATUS = 409
# The longest tail a link may name (a separator: a blank line is one to three tokens).
MAX_TAIL_TOKENS = 8
# Above every vocabulary: the engine checks a tail against its own (sglang_patches.guard.request_guard).
MAX_TOKEN_ID = 1 << 31
# The most prompt positions one link may ask the full distribution of (`span_logprobs`): 64 rows
# of a 152k vocabulary are 39 MB of float32 in one response.
MAX_SPAN_POSITIONS = 64

# Policy errors and link-hint errors are one kind: a request the engine cannot serve as asked.
LinkHintError = PolicyError


@dataclass(frozen=True)
class LinkRequest:
    policy: str  # the family's name (a key of POLICY_FAMILIES)
    chunks: tuple[tuple[int, int], ...] = ()
    compile: bool = False
    k: int = 0  # families with param "k": tokens recomputed at the head of every chunk
    layout: str = ORIGINAL_LAYOUT  # REORDERED_LAYOUT: input_ids arrive reordered (picrag_core.reordered_layout)
    sink_token: Optional[int] = None  # families with sink_tokens: the token compiled before each chunk
    ratio: float = 0.0  # families with param "ratio": fraction of chunk tokens recomputed after the check layer
    refuse_on_miss: bool = False  # answer at once, computing nothing, if a chunk is not stored on arrival
    report_first_token: bool = False  # return the first answer token's full-vocabulary log-probabilities
    # Selecting families: prompt positions recomputed besides the first k of every chunk (original order).
    recompute: tuple[tuple[int, int], ...] = ()
    report_attention: bool = False  # return the question's attention over every prompt position
    # Families that reuse chunks: tokens the last chunk is stored with after it (module docstring).
    tail: tuple[int, ...] = ()
    # Return the next token's full-vocabulary log-probabilities after each of the prompt's last
    # this many positions (0: none).
    report_span: int = 0

    @classmethod
    def of(cls, policy: Union[str, Policy], chunks, sink_token: Optional[int] = None,
           tail: tuple[int, ...] = ()) -> LinkRequest:
        """A link of `chunks` under `policy`; `sink_token` and `tail` are kept where the family
        uses them (a family that reuses no chunk stores none)."""
        if isinstance(policy, str):
            policy = parse_policy(policy)
        family = policy.family
        chunks = tuple((int(s), int(e)) for s, e in chunks)
        return cls(
            policy=family.name, chunks=chunks,
            k=int(policy.param) if family.param == K.name else policy.k,
            ratio=float(policy.param) if family.param == RATIO.name else 0.0,
            sink_token=sink_token if family.sink_tokens else None,
            tail=tuple(tail) if family.reuses_chunks and chunks else (),
        )

    def like(self, policy: Union[str, Policy]) -> LinkRequest:
        """The same chunks, stored as they are here, linked under another policy."""
        return LinkRequest.of(policy, self.chunks, self.sink_token, self.tail)

    @property
    def family(self) -> PolicyFamily:
        return POLICY_FAMILIES[self.policy]

    @property
    def policy_name(self) -> str:
        """The whole policy name: 'legolink:4', 'select:0.15,16', 'naive'."""
        family = self.family
        return family.policy(getattr(self, family.param) if family.param else None, self.k).name

    @property
    def recomputed_runs(self) -> list[tuple[int, int]]:
        """The chunk tokens a family with a reordered layout recomputes, as merged runs of the
        original prompt: the first k of every chunk, and what the link names besides."""
        from picrag_core.reordered_layout import first_k_runs, merge_runs

        return merge_runs([*first_k_runs(self.chunks, self.k), *self.recompute])

    def stored_chunk(self, chunk_tokens: list[int], last: bool = False) -> list[int]:
        """The tokens a chunk is compiled and stored as under this policy (`last`: the link's
        last chunk, stored with its tail)."""
        return [self.sink_token] * self.family.sink_tokens + list(chunk_tokens) + list(self.tail if last else ())

    def stored_chunks(self, prompt) -> list[tuple[int, ...]]:
        """Every chunk of `prompt` (in its original order) as it is stored, in order."""
        last = len(self.chunks) - 1
        return [tuple(self.stored_chunk(prompt[s:e], index == last)) for index, (s, e) in enumerate(self.chunks)]

    def validate(self, prompt_len: int) -> None:
        if self.policy not in POLICY_FAMILIES:
            raise LinkHintError(f"unknown policy {self.policy!r}; known: {', '.join(POLICY_FAMILIES)}")
        family = self.family
        previous_end = 0
        for start, end in self.chunks:
            if not (0 <= start < end <= prompt_len):
                raise LinkHintError(f"chunk span [{start}, {end}) outside the prompt of {prompt_len} tokens")
            if start < previous_end:
                raise LinkHintError(f"chunk spans overlap or are unordered at [{start}, {end})")
            if family.reordered_layout and previous_end and start != previous_end:
                raise LinkHintError(f"{self.policy} needs back-to-back chunk spans (no tokens between chunks)")
            previous_end = end
        for kind, value in ((K, self.k), (RATIO, self.ratio)):
            if not kind.holds(value):
                raise LinkHintError(f"{self.policy} {kind.name} needs {kind.requirement()}, got {value}")
        if self.report_attention and (family.blends_chunks or not family.reuses_chunks):
            raise LinkHintError(f"context_attention is for families that link stored chunks, not {self.policy}")
        if self.recompute and family.scored_as is None:
            raise LinkHintError(f"{self.policy} takes no recompute (only the selecting families do)")
        previous_end = 0
        chunk_starts = [start for start, _ in self.chunks]
        for start, end in self.recompute:
            if start < previous_end or start >= end:
                raise LinkHintError(f"recompute runs must be ascending, disjoint and non-empty, got [{start}, {end})")
            index = bisect.bisect_right(chunk_starts, start) - 1
            if index < 0 or end > self.chunks[index][1]:
                raise LinkHintError(f"recompute run [{start}, {end}) is not inside one chunk")
            previous_end = end
        # A reordered prompt runs at the positions reordered_layout gives its recomputed runs: only a
        # family that reorders, with chunks to reorder, may say so.
        if self.layout not in (ORIGINAL_LAYOUT, REORDERED_LAYOUT):
            raise LinkHintError(f"layout must be {REORDERED_LAYOUT!r} or absent, got {self.layout!r}")
        if self.layout == REORDERED_LAYOUT and not (family.reordered_layout and self.chunks):
            raise LinkHintError(f"layout {REORDERED_LAYOUT!r} is for prompts of a family that reorders "
                                f"(legolink), with chunks; not for {self.policy}")
        if family.sink_tokens and self.sink_token is None:
            raise LinkHintError(f"{self.policy} needs a sink_token (the frontend fills in the model's BOS)")
        if not family.sink_tokens and self.sink_token is not None:
            raise LinkHintError(f"{self.policy} takes no sink_token")
        if self.tail and not (family.reuses_chunks and self.chunks):
            raise LinkHintError(f"a tail is stored after the last chunk: for families that reuse chunks, "
                                f"with chunks; not for {self.policy}")
        if len(self.tail) > MAX_TAIL_TOKENS:
            raise LinkHintError(f"a tail is at most {MAX_TAIL_TOKENS} tokens, got {len(self.tail)}")
        if any(not 0 <= token < MAX_TOKEN_ID for token in self.tail):
            raise LinkHintError(f"a tail holds token ids (0 <= id < {MAX_TOKEN_ID}), got {list(self.tail)}")
        if not 0 <= self.report_span <= MAX_SPAN_POSITIONS:
            raise LinkHintError(f"span_logprobs is 1 to {MAX_SPAN_POSITIONS} positions, got {self.report_span}")
        # The reported positions are computed in this request's extend, after every chunk: asking
        # for them never cuts a graft.
        after_chunks = prompt_len - (self.chunks[-1][1] if self.chunks else 0)
        if self.report_span > after_chunks:
            raise LinkHintError(f"span_logprobs covers positions after the last chunk: at most {after_chunks} "
                                f"here, got {self.report_span}")


def _field(obj: Any, name: str) -> Any:
    # The scheduler holds SGLang's typed msgspec envelope; the frontend holds plain JSON.
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _whole(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LinkHintError(f"{LINK_ACTION} {field} must be a whole number, got {value!r}")
    return value


def _spans(value: Any, field: str) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, (list, tuple)):
        raise LinkHintError(f"{LINK_ACTION} {field} must be a list of [start, end] spans, got {value!r}")
    spans = []
    for span in value:
        if not (isinstance(span, (list, tuple)) and len(span) == 2):
            raise LinkHintError(f"{LINK_ACTION} {field}: a span is [start, end], got {span!r}")
        spans.append((_whole(span[0], field), _whole(span[1], field)))
    return tuple(spans)


def _param(payload: dict, policy_name: str, policy: Policy, kind: ParamKind) -> Union[int, float, None]:
    """A parameter of the family (its own, or the k of a family that takes one), from the
    payload or the policy name (one of them)."""
    family = policy.family
    named = policy.param if family.param == kind.name else policy.k
    if kind.name not in payload:
        return named
    value = payload[kind.name]
    if kind.whole:
        value = _whole(value, kind.name)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LinkHintError(f"{LINK_ACTION} {kind.name} must be a number, got {value!r}")
    if ":" in policy_name and value != named:
        raise LinkHintError(f"policy {policy_name!r} and {kind.name} {value} disagree")
    return value


def _link_of_payload(payload: dict) -> LinkRequest:
    unknown = sorted(set(payload) - set(LINK_FIELDS))
    if unknown:
        raise LinkHintError(f"{LINK_ACTION} payload field {unknown[0]!r} is not one of {', '.join(LINK_FIELDS)}")
    policy_name = payload.get("policy", "naive")
    if not isinstance(policy_name, str):
        raise LinkHintError(f"{LINK_ACTION} policy must be a string, got {policy_name!r}")
    policy = parse_policy(policy_name)
    family = policy.family
    takes = {kind.name for kind in (K, RATIO) if family.param == kind.name or (kind is K and family.takes_k)}
    for kind in (K, RATIO):
        if kind.name in payload and kind.name not in takes:
            raise LinkHintError(f"{family.name} takes no {kind.name}")
    k = _param(payload, policy_name, policy, K) if K.name in takes else 0
    ratio = _param(payload, policy_name, policy, RATIO) if RATIO.name in takes else 0.0
    layout = payload.get("layout", ORIGINAL_LAYOUT)
    if not isinstance(layout, str):
        raise LinkHintError(f"layout must be {REORDERED_LAYOUT!r} or absent, got {layout!r}")
    sink = payload.get("sink_token")
    on_miss = payload.get("on_miss", ON_MISS_COMPUTE)
    if on_miss not in (ON_MISS_COMPUTE, ON_MISS_REFUSE):
        raise LinkHintError(f"on_miss must be {ON_MISS_COMPUTE!r} or {ON_MISS_REFUSE!r}, got {on_miss!r}")
    flags = {}
    for field in ("first_token_logprobs", "context_attention"):
        flags[field] = payload.get(field, False)
        if not isinstance(flags[field], bool):
            raise LinkHintError(f"{field} must be true or false, got {flags[field]!r}")
    span = _whole(payload.get("span_logprobs", 0), "span_logprobs")
    tail = payload.get("tail", [])
    if not isinstance(tail, (list, tuple)):
        raise LinkHintError(f"{LINK_ACTION} tail must be a list of token ids, got {tail!r}")
    return LinkRequest(
        policy=family.name, chunks=_spans(payload.get("chunks", []), "chunks"), k=k, ratio=float(ratio),
        layout=layout, sink_token=None if sink is None else _whole(sink, "sink_token"),
        refuse_on_miss=on_miss == ON_MISS_REFUSE, report_first_token=flags["first_token_logprobs"],
        recompute=_spans(payload.get("recompute", []), "recompute"), report_attention=flags["context_attention"],
        tail=tuple(_whole(token, "tail") for token in tail[:MAX_TAIL_TOKENS + 1]), report_span=span,
    )


def parse_link_request(kv_hints: Any) -> Optional[LinkRequest]:
    """The picrag action of a request's KV-hint envelope, or None for a vanilla request.

    Parsed strictly: this is the engine's trust boundary, and any client can send kv_hints."""
    if kv_hints is None:
        return None
    if isinstance(kv_hints, (list, tuple, str, int, float)):
        # One request carries one envelope (SGLang splits a batch's list before it gets here).
        raise LinkHintError(f"kv_hints must be one envelope object, got {type(kv_hints).__name__}")
    actions = _field(kv_hints, "actions") or ()
    if not isinstance(actions, (list, tuple)):
        raise LinkHintError("kv_hints.actions must be a list")
    ours = [a for a in actions if _field(a, "action_type") in (LINK_ACTION, COMPILE_ACTION)]
    if not ours:
        return None
    if len(ours) > 1:
        raise LinkHintError(f"a request carries one picrag action, got {len(ours)}")
    action_type = _field(ours[0], "action_type")
    version = _field(ours[0], "action_version")
    if version != ACTION_VERSION:
        raise LinkHintError(f"{action_type} version {version!r} not supported (want {ACTION_VERSION!r})")
    payload = _field(ours[0], "payload") or {}
    if not isinstance(payload, dict):
        raise LinkHintError(f"{action_type} payload must be an object")
    if action_type == COMPILE_ACTION:
        if payload:
            raise LinkHintError(f"{COMPILE_ACTION} takes no payload fields, got {sorted(payload)[0]!r}")
        return LinkRequest(policy="naive", compile=True)
    return _link_of_payload(payload)


def _envelope(action_type: str, payload: dict) -> dict:
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": uuid.uuid4().hex,
        "actions": [
            {"action_id": action_type.split(".")[-1], "action_type": action_type,
             "action_version": ACTION_VERSION, "payload": payload}
        ],
    }


def link_hints(policy: str, chunks: list[tuple[int, int]], report_first_token: bool = False,
               tail: tuple[int, ...] = (), report_span: int = 0) -> dict:
    """Hints for a prompt in its original order; `policy` is a policy name ('legolink:K')."""
    link = dataclasses.replace(LinkRequest.of(policy, chunks, tail=tail), report_first_token=report_first_token,
                               report_span=report_span)
    return hints_of(link)


def hints_of(link: LinkRequest) -> dict:
    payload = {"policy": link.policy, "chunks": [list(c) for c in link.chunks]}
    if link.family.param is not None:
        payload[link.family.param] = getattr(link, link.family.param)
    if link.family.takes_k:
        payload[K.name] = link.k
    if link.recompute:
        payload["recompute"] = [list(run) for run in link.recompute]
    if link.report_attention:
        payload["context_attention"] = True
    if link.layout != ORIGINAL_LAYOUT:
        payload["layout"] = link.layout
    if link.sink_token is not None:
        payload["sink_token"] = link.sink_token
    if link.refuse_on_miss:
        payload["on_miss"] = ON_MISS_REFUSE
    if link.report_first_token:
        payload["first_token_logprobs"] = True
    if link.tail:
        payload["tail"] = list(link.tail)
    if link.report_span:
        payload["span_logprobs"] = link.report_span
    return _envelope(LINK_ACTION, payload)


def runtime_request(input_ids: list[int], link: LinkRequest) -> tuple[list[int], dict]:
    """The input_ids and kv_hints the runtime gets for a prompt in its original order: prompts of
    families with a reordered layout are reordered so the tokens recomputed inside the prompt
    form the extend (picrag_core.reordered_layout)."""
    if not link.family.reordered_layout or not link.chunks:
        return input_ids, hints_of(link)
    from picrag_core.reordered_layout import reordered_layout

    layout = reordered_layout(len(input_ids), link.chunks, link.recomputed_runs)
    reordered = dataclasses.replace(link, layout=REORDERED_LAYOUT)
    return layout.reorder(input_ids), hints_of(reordered)


def compile_hints() -> dict:
    return _envelope(COMPILE_ACTION, {})
