"""Split documents into passages that fit a token budget of the LLM's tokenizer.

Breaks fall at paragraph ends where possible, else at sentence or line ends, else at word
boundaries, and only inside a word when a single word is over the limit. Whitespace after a
break stays with the passage before it, so a document's passages concatenate back to its
text exactly. The limit applies to the passage text (counted without special tokens).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from retrieval.passage import Passage

logger = logging.getLogger(__name__)

TokenCounter = Callable[[str], int]

DEFAULT_MAX_TOKENS = 192
# Any single character is at most 4 byte-level tokens, so a limit this size always leaves
# room for progress when a cut has to fall inside a word.
MIN_MAX_TOKENS = 16

_PARAGRAPH_END = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE_OR_LINE_END = re.compile(r"[.!?…][\"'”’)\]]*\s+|\n\s*")
_WHITESPACE = re.compile(r"\s+")


def token_counter(tokenizer: Any) -> TokenCounter:
    """A `count_tokens(text) -> int` from a tokenizer folder path, an object with a Hugging
    Face style `encode(text, add_special_tokens=False)`, or such a counting function itself."""
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        # Counting is not running the model: no warning for texts over its context length.
        tokenizer.model_max_length = 1 << 62
    encode = getattr(tokenizer, "encode", None)
    if callable(encode):
        return lambda text: len(encode(text, add_special_tokens=False))
    if callable(tokenizer):
        return tokenizer
    raise TypeError(f"cannot count tokens with {type(tokenizer).__name__}: "
                    "pass a tokenizer folder, a tokenizer with encode(), or a function text -> int")


def chunk_text(text: str, count_tokens: TokenCounter, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[str]:
    """Pieces of `text`, each at most `max_tokens` tokens, that concatenate to `text`."""
    if max_tokens < MIN_MAX_TOKENS:
        raise ValueError(f"max_tokens must be at least {MIN_MAX_TOKENS}, got {max_tokens}")
    chunks: list[str] = []
    current = ""
    for unit in _units(text, count_tokens, max_tokens):
        # Counts are taken on the joined string: tokens need not add up across a join.
        if current and count_tokens(current + unit) > max_tokens:
            chunks.append(current)
            current = unit
        else:
            current += unit
    if current:
        chunks.append(current)
    return chunks


def chunk_document(document: Passage, count_tokens: TokenCounter,
                   max_tokens: int = DEFAULT_MAX_TOKENS) -> list[Passage]:
    texts = chunk_text(document.text, count_tokens, max_tokens)
    return [
        Passage.from_text(text, title=document.title,
                          metadata={**document.metadata, "doc_id": document.id,
                                    "chunk": number, "chunks": len(texts)})
        for number, text in enumerate(texts)
    ]


def chunk_documents(documents: Iterable[Passage], count_tokens: TokenCounter,
                    max_tokens: int = DEFAULT_MAX_TOKENS) -> list[Passage]:
    """Passages of all documents in order, each content id once (the first occurrence wins)."""
    passages: dict[str, Passage] = {}
    document_count = duplicate_count = 0
    for document in documents:
        document_count += 1
        for passage in chunk_document(document, count_tokens, max_tokens):
            if passage.id in passages:
                duplicate_count += 1
            else:
                passages[passage.id] = passage
    logger.info("chunked %d documents into %d passages of at most %d tokens (%d duplicates dropped)",
                document_count, len(passages), max_tokens, duplicate_count)
    return list(passages.values())


def _units(text: str, count_tokens: TokenCounter, max_tokens: int) -> Iterator[str]:
    """Consecutive pieces of `text` within the limit, as coarse as the limit allows."""
    for paragraph in _split_after(text, _PARAGRAPH_END):
        if count_tokens(paragraph) <= max_tokens:
            yield paragraph
            continue
        for sentence in _split_after(paragraph, _SENTENCE_OR_LINE_END):
            if count_tokens(sentence) <= max_tokens:
                yield sentence
            else:
                yield from _split_within_limit(sentence, count_tokens, max_tokens)


def _split_after(text: str, separator: re.Pattern[str]) -> list[str]:
    """`text` cut after each separator match; a whitespace-only piece joins the next one."""
    pieces: list[str] = []
    start = 0
    for match in separator.finditer(text):
        if text[start:match.end()].strip():
            pieces.append(text[start:match.end()])
            start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def _split_within_limit(text: str, count_tokens: TokenCounter, max_tokens: int) -> Iterator[str]:
    """Cut `text` at the last word boundary of the longest prefix within the limit."""
    while count_tokens(text) > max_tokens:
        fits = _longest_fitting_prefix(text, count_tokens, max_tokens)
        spaces = [match for match in _WHITESPACE.finditer(text, 0, fits) if match.start() > 0]
        cut = spaces[-1].end() if spaces else fits
        # Token counts are only nearly monotone in the prefix length: check the cut itself.
        if cut != fits and count_tokens(text[:cut]) > max_tokens:
            cut = fits
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


def _longest_fitting_prefix(text: str, count_tokens: TokenCounter, max_tokens: int) -> int:
    """Length of the longest prefix of `text` (known to be over the limit) within it.

    The search window grows from a guess so that a very long text is never tokenized whole
    more than a few times.
    """
    fits, over = 1, min(len(text), 8 * max_tokens)
    while over < len(text) and count_tokens(text[:over]) <= max_tokens:
        fits, over = over, min(len(text), 2 * over)
    while over - fits > 1:
        middle = (fits + over) // 2
        if count_tokens(text[:middle]) <= max_tokens:
            fits = middle
        else:
            over = middle
    return fits

