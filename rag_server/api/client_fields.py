"""Fields of a client's SGLang-style body (`/generate`, `/v1/chat/completions`) that the frontend
refuses with a 400 naming them, before anything reaches the runtime.

The engine holds the same line on its own (sglang_patches.guard.request_guard): these checks give a
client the reason up front, and keep a linked prompt's chunks from being compiled at all.
"""

from __future__ import annotations

from typing import Any, Optional

from picrag_core.link_hints import ORIGINAL_LAYOUT, LinkHintError, LinkRequest
from picrag_core.request_bounds import NAMESPACE_PREFIX, vocabulary_error


def _prompts(input_ids: Any) -> list[list[Any]]:
    """The token lists of `input_ids`, one prompt or a batch ([] for what SGLang refuses itself)."""
    if not isinstance(input_ids, list):
        return []
    if input_ids and all(isinstance(item, list) for item in input_ids):
        return input_ids
    return [input_ids]


def refused_field(payload: dict[str, Any], vocab_size: int) -> Optional[str]:
    """Why `payload` may not go to the runtime as sent, naming the field; None if it may."""
    extra_key = payload.get("extra_key")
    keys = extra_key if isinstance(extra_key, list) else [extra_key]
    if any(isinstance(key, str) and key.startswith(NAMESPACE_PREFIX) for key in keys):
        return f"extra_key: cache namespaces starting with {NAMESPACE_PREFIX!r} are picrag's own"
    for prompt in _prompts(payload.get("input_ids")):
        error = vocabulary_error(prompt, vocab_size)
        if error:
            return error
    return None


def client_link(link: LinkRequest, model_sink: Optional[int], vocab_size: int) -> LinkRequest:
    """A client's `picrag.link` as the link pipeline takes it: a prompt in its original order
    (picrag reorders it where the policy needs), with the model's own sink token, and a tail of
    the model's token ids (compiled with the last chunk)."""
    if link.layout != ORIGINAL_LAYOUT:
        raise LinkHintError("kv_hints field 'layout' is set by picrag when it reorders a prompt: "
                            "send the prompt in its original order, without it")
    if link.sink_token is not None and link.sink_token != model_sink:
        raise LinkHintError(f"kv_hints field 'sink_token' is the model's BOS ({model_sink}), got {link.sink_token}")
    tail_error = vocabulary_error(link.tail, vocab_size, "kv_hints field 'tail'")
    if tail_error:
        raise LinkHintError(tail_error)
    return link
