"""The spans of a linked prompt as sent whose KV can come from the chunk store: what a plan
grafts (sglang_patches.plan.link_plan) and what its tree key marks (sglang_patches.plan.keys)."""

from __future__ import annotations

from dataclasses import dataclass

from picrag_core.chunk_key import StoredChunk

HEAD = -1  # Segment.chunk of the head


@dataclass(frozen=True)
class Segment:
    """A span of the prompt as sent whose KV can come from the chunk store."""

    start: int
    end: int
    stored: StoredChunk  # the stored chunk it comes from (as stored: behind its sinks, with its tail)
    chunk_offset: int  # where in that chunk the span begins
    shift: int  # true position of the stored chunk's first token
    chunk: int  # which of the link's chunks it belongs to; HEAD for the head (a true prefix, never counted)

    @property
    def is_chunk(self) -> bool:
        return self.chunk != HEAD

    @property
    def recomputed_whole(self) -> bool:
        """A chunk whose every token a reordered layout recomputes (k covers it): nothing to
        graft, no hit or miss, but context for the repair network."""
        return self.is_chunk and self.start == self.end


@dataclass(frozen=True)
class ChunkSpan:
    """A chunk's span of the prompt (original order) and the stored chunk its KV comes from."""

    start: int
    end: int
    stored: StoredChunk
