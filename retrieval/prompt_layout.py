"""One prompt layout for every policy: [head][chunk 1]...[chunk n][question + answer cue].

The model's chat template is rendered once around a placeholder user message; the text before
the placeholder (system prompt, user-turn opener, instructions) is the *head*, the text after
it closes the turn and opens the assistant's. Each piece is tokenized on its own, so a
passage's tokens are the same wherever it lands, which is what lets its KV be reused. No BOS
is added at chunk heads (the CacheBlend/CacheRepair layout); full prefill sees the very same
token ids. `passage_bos` gives every passage its own BOS token instead (EPIC's released
layout), in full prefill and compiled chunk alike: an ablation for `picrag bench quality`, not
what the frontend serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from jinja2 import TemplateError

DEFAULT_SYSTEM_PROMPT = (
    "You answer questions using the documents provided. "
    "Answer with at most 5 words, no explanation."
)
_PLACEHOLDER = "\x00PICRAG_USER_MESSAGE\x00"


class PromptLayoutError(ValueError):
    """A chat template that cannot frame these messages."""


def _placeholder(messages: Sequence[dict]) -> str:
    """A stand-in for the user message that no other message contains (any text may arrive)."""
    texts = [str(message.get("content", "")) for message in messages]
    placeholder = _PLACEHOLDER
    while any(placeholder in text for text in texts):
        placeholder += "\x00"
    return placeholder


class Tokenizer(Protocol):
    def __call__(self, text: str, add_special_tokens: bool = ...) -> dict: ...

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str: ...


@dataclass(frozen=True)
class PromptPassage:
    title: str
    text: str


@dataclass
class CompiledPrompt:
    input_ids: list[int]
    chunks: list[tuple[int, int]]
    # Tokens the last chunk is stored with after it (picrag_core.link_hints: a passage found last
    # in a prompt, without the separator that ends the others).
    tail: tuple[int, ...] = ()

    @property
    def chunk_tokens(self) -> int:
        return sum(end - start for start, end in self.chunks)


def passage_text(passage: PromptPassage) -> str:
    # No position-dependent numbering: a passage's tokens must not depend on where it lands.
    title = f" (Title: {passage.title})" if passage.title else ""
    return f"Document{title}: {passage.text.strip()}\n\n"


def question_text(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


class PromptLayout:
    def __init__(self, tokenizer: Tokenizer, system_prompt: str = DEFAULT_SYSTEM_PROMPT,
                 history: Sequence[dict] = (), passage_bos: bool = False):
        """`history`: earlier chat turns ({"role", "content"}), rendered into the head between
        the system prompt and the final user turn that holds the documents and question.
        `passage_bos`: every passage starts with the tokenizer's BOS token (module docstring)."""
        self.tokenizer = tokenizer
        self.passage_prefix: list[int] = []
        if passage_bos:
            bos = getattr(tokenizer, "bos_token_id", None)
            if bos is None:
                raise PromptLayoutError("passage_bos: the tokenizer has no BOS token")
            self.passage_prefix = [bos]
        messages = [{"role": "system", "content": system_prompt}, *history]
        placeholder = _placeholder(messages)
        try:
            rendered = tokenizer.apply_chat_template(
                [*messages, {"role": "user", "content": placeholder}], tokenize=False, add_generation_prompt=True,
            )
        except (ValueError, TemplateError) as exc:  # a template may raise on, say, the order of roles
            raise PromptLayoutError(f"the model's chat template refused these messages: {exc}") from exc
        if rendered.count(placeholder) != 1:
            raise PromptLayoutError("the model's chat template does not place the user message once")
        head, tail = rendered.split(placeholder)
        self.head_ids = self.encode(head + "Documents:\n\n")
        self.tail_text = tail

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def passage_ids(self, passage: PromptPassage) -> list[int]:
        return self.passage_prefix + self.encode(passage_text(passage))

    def question_ids(self, question: str) -> list[int]:
        return self.encode(question_text(question) + self.tail_text)

    def build(self, question: str, passages: Sequence[PromptPassage]) -> CompiledPrompt:
        return self.assemble([self.passage_ids(passage) for passage in passages], self.question_ids(question))

    def assemble(self, pieces: Sequence[Sequence[int]], question_ids: Sequence[int]) -> CompiledPrompt:
        """The prompt from passages and a question already tokenized (`passage_ids`, `question_ids`)."""
        ids = list(self.head_ids)
        chunks = []
        for piece in pieces:
            chunks.append((len(ids), len(ids) + len(piece)))
            ids.extend(piece)
        ids.extend(question_ids)
        return CompiledPrompt(input_ids=ids, chunks=chunks)
