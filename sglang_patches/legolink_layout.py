"""LegoLink's token order: the tokens to recompute are moved behind the reused ones.

SGLang's extend computes a contiguous suffix of a request's row after a cached prefix. LegoLink
(EPIC) recomputes the first k tokens of every chunk, which sit *inside* the prompt. So the
prompt is sent reordered: ``[head][rest of chunk 1]...[rest of chunk n][first k of chunk 1]...
[first k of chunk n][question]``. The head and the rests are cached (the rests re-positioned to
their true offsets), the link tokens and the question are the extend, and every token keeps its
true position: the forward runs them at those positions (sglang_patches.positions) and attention
masks by true position (sglang_patches.attention), so the result is exactly LegoLink on the
original prompt. The question stays last, so decoding needs nothing special.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LegoLinkLayout:
    order: list[int]  # reordered index -> true position in the original prompt
    head_len: int
    rests: list[tuple[int, int]]  # reordered span of each chunk's tokens k.. (may be empty)

    def reorder(self, token_ids: list[int]) -> list[int]:
        return [token_ids[position] for position in self.order]

    def restore(self, reordered: list[int]) -> list[int]:
        original = [0] * len(reordered)
        for index, position in enumerate(self.order):
            original[position] = reordered[index]
        return original


def legolink_layout(prompt_len: int, chunks: list[tuple[int, int]], k: int) -> LegoLinkLayout:
    """Chunks must be back to back (LinkRequest.validate checks it for reordered families)."""
    head_len = chunks[0][0] if chunks else prompt_len
    order = list(range(head_len))
    rests = []
    for start, end in chunks:
        rest_start = len(order)
        order.extend(range(min(start + k, end), end))
        rests.append((rest_start, len(order)))
    for start, end in chunks:
        order.extend(range(start, min(start + k, end)))
    order.extend(range(chunks[-1][1] if chunks else prompt_len, prompt_len))
    return LegoLinkLayout(order=order, head_len=head_len, rests=rests)
