"""The radix-tree key of a linked prompt, built from everything its cached slots' KV depends on.

The rule (cache transparency): two requests share a cached slot only if their policy computes
the same value for that slot in both.

The chunk store (`store_key`) holds each compiled chunk's KV from that chunk's own compile: the
first entry of a stored chunk's key is its content key (picrag_core.chunk_key, the one hash of
its tokens a request makes), so two chunks never share nodes, not even a common first part. A causal prefix computed inside another chunk is the same
KV up to rounding (at most 3.2e-5 on a naive victim's first-token log-probabilities, measured by
the transparency fuzzer), but the repair network amplifies such rounding to 1e-3 to 2e-2; a
chunk's stored KV is therefore a function of the chunk alone, whatever was compiled before.

In a linked prompt, a slot's value depends on

1. the tokens before it and how their KV was made: the tree path, so every earlier key entry;
2. its own token and position: its key entry and its depth in the path (a prompt sent
   reordered runs at the positions its chunk spans and recomputed runs give: both are in the
   namespace);
3. how it was made: computed in context, or grafted from a stored chunk. Every grafted token's
   entry carries GRAFTED; the first grafted token of each chunk is a digest (`segment_start`),
   so where one chunk ends and the next begins is part of the key, and the same tokens split
   into other chunks are other KV;
4. for a grafted token, the stored chunk's tokens that the chunk's KV saw and that are not on
   the path before it. The first grafted token's digest covers them:
   * causal families in the prompt's order (naive, legolink0): none beyond the path (legolink0's
     sink tokens, the model's BOS, are in the namespace);
   * families sent reordered: the chunk's recomputed tokens before it (LegoLink's first k, a
     selection's tokens), which sit after every kept token: the key names the whole chunk (its
     content key) and where in it the span begins;
   * families that repair: every chunk up to its own, whole (the repair network attends both
     ways inside a chunk and from earlier chunks to later ones; an earlier chunk recomputed
     whole, or its recomputed tokens, sit after this one in a reordered prompt): their lengths
     and content keys; and the checkpoint (its digest is in the namespace);
5. the policy family and its parameter: the namespace (`namespace_of`).

Chunk tokens that were not grafted (a chunk missing from the store, a graft cut short by
`logprob_start_len` or by the last prompt token that SGLang always computes) are computed in
context: such a request is not inserted (sglang_patches.tree.chunk_cache), so the tree never files
in-context KV under a grafted key.

Key entries stay in int64 (SGLang's `array("q")` keys): token ids are far below GRAFTED, and a
segment start is a 62-bit truncated SHA-256 above every marked token id, so it never equals one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Optional

from picrag_core.chunk_key import StoredChunk
from picrag_core.request_bounds import NAMESPACE_PREFIX
from sglang_patches.plan.segments import Segment


GRAFTED = 1 << 40
SEGMENT_START = 1 << 62


def _digest_entry(digest: str) -> int:
    """A content key (hex SHA-256) as one key entry below SEGMENT_START."""
    return int(digest[:16], 16) & (SEGMENT_START - 1)


def segment_start(token: int, depends_on: Sequence[int]) -> int:
    """The key entry of a chunk's first grafted token: its token and what its KV depends on
    beyond the path (short: chunk lengths and content keys, never a chunk's tokens again)."""
    digest = hashlib.sha256(array("q", [token, len(depends_on), *depends_on]).tobytes()).digest()
    return SEGMENT_START | (int.from_bytes(digest[:8], "little") & (SEGMENT_START - 1))


def store_key(chunk: StoredChunk) -> array:
    """The chunk store's key of a chunk (as compiled: behind its sinks, if any): its tokens, the
    first replaced by its content key, so two chunks never share a node."""
    key = array("q", chunk.tokens)
    if key:
        key[0] = SEGMENT_START | _digest_entry(chunk.digest)
    return key


def prompt_key(prompt: Sequence[int], segments: Sequence[Segment], repaired: bool) -> array:
    """The tree key of a linked prompt as sent. `repaired`: the family's grafted KV is the
    repair network's, which depends on every chunk up to its own, whole, not only on the
    chunk's tokens before each one."""
    key = array("q", prompt)
    seen: list[int] = []  # repaired: every chunk so far, in prompt order, each as its length and content key
    chunks_seen: set[int] = set()
    for segment in segments:
        if repaired and segment.is_chunk and segment.chunk not in chunks_seen:
            # Its first segment, or its empty one (recomputed whole: the network's context all the same).
            chunks_seen.add(segment.chunk)
            seen += [len(segment.stored), _digest_entry(segment.stored.digest)]
        if not segment.is_chunk or segment.start == segment.end:
            continue
        for index in range(segment.start, segment.end):
            key[index] |= GRAFTED
        if repaired:
            depends_on = seen
        elif segment.chunk_offset:
            # The chunk's tokens before the span, named by the whole chunk's content key: stricter
            # than those tokens alone, never looser.
            depends_on = [segment.chunk_offset, _digest_entry(segment.stored.digest)]
        else:
            depends_on = []
        key[segment.start] = segment_start(prompt[segment.start], depends_on)
    return key


def namespace_of(family_name: str, *, sink_token: Optional[int] = None, chunks: Sequence[tuple[int, int]] = (),
                 recomputed: Optional[Sequence[tuple[int, int]]] = None, repair_digest: Optional[str] = None) -> str:
    """The tree namespace of a family's linked prompts: no other family's request matches them.
    `recomputed` (the runs a reordered prompt recomputes) and `chunks` for a prompt sent
    reordered (its positions depend on both), `sink_token` for families that compile behind
    sinks, `repair_digest` for families that repair."""
    parts = [f"{NAMESPACE_PREFIX}{family_name}"]
    if sink_token is not None:
        parts.append(f"sink{sink_token}")
    if recomputed is not None:
        spans = ";".join(",".join(f"{start}-{end}" for start, end in runs) for runs in (chunks, recomputed))
        parts.append(hashlib.sha256(spans.encode()).hexdigest()[:16])
    if repair_digest is not None:
        parts.append(f"repair{repair_digest[:16]}")
    return ":".join(parts)
