"""The typed allowlist of what the frontend forwards to the runtime: SGLang's `/generate`,
`/v1/completions` and `/v1/chat/completions` bodies, as the fields picrag supports, with bounds.

A body is parsed by its model before anything reaches the runtime; a field out of its bounds,
or one the model does not list, is a 400 that names it. `picrag serve --pass-unlisted-fields`
lets a trusted deployment send unlisted fields through (the listed ones keep their bounds). The
body is then forwarded as the client sent it, byte for byte.

The bounds that keep the scheduler alive are the engine's own (picrag_core.request_bounds),
read here so that both sides hold the same numbers; the RAG routes build their runtime bodies
from their own typed requests (rag_api.RagQuery, openai_chat.RagChatRequest), whose stop strings
take the bounds from here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, TypeVar, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from rag_server.api.message_limits import MAX_MESSAGES
from picrag_core.request_bounds import (MAX_BATCH_PROMPTS, MAX_GRAMMAR_CHARS, MAX_N, MAX_STOP_CHARS,
                                           MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS,
                                           STOP_REGEX_REFUSAL, logprob_start_error)

UNLISTED_HINT = "not a field picrag forwards (picrag serve --pass-unlisted-fields lets unlisted fields through)"


@dataclass(frozen=True)
class ForwardLimits:
    """What a body is checked against besides its model's own bounds."""

    context_length: int  # max_new_tokens and its OpenAI spellings stay within it
    pass_unlisted: bool = False


def _within_context(value: int, info: ValidationInfo) -> int:
    context_length = (info.context or {}).get("context_length")
    if context_length is not None and value > context_length:
        raise ValueError(f"{value} new tokens exceed the context length ({context_length})")
    return value


NewTokens = Annotated[int, Field(ge=0), AfterValidator(_within_context)]
TokenId = Annotated[int, Field(ge=0)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = Union[StopText, Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)]]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
Grammar = Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]
Sequences = Annotated[int, Field(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
NamedLogprobs = Annotated[list[TokenId], Field(max_length=MAX_TOP_LOGPROBS)]
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_STOP_TOKEN_IDS)]
Batch = Field(min_length=1, max_length=MAX_BATCH_PROMPTS)
TokenPrompt = list[int]  # ids checked against the vocabulary by rag_server/api/client_fields.py


class Forwarded(BaseModel):
    # Unlisted fields are kept aside (model_extra), to be refused or passed through.
    model_config = ConfigDict(extra="allow", strict=True)


def _no_stop_regex(value: Any) -> Any:
    if value:
        raise ValueError(STOP_REGEX_REFUSAL)
    return value


class SamplingKnobs(Forwarded):
    """The sampling fields SGLang's `sampling_params` and the OpenAI routes share, with their
    ranges written once."""

    temperature: Optional[float] = Field(None, ge=0, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)


class SamplingParams(SamplingKnobs):
    """SGLang's `sampling_params` (/generate): every field the DSL and SGLang's clients send."""

    max_new_tokens: Optional[NewTokens] = None
    min_new_tokens: Optional[NewTokens] = None
    stop: Optional[Stop] = None
    stop_token_ids: Optional[StopTokenIds] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    n: Optional[Sequences] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    regex: Optional[Grammar] = None
    json_schema: Optional[Grammar] = None
    ebnf: Optional[Grammar] = None
    sampling_seed: Optional[Int64] = None
    logit_bias: Optional[LogitBias] = None

    _stop_regex = field_validator("stop_regex")(_no_stop_regex)


def _prompt_count(prompts: Any) -> int:
    """Prompts in a `text`/`input_ids`/`prompt` value: a batch is a list of them."""
    if isinstance(prompts, list) and prompts and all(isinstance(p, (str, list)) for p in prompts):
        return len(prompts)
    return 1


