"""Bounds on a chat request's messages, checked before they are templated or tokenized (by the
frontend for the `picrag` extension, by the runtime otherwise)."""

from __future__ import annotations

from typing import Any, Optional

MAX_MESSAGES = 256
# A cost bound (templating and tokenizing are linear in a message's length), far above what
# fits a 128k-token context window at ordinary text's 3-5 characters a token.
MAX_MESSAGE_CHARS = 1_000_000


def _chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # OpenAI content parts
        return sum(len(part.get("text") or "") for part in content
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0


def message_limit_error(payload: dict[str, Any]) -> Optional[str]:
    """Why the `messages` of a chat body are too many or too long; None when they are not (and
    when they are no list: the request's own validation says what is wrong with them)."""
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return None
    if len(messages) > MAX_MESSAGES:
        return f"messages: {len(messages)} messages, over the limit of {MAX_MESSAGES}"
    for index, message in enumerate(messages):
        chars = _chars(message.get("content")) if isinstance(message, dict) else 0
        if chars > MAX_MESSAGE_CHARS:
            return f"messages.{index}.content: {chars} characters, over the limit of {MAX_MESSAGE_CHARS}"
    return None
