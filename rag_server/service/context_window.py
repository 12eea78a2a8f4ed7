"""Fit passages into the model's context window by dropping whole passages, worst first.

A passage is a reusable chunk: cutting one mid-way would change its tokens (no reuse) and
silently hide part of a document from the model. So when the prompt would not fit, the
lowest-scored passages go (without scores, the last given), the rest keep their order, and the
caller reports what was dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from retrieval.passage import Passage
from retrieval.prompt_layout import CompiledPrompt, PromptLayout


class PromptTooLong(ValueError):
    pass


@dataclass(frozen=True)
class ContextLimits:
    """What the runtime accepts: `context_length` positions for prompt plus generated tokens,
    and at most `max_input_tokens` prompt tokens (SGLang keeps a few positions in reserve)."""

    context_length: int
    max_input_tokens: int

    def prompt_budget(self, max_new_tokens: int) -> int:
        return min(self.max_input_tokens, self.context_length - max_new_tokens)

    def refusal(self, input_tokens: int, sampling: object) -> str | None:
        """Why the runtime would refuse this prompt (`sampling`: a /generate body's
        sampling_params), asked before its chunks are compiled: the runtime checks length only
        when the prompt arrives, after every chunk was computed (minutes on a CPU), and a chunk
        over the window makes the compile fail as if the runtime had."""
        if input_tokens > self.max_input_tokens:
            return f"the prompt ({input_tokens} tokens) is longer than the runtime accepts ({self.max_input_tokens})"
        max_new = sampling.get("max_new_tokens") if isinstance(sampling, dict) else None
        if isinstance(max_new, int) and input_tokens + max_new > self.context_length:
            return (f"prompt ({input_tokens} tokens) plus max_new_tokens ({max_new}) exceed the context "
                    f"length ({self.context_length})")
        return None


@dataclass
class FittedPassages:
    kept: list[Passage]
    dropped: list[Passage]
    prompt: CompiledPrompt  # of the kept passages, from the tokens their sizes were measured on


def fit_passages(layout: PromptLayout, question: str, passages: Sequence[Passage], budget: int) -> FittedPassages:
    """The passages that fit `budget` prompt tokens, and the prompt built from them; each piece
    is tokenized once."""
    question_ids = layout.question_ids(question)
    fixed = len(layout.head_ids) + len(question_ids)
    if fixed > budget:
        raise PromptTooLong(
            f"the question alone needs {fixed} prompt tokens; the context window leaves {budget} "
            "(shorten the question or lower max_tokens)"
        )
    pieces = [layout.passage_ids(p.prompt_passage()) for p in passages]
    sizes = [len(piece) for piece in pieces]
    # Drop order: lowest score first; unscored passages count as lowest; ties: later first.
    drop_order = sorted(
        range(len(passages)),
        key=lambda i: (passages[i].score is not None, passages[i].score or 0.0, -i),
    )
    total = fixed + sum(sizes)
    dropped: set[int] = set()
    for index in drop_order:
        if total <= budget:
            break
        dropped.add(index)
        total -= sizes[index]
    kept = [i for i in range(len(passages)) if i not in dropped]
    return FittedPassages(
        kept=[passages[i] for i in kept],
        dropped=[p for i, p in enumerate(passages) if i in dropped],
        prompt=layout.assemble([pieces[i] for i in kept], question_ids),
    )