class GenerateBody(Forwarded):
    text: Optional[Union[str, Annotated[list[str], Batch]]] = None
    input_ids: Optional[Union[TokenPrompt, Annotated[list[TokenPrompt], Batch]]] = None
    sampling_params: Optional[Union[SamplingParams, Annotated[list[SamplingParams], Batch]]] = None
    return_logprob: Optional[Union[bool, Annotated[list[bool], Batch]]] = None
    logprob_start_len: Optional[Union[int, Annotated[list[int], Batch]]] = None
    top_logprobs_num: Optional[Union[TopLogprobs, Annotated[list[TopLogprobs], Batch]]] = None
    token_ids_logprob: Optional[Union[NamedLogprobs, Annotated[list[NamedLogprobs], Batch]]] = None
    return_text_in_logprobs: Optional[bool] = None
    stream: Optional[bool] = None
    rid: Optional[Union[str, Annotated[list[str], Batch]]] = None
    extra_key: Optional[Union[str, Annotated[list[str], Batch]]] = None
    kv_hints: Any = None  # parsed by the /generate route (picrag_core.link_hints)

    def refusal(self) -> Optional[str]:
        """What the model alone cannot check: starts inside each token prompt (a link's chunk
        spans are counted by the /generate route once parsed)."""
        if isinstance(self.input_ids, list) and self.logprob_start_len is not None:
            batch = bool(self.input_ids) and all(isinstance(p, list) for p in self.input_ids)
            prompts = self.input_ids if batch else [self.input_ids]
            starts = self.logprob_start_len
            for start, prompt in zip(starts if isinstance(starts, list) else [starts] * len(prompts), prompts):
                error = logprob_start_error(start, len(prompt))
                if error:
                    return error
        return None

    def sequences(self) -> int:
        params = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params]
        n = max((p.n or 1) for p in params if p is not None) if any(params) else 1
        return _prompt_count(self.text if self.text is not None else self.input_ids) * n


class StreamOptions(Forwarded):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None


class OpenAISampling(SamplingKnobs):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: Optional[str] = None
    n: Optional[Sequences] = None
    stop: Optional[Stop] = None
    stop_token_ids: Optional[StopTokenIds] = None
    seed: Optional[Int64] = None
    logit_bias: Optional[LogitBias] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    regex: Optional[Grammar] = None
    ebnf: Optional[Grammar] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    rid: Optional[str] = None
    extra_key: Optional[str] = None

    def refusal(self) -> Optional[str]:
        return None

    def sequences(self) -> int:
        return self.n or 1


class CompletionBody(OpenAISampling):
    prompt: Union[str, Annotated[list[str], Batch], TokenPrompt, Annotated[list[TokenPrompt], Batch]]
    max_tokens: Optional[NewTokens] = None
    min_tokens: Optional[NewTokens] = None
    logprobs: Optional[TopLogprobs] = None
    echo: Optional[bool] = None
    json_schema: Optional[Grammar] = None

    def sequences(self) -> int:
        return _prompt_count(self.prompt) * super().sequences()


class TextPart(Forwarded):
    type: Literal["text"]
    text: str


class Message(Forwarded):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None


class JsonSchemaFormat(Forwarded):
    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, schema: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        size = len(json.dumps(schema)) if schema is not None else 0
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{size} characters, over the limit of {MAX_GRAMMAR_CHARS}")
        return schema


class ResponseFormat(Forwarded):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class ChatBody(OpenAISampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[NewTokens] = None
    max_completion_tokens: Optional[NewTokens] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[TopLogprobs] = None
    response_format: Optional[ResponseFormat] = None


def unlisted_fields(value: Any, path: str = "") -> list[str]:
    """The dotted paths of every field no model along `value` lists."""
    if isinstance(value, list):
        return [found for index, item in enumerate(value) for found in unlisted_fields(item, f"{path}{index}.")]
    if not isinstance(value, BaseModel):
        return []
    found = [f"{path}{key}" for key in value.model_extra or {}]
    for name in type(value).model_fields:
        found += unlisted_fields(getattr(value, name), f"{path}{name}.")
    return found


def _field_path(loc: tuple[Any, ...]) -> str:
    # pydantic names the union member it tried ("str", "list[int]", "SamplingParams") in the
    # location: only field names and list indices name the field.
    return ".".join(str(part) for part in loc
                    if isinstance(part, int) or (part.isidentifier() and part[:1].islower()
                                                 and part not in ("str", "int", "bool", "float")))


def validation_message(exc: ValidationError) -> str:
    """The most specific of pydantic's errors, naming its field: of a union's members, one whose
    type was right but a bound was broken, else the one that got furthest."""
    error = max(exc.errors(), key=lambda e: (not e["type"].endswith("_type"), len(e["loc"])))
    return f"{_field_path(error['loc'])}: {error['msg'].removeprefix('Value error, ')}"


Body = TypeVar("Body", bound=Forwarded)


def parse_forwarded(body_type: type[Body], payload: dict[str, Any],
                    limits: ForwardLimits) -> tuple[Optional[Body], Optional[str]]:
    """(`payload` parsed as `body_type`, None), or (None, why it is refused, naming the field)."""
    try:
        body = body_type.model_validate(payload, context={"context_length": limits.context_length})
    except ValidationError as exc:
        return None, validation_message(exc)
    unlisted = [] if limits.pass_unlisted else unlisted_fields(body)
    if unlisted:
        return None, f"{unlisted[0]}: {UNLISTED_HINT}"
    refused = body.refusal()
    return (None, refused) if refused else (body, None)
