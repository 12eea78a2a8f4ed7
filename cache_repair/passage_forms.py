"""The two forms a passage's tokens take when it is served, so repair training can see both.

- `alone`: as the annotated layout compiles a passage (`retrieval.prompt_layout`): its text
  tokenized on its own, ending with its blank line. SmolLM2's tokenizer writes that blank line
  as one "\\n\\n" token at the end of a text.
- `found`: as the frontend finds the passage inside a client's message
  (`rag_server.linking.chunk_discovery`): the same text, its blank line tokenized as running text
  before the next paragraph. SmolLM2's tokenizer writes it as two "\\n" tokens there.

The repair network reads the tokens it corrects, and one trained on `alone` passages only has
never seen the found seam. `--passage-form both` gives the groups of a pairs run the two forms
in turn (docs/cacherepair.md, "Passages in both forms", measures what that changes).
"""

from __future__ import annotations

from retrieval.prompt_layout import PromptLayout, PromptPassage, passage_text

ALONE, FOUND = "alone", "found"
FORMS = (ALONE, FOUND, "both")
# What follows a passage inside a message: the next document or the question. A tokenizer
# splits a blank line before any word the same way, so one word stands for every follower.
_NEXT_PARAGRAPH = "Question"


class PassageFormError(ValueError):
    """A tokenizer whose blank line merges into the word after it: no found form to train on."""


def group_form(form: str, index: int) -> str:
    """The form of a split's group `index` under `--passage-form form`: `both` alternates."""
    if form not in FORMS:
        raise ValueError(f"passage form must be one of {', '.join(FORMS)}, not {form!r}")
    if form == "both":
        return (ALONE, FOUND)[index % 2]
    return form


def found_ids(layout: PromptLayout, passage: PromptPassage) -> list[int]:
    """The passage's ids as a message holds it, a paragraph before another (module docstring)."""
    follower = layout.encode(_NEXT_PARAGRAPH)
    joined = layout.encode(passage_text(passage) + _NEXT_PARAGRAPH)
    if joined[len(joined) - len(follower):] != follower:
        raise PassageFormError("this tokenizer merges a blank line into the word after it: "
                               "train with --passage-form alone")
    return layout.passage_prefix + joined[:len(joined) - len(follower)]
