"""What the engine takes from a client: the shared chunk cache's trust boundary.

Any client that reaches the runtime can send `kv_hints`, `extra_key` and token ids, and the
chunk cache is shared by every client. So the engine itself (not only the frontend) holds:

* token ids lie in the model's vocabulary (an id beyond it, or beyond int64, would take the
  scheduler down);
* tree namespaces starting with ``picrag:`` are picrag's own: a client's `extra_key` that
  starts so is moved to a namespace of its own (`client_namespace`), so a client request can
  never write into the chunk store or a policy's linked prompts;
* a picrag action is admitted only as picrag itself sends it (`admitted_link`): a plain token
  prompt; a compile only into the shared store (no client namespace, cache salt or LoRA) and
  generating nothing; a reordered layout only for a family that reorders, with chunks; the sink
  token only the model's own; a tail only of the model's token ids; a family only where the attention backend can run it and the
  model allows it (picrag_core.model_support: sliding windows, latent attention, RoPE variants).

Every form of `kv_hints` reaches the same check, once per request: SGLang splits a batch (one
envelope for all prompts, or a list of one per prompt), and each prompt is admitted as the
scheduler queues it (sglang_patches.tree.link_admission), which every request reaches, from the
HTTP server or not; one the engine does not admit is refused there with SGLang's own abort and
a 400. The tokenizer manager's per-request validation (`register`) holds the bounds that keep one
request from stopping the engine (token ids, sampling fields: picrag_core.request_bounds).

What an admitted link may still choose (its token order, spans, k, policy) changes only its own
answer: the tree key of a linked prompt binds everything its cached KV depends on
(sglang_patches.plan.keys), so no admitted request can leave KV that another request would read
as its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from picrag_core.attention_backends import backend_refusal
from picrag_core.link_hints import REORDERED_LAYOUT, LinkHintError, LinkRequest, parse_link_request
from picrag_core.model_support import ModelTraits, model_refusals
from picrag_core.request_bounds import check_request as check_sampling, check_token_ids, vocabulary_error

HOOK_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
@dataclass(frozen=True)
class RequestShape:
    """What the admission of a picrag action looks at, read off SGLang's request objects."""

    prompt_len: int
    max_new_tokens: Optional[int]  # None: SGLang's default (128)
    namespaced: bool  # the client set an extra_key, a cache salt or a LoRA adapter
    other_inputs: tuple[str, ...] = ()  # set fields that make the KV more than the prompt's tokens


@dataclass(frozen=True)
class EngineSettings:
    """What admission needs to know of the engine."""

    sink_token: Optional[int]  # the model's BOS
    attention_backend: Optional[str]
    model_refusals: Mapping[str, str] = field(default_factory=dict)  # family -> why the model forbids it
    vocab_size: Optional[int] = None  # a link's tail is token ids of this vocabulary (None: not checked)

    @classmethod
    def of(cls, sink_token: Optional[int], attention_backend: Optional[str], model_config) -> EngineSettings:
        """`model_config`: SGLang's ModelConfig of the served model (its transformers config and
        the context it is served with)."""
        traits = ModelTraits.of_config(model_config.hf_config.to_dict(), model_config.context_len)
        return cls(sink_token, attention_backend, model_refusals(traits), model_config.vocab_size)


def admitted_link(kv_hints: Any, shape: RequestShape, engine: EngineSettings) -> Optional[LinkRequest]:
    """The picrag action of a request as the engine serves it (None: a vanilla request);
    LinkHintError for one the engine does not admit."""
    link = parse_link_request(kv_hints)
    if link is None:
        return None
    if shape.other_inputs:
        raise LinkHintError(f"picrag actions link a plain token prompt; {shape.other_inputs[0]} is set")
    if link.compile:
        # The chunk store is read by every request of every client: only a chunk computed
        # alone, by prefill, from its tokens, goes in.
        if shape.namespaced:
            raise LinkHintError("picrag.compile stores into the shared chunk store: no extra_key, "
                                "cache_salt or LoRA adapter")
        if shape.max_new_tokens is None or shape.max_new_tokens > 1:
            raise LinkHintError("picrag.compile generates nothing: send max_new_tokens 0 or 1")
        return link
    refusal = backend_refusal(link.family, engine.attention_backend) or engine.model_refusals.get(link.family.name)
    if refusal:
        raise LinkHintError(f"{link.policy} cannot run on this engine: {refusal}")
    sink_token = engine.sink_token
    if link.family.sink_tokens:
        if sink_token is None:
            raise LinkHintError(f"{link.policy} compiles chunks behind the model's BOS, and this model has none")
        if link.sink_token not in (None, sink_token):
            raise LinkHintError(f"sink_token is the model's BOS ({sink_token}), got {link.sink_token}")
        link = dataclasses.replace(link, sink_token=sink_token)
    link.validate(shape.prompt_len)
    # A tail's ids key the chunk store and reach the repair network's embedding, as prompt ids do.
    tail_error = None if engine.vocab_size is None else vocabulary_error(link.tail, engine.vocab_size, "tail")
    if tail_error:
        raise LinkHintError(tail_error)
    if link.family.reordered_layout and link.chunks and link.layout != REORDERED_LAYOUT:
        raise LinkHintError(f"{link.policy} prompts must arrive reordered (link_hints.runtime_request)")
    return link


# ---- the scheduler's requests (sglang.srt.managers.schedule_batch.Req) -------------------

_REQ_OTHER_INPUTS = ("input_embeds", "positional_embed_overrides", "multimodal_inputs", "token_type_ids", "session")


def shape_of_req(req) -> RequestShape:
    """`req` as it reaches the tree cache, before picrag namespaces its extra_key."""
    sampling = getattr(req, "sampling_params", None)
    return RequestShape(
        prompt_len=len(req.origin_input_ids),
        max_new_tokens=getattr(sampling, "max_new_tokens", None),
        # SGLang appends a LoRA adapter's id to extra_key.
        namespaced=bool(req.extra_key or getattr(req, "cache_salt", None)),
        other_inputs=tuple(name for name in _REQ_OTHER_INPUTS if getattr(req, name, None) is not None),
    )


# ---- the tokenizer manager's requests (GenerateReqInput, one prompt) -----------------------

def check_request(manager, obj, input_ids, *args, **kwargs) -> None:
    """BEFORE hook on TokenizerManager._validate_one_request: a ValueError is SGLang's 400. The
    bounds that keep one request from stopping the engine; a picrag hint is admitted later, once,
    where every request arrives (sglang_patches.tree.link_admission)."""
    contains_mm = getattr(obj, "contains_mm_input", None)
    if input_ids is not None and not (contains_mm and contains_mm()):
        # Multimodal prompts carry pad values above the vocabulary.
        check_token_ids(input_ids, manager.model_config.vocab_size)
    check_sampling(obj, input_ids)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, check_request, HookType.BEFORE)
