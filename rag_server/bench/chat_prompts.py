"""The dev questions as a chat app sends them: the documents inside the user message, one
paragraph each, then the question; the passages are the ones the frontend finds in it
(rag_server/linking/chunk_discovery.py), as it finds them in any chat.

`picrag bench quality --prompt-form chat` measures every policy on these prompts, so the
quality of discovered passages compares with the annotated layout's (retrieval/prompt_layout.py)
question by question. Each document reads as in the annotated layout ("Document (Title: ...):
..."); the system prompt and the question are the annotated layout's too.
"""

from __future__ import annotations

from collections.abc import Sequence

from rag_server.linking.chunk_discovery import DiscoverySettings, content_regions, discover, tokenized
from retrieval.prompt_layout import (DEFAULT_SYSTEM_PROMPT, CompiledPrompt, PromptPassage, passage_text,
                                     question_text)


class ChatPromptLayout:
    """`build` as PromptLayout's, with the chunks found in the rendered chat."""

    def __init__(self, tokenizer, settings: DiscoverySettings = DiscoverySettings()):
        self.tokenizer = tokenizer
        self.settings = settings

    def messages(self, question: str, passages: Sequence[PromptPassage]) -> list[dict[str, str]]:
        documents = "\n\n".join(passage_text(p).strip() for p in passages)
        return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                {"role": "user", "content": f"{documents}\n\n{question_text(question)}"}]

    def build(self, question: str, passages: Sequence[PromptPassage]) -> CompiledPrompt:
        messages = self.messages(question, passages)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tokenized(self.tokenizer, text, regions=content_regions(text, [m["content"] for m in messages]))
        found = discover(prompt, lambda piece: self.tokenizer(piece, add_special_tokens=False)["input_ids"],
                         self.settings)
        return CompiledPrompt(list(prompt.ids), list(found.chunks), found.tail)
