"""No field value of a generation request may raise in, or stall, the scheduler.

SGLang 0.5.23 types every field of a request, but bounds some of them nowhere: a
`top_logprobs_num` above the vocabulary (also reached through chat's `top_logprobs` and
`/v1/completions`' `logprobs`) raises in the scheduler's top-k and takes the runtime down, and a
`stop_regex` runs through Python's backtracking `re` on the scheduler thread at every decode
step, where one pattern can hold every request for minutes. Others let one request take the
scheduler's capacity (`n`, `beam_width`) or per-step work (`stop`, `stop_token_ids`, logprob
counts, chunk spans) without limit.

These are the bounds, defined once: the engine holds them for any client that reaches it
(`check_request`, called by sglang_patches.guard.request_guard on SGLang's per-request validation,
which every route and every prompt of a batch passes), and the frontend's typed allowlist
(rag_server/api/forwarded_bodies.py) reads the same numbers to refuse earlier with a 400 naming
the field. `stop_regex` is refused outright: SGLang only evaluates it with Python's `re`, and
`stop` strings or the grammar backend (`regex`, `json_schema`, `ebnf`, compiled by xgrammar off
the scheduler loop) serve the same needs in linear time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from picrag_core.link_hints import parse_link_request

# OpenAI's limit on top logprobs; one bound for every spelling (top_logprobs_num, chat's
# top_logprobs, completions' logprobs) and for logprobs of named tokens (token_ids_logprob).
MAX_TOP_LOGPROBS = 20
# Sequences one prompt may ask for (`n`, `beam_width`): each is a request in the scheduler.
MAX_N = 4
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Grammar sources (regex, json_schema, ebnf); xgrammar compiles them off the scheduler loop.
MAX_GRAMMAR_CHARS = 32 * 1024
# Prompts of one batch request (`text`, `input_ids` or a completions `prompt` list).
MAX_BATCH_PROMPTS = 32
# Chunk spans of one picrag.link hint: each is a tree lookup, and a compile when missing.
MAX_CHUNK_SPANS = 256

STOP_REGEX_REFUSAL = ("stop_regex is not served: SGLang evaluates it with Python's backtracking re on the "
                      "scheduler thread; use stop strings, or regex for structured output")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count_error(field: str, values: Any, limit: int) -> Optional[str]:
    if isinstance(values, (list, tuple, set)) and len(values) > limit:
        return f"{field}: {len(values)} entries, over the limit of {limit}"
    return None


def _range_error(field: str, value: Any, low: int, high: int) -> Optional[str]:
    if value is not None and _is_int(value) and not low <= value <= high:
        return f"{field}: {value} is outside [{low}, {high}]"
    return None


def logprob_start_error(value: Any, prompt_len: int, field: str = "logprob_start_len") -> Optional[str]:
    """`logprob_start_len` is -1 (none) or a position inside the prompt."""
    if value is None or not _is_int(value) or value == -1 or 0 <= value < prompt_len:
        return None
    return f"{field}: {value} is not -1 or a position inside the {prompt_len}-token prompt"


def stop_errors(stop: Any, field: str = "stop") -> Optional[str]:
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list):
        return None
    counted = _count_error(field, strings, MAX_STOP_STRINGS)
    if counted:
        return counted
    for text in strings:
        if isinstance(text, str) and len(text) > MAX_STOP_CHARS:
            return f"{field}: a stop string of {len(text)} characters, over the limit of {MAX_STOP_CHARS}"
    return None


def sampling_error(params: Mapping[str, Any]) -> Optional[str]:
    """What in one prompt's `sampling_params` the scheduler must not be given; None if nothing."""
    if params.get("stop_regex"):
        return f"sampling_params.stop_regex: {STOP_REGEX_REFUSAL}"
    for name in ("n", "beam_width"):
        error = _range_error(f"sampling_params.{name}", params.get(name), 1, MAX_N)
        if error:
            return error
    error = stop_errors(params.get("stop"), "sampling_params.stop")
    if error:
        return error
    error = _count_error("sampling_params.stop_token_ids", params.get("stop_token_ids"), MAX_STOP_TOKEN_IDS)
    if error:
        return error
    for name in ("regex", "json_schema", "ebnf", "structural_tag"):
        source = params.get(name)
        if isinstance(source, str) and len(source) > MAX_GRAMMAR_CHARS:
            return f"sampling_params.{name}: {len(source)} characters, over the limit of {MAX_GRAMMAR_CHARS}"
    return None


def logprob_error(top_logprobs_num: Any, token_ids_logprob: Any) -> Optional[str]:
    return (_range_error("top_logprobs_num", top_logprobs_num, 0, MAX_TOP_LOGPROBS)
            or _count_error("token_ids_logprob", token_ids_logprob, MAX_TOP_LOGPROBS))


def chunk_count_error(chunks: int) -> Optional[str]:
    if chunks > MAX_CHUNK_SPANS:
        return f"kv_hints: {chunks} chunk spans, over the limit of {MAX_CHUNK_SPANS}"
    return None


def chunk_spans_error(kv_hints: Any) -> Optional[str]:
    """Too many chunk spans in a picrag.link hint (a malformed hint is request_guard's to refuse)."""
    try:
        link = parse_link_request(kv_hints)
    except ValueError:
        return None
    return None if link is None else chunk_count_error(len(link.chunks))


def request_error(obj: Any, input_ids: Optional[Sequence[int]]) -> Optional[str]:
    """Why one prompt of a GenerateReqInput (SGLang has split any batch) may not reach the
    scheduler; None when it may."""
    sampling = getattr(obj, "sampling_params", None)
    errors = (
        logprob_error(getattr(obj, "top_logprobs_num", None), getattr(obj, "token_ids_logprob", None)),
        None if input_ids is None else logprob_start_error(getattr(obj, "logprob_start_len", None), len(input_ids)),
        sampling_error(sampling) if isinstance(sampling, Mapping) else None,
        chunk_spans_error(getattr(obj, "kv_hints", None)),
    )
    return next((error for error in errors if error), None)


def check_request(obj: Any, input_ids: Optional[Sequence[int]]) -> None:
    """Called on SGLang's per-request validation: a ValueError is SGLang's 400."""
    error = request_error(obj, input_ids)
    if error:
        raise ValueError(error)


# What a client may name: picrag's own cache namespaces never, token ids of the model only.
NAMESPACE_PREFIX = "picrag:"
# Where a client's extra_key that starts with NAMESPACE_PREFIX goes instead.
CLIENT_NAMESPACE_PREFIX = "client:"


def client_namespace(extra_key: Optional[str]) -> Optional[str]:
    """A client's extra_key as the radix tree may use it: never one of picrag's namespaces."""
    if extra_key is not None and extra_key.startswith(NAMESPACE_PREFIX):
        return CLIENT_NAMESPACE_PREFIX + extra_key
    return extra_key


def out_of_vocabulary(token_ids: Sequence[Any], vocab_size: int) -> Optional[int]:
    """Where in `token_ids` the first entry is that is no token id of a vocabulary of `vocab_size`."""
    for index, token in enumerate(token_ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            return index
    return None


def vocabulary_error(token_ids: Sequence[Any], vocab_size: int, field: str = "input_ids") -> Optional[str]:
    index = out_of_vocabulary(token_ids, vocab_size)
    if index is None:
        return None
    return f"{field}: {token_ids[index]!r} is not a token id of this model (0..{vocab_size - 1})"


def check_token_ids(token_ids: Sequence[Any], vocab_size: int) -> None:
    error = vocabulary_error(token_ids, vocab_size)
    if error:
        raise ValueError(error)
