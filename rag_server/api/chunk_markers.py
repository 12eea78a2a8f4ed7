"""In-band chunk boundaries for prompts that arrive as text (SGLang DSL scripts).

An unmodified DSL script can only send `text` to `/generate`. `picrag.dsl.chunk()` wraps a
passage in two Unicode private-use characters; the frontend finds them, tokenizes the text
between them on its own (so the passage's tokens do not depend on what precedes it) and sends
the engine `input_ids` with the chunk spans, exactly like a `/rag/query` prompt. The markers
never reach the model. Private-use code points do not occur in ordinary text, and a prompt
without them is forwarded untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from picrag_core.link_hints import LinkRequest, hints_of
from picrag_core.policies import Policy

CHUNK_BEGIN = "\ue000"
CHUNK_END = "\ue001"


def has_markers(text: str) -> bool:
    return CHUNK_BEGIN in text or CHUNK_END in text


def strip_markers(text: str) -> str:
    return text.replace(CHUNK_BEGIN, "").replace(CHUNK_END, "")


def mark_chunk(text: str) -> str:
    if has_markers(text):
        raise ValueError("a chunk cannot contain picrag chunk markers (U+E000, U+E001)")
    return f"{CHUNK_BEGIN}{text}{CHUNK_END}"


@dataclass(frozen=True)
class Segment:
    text: str
    is_chunk: bool


def split_marked(text: str) -> list[Segment]:
    """Plain and chunk segments in order. A begin marker without its end (a prompt cut in the
    middle of a chunk, as the DSL's prefix cache does) leaves that tail plain text."""
    segments: list[Segment] = []
    rest = text
    while rest:
        begin = rest.find(CHUNK_BEGIN)
        end = rest.find(CHUNK_END, begin + 1) if begin >= 0 else -1
        if begin < 0 or end < 0:
            segments.append(Segment(strip_markers(rest), False))
            break
        if begin > 0:
            segments.append(Segment(strip_markers(rest[:begin]), False))
        segments.append(Segment(rest[begin + 1:end], True))
        rest = rest[end + 1:]
    return [s for s in segments if s.text]


def leading_special_tokens(tokenizer) -> list[int]:
    """What the tokenizer puts before any text (a BOS for some models, nothing for others)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    return list(full[: full.index(plain[0])]) if plain and plain[0] in full else []


def tokenize_marked(
    text: str, encode: Callable[[str], list[int]], prefix_ids: list[int] = ()
) -> tuple[list[int], list[tuple[int, int]]]:
    """`input_ids` and chunk spans of a marked prompt.

    `encode` tokenizes without special tokens; `prefix_ids` are the special tokens the
    tokenizer puts at the start of a text (a BOS where the model has one), added once before
    everything as SGLang's own text path would, and never inside a chunk.
    """
    ids: list[int] = list(prefix_ids)
    chunks: list[tuple[int, int]] = []
    for segment in split_marked(text):
        piece = encode(segment.text)
        if segment.is_chunk and piece:
            chunks.append((len(ids), len(ids) + len(piece)))
        ids.extend(piece)
    return ids, chunks


def link_marked_payload(
    payload: dict[str, Any], encode: Callable[[str], list[int]], prefix_ids: list[int], policy: Policy
) -> dict[str, Any] | None:
    """The `/generate` payload to send instead of one whose text carries chunk markers, or
    None when it has none. A single text becomes `input_ids` with a `picrag.link` hint; a
    batch of texts (the DSL's `select`) loses its markers and is sent as plain text, because
    one hint cannot describe several prompts."""
    text = payload.get("text")
    if isinstance(text, str) and has_markers(text):
        input_ids, chunks = tokenize_marked(text, encode, prefix_ids)
        rewritten = {k: v for k, v in payload.items() if k != "text"}
        return {**rewritten, "input_ids": input_ids, "kv_hints": hints_of(LinkRequest.of(policy, chunks))}
    if isinstance(text, list) and any(isinstance(t, str) and has_markers(t) for t in text):
        return {**payload, "text": [strip_markers(t) if isinstance(t, str) else t for t in text]}
    return None
