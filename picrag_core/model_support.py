"""Which link policies a model can be served with exactly, read from its HF config.

Chunk reuse rests on three facts about the model: a token's cached KV depends only on the
tokens before it in its chunk (and on its position only through RoPE), RoPE is one rotation
per position whatever the prompt's length (so a cached key moves by one more rotation), and
every layer attends to every earlier token (so a linked chunk is seen whole). A model whose
config breaks one of them gets its chunk-reusing families refused, with the reason, by the
engine (sglang_patches.guard.request_guard) and the frontend (rag_server/linking/policy_resolver.py)
alike; `prefix` and `full` are SGLang's own and stay. What is read:

* sliding-window layers (Mistral v0.1, Phi-3-mini-4k, Gemma 2/3, some Qwen2 configs) narrower
  than the served context: a reused chunk's tokens would be attended from beyond the window
  (served with a context no wider than the window, the window never drops a token and every
  family is exact);
* multi-head latent attention (DeepSeek V2/V3, Kimi K2: `kv_lora_rank`): the cache holds a
  latent, not post-RoPE keys that a rotation moves;
* ALiBi or no rotary embedding at all: position enters as a bias, nothing to re-rotate;
* LongRoPE (Phi-3.5, Phi-4-mini) and multimodal RoPE: the rotation depends on the prompt's
  length or on several position axes, not on one position;

Some models the runtime itself would compute wrongly, whatever the policy; `picrag serve`
refuses them at start (picrag_core.attention_backends.model_backend_refusal): attention logit
soft-capping (Gemma 2) on a backend that does not cap, routed experts on CPU (SGLang's CPU MoE
answers zeros without sgl-kernel's ops), a partial rotary factor that SGLang's Llama classes
do not see, and a sliding window narrower than the served context on an SGLang class that
attends over the whole context instead (`runtime_refusal`).

CacheBlend runs inside the decoder layers (sglang_patches.steps.cacheblend), whose hook covers the
architectures in BLEND_ARCHITECTURES; for others it steps aside and `cacheblend` is refused.
The families picrag's test matrix serves (tests/test_model_matrix.py) are TESTED_ARCHITECTURES;
another architecture is served on what its config says, with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from picrag_core.policies import POLICY_FAMILIES, PolicyFamily

# SGLang 0.5.23 serves these with the decoder layers that CacheBlend's hook wraps (Mistral and
# Phi-3 are SGLang's Llama classes; Qwen3's layer hands rows on through the same residual stream).
BLEND_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
})
# Served by tests/test_model_matrix.py on tiny random-weight models, every policy checked.
TESTED_ARCHITECTURES = BLEND_ARCHITECTURES | frozenset({"Olmo2ForCausalLM", "GraniteForCausalLM"})
# SGLang's Llama classes read partial_rotary_factor from the config's top level, where
# transformers 5 no longer puts it (it lives in rope_parameters): they would rotate the whole head.
_TOP_LEVEL_PARTIAL_ROTARY = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM"})
# SGLang 0.5.23's classes for these build their attention without the config's sliding window:
# every layer attends over the whole context (tests/test_sglang_seams.py reads their modules).
WINDOW_BLIND_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Starcoder2ForCausalLM",
})
# RoPE variants whose table is one rotation per position (YaRN's constant magnitude scale is
# divided out by picrag_core.rope_shift).
POSITIONAL_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "llama3", "yarn"})
_ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt", "baichuan"})
_NO_ROPE_MODEL_TYPES = frozenset({"gpt2", "opt", "gpt_bigcode"})
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class ModelTraits:
    """What of a model's config decides which policies it can be served with."""

    architecture: str
    model_type: str
    context_length: Optional[int]  # as served
    # The narrowest window of a layer that has one, when narrower than the served context
    # (None: no layer ever drops a token)
    sliding_window: Optional[int]
    attention_softcap: Optional[float]
    latent_attention: bool  # MLA
    alibi: bool
    rope_type: Optional[str]  # None: the model has no rotary embedding
    routed_experts: int = 0  # MoE: experts per layer (0: a dense model)
    nested_partial_rotary: bool = False  # partial_rotary_factor < 1 only inside rope_parameters

    @classmethod
    def of_config(cls, config: Mapping[str, Any], context_length: Optional[int] = None) -> ModelTraits:
        """From an HF config.json's fields (a PretrainedConfig's to_dict()); a multimodal
        config's language model is read from its `text_config`. `context_length`: the context
        the model is served with (SGLang's --context-length; None: the config's)."""
        text = config.get("text_config") or config
        architectures = config.get("architectures") or [""]
        model_type = str(text.get("model_type") or config.get("model_type") or "")
        configured = text.get("max_position_embeddings")
        context = context_length or (int(configured) if isinstance(configured, int) else None)
        return cls(
            architecture=str(architectures[0]),
            model_type=model_type,
            context_length=context,
            sliding_window=_sliding_window(text, context),
            attention_softcap=text.get("attn_logit_softcapping") or None,
            latent_attention=bool(text.get("kv_lora_rank")),
            alibi=bool(text.get("alibi") or text.get("use_alibi")) or model_type in _ALIBI_MODEL_TYPES,
            rope_type=_rope_type(text, model_type),
            routed_experts=int(next((text[name] for name in _EXPERT_FIELDS if text.get(name)), 0)),
            nested_partial_rotary=_nested_partial_rotary(text),
        )


def _nested_partial_rotary(text: Mapping[str, Any]) -> bool:
    params = text.get("rope_parameters")
    nested = params.get("partial_rotary_factor") if isinstance(params, Mapping) else None
    return nested is not None and nested < 1 and text.get("partial_rotary_factor") is None


def _sliding_window(text: Mapping[str, Any], context: Optional[int]) -> Optional[int]:
    window = text.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or text.get("use_sliding_window") is False:
        return None
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list) and "sliding_attention" not in layer_types:
        return None
    if context is not None and window >= context:
        return None  # a window as wide as the context never drops a token
    return window


def _rope_type(text: Mapping[str, Any], model_type: str) -> Optional[str]:
    if model_type in _NO_ROPE_MODEL_TYPES or text.get("position_embedding_type") in ("absolute", "alibi"):
        return None
    scaling = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(scaling, Mapping):
        return "default"
    if "mrope_section" in scaling or scaling.get("mrope_interleaved"):
        return "mrope"
    per_layer_type = [value for value in scaling.values() if isinstance(value, Mapping)]
    if per_layer_type:  # Gemma 3: one RoPE per layer type; the first that is no rotation decides
        types = [str(value.get("rope_type") or "default") for value in per_layer_type]
        return next((t for t in types if t not in POSITIONAL_ROPE_TYPES), types[0])
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def chunk_reuse_refusal(traits: ModelTraits) -> Optional[str]:
    """Why no chunk-reusing family can be served exactly on this model; None if they can."""
    if traits.latent_attention:
        return ("the model uses multi-head latent attention: its cache holds a compressed latent, "
                "not post-RoPE keys that a rotation moves to another position")
    if traits.alibi or traits.rope_type is None:
        return "the model has no rotary embedding (ALiBi or absolute positions): nothing re-positions a cached key"
    if traits.sliding_window is not None:
        return (f"the model has sliding-window layers ({traits.sliding_window} tokens, served context "
                f"{traits.context_length}): a reused chunk's KV would be attended from outside the window its "
                f"layers allow (served with --context-length {traits.sliding_window} or less, the window drops nothing)")
    if traits.rope_type not in POSITIONAL_ROPE_TYPES:
        return (f"its RoPE ({traits.rope_type}) is not one rotation per position (it depends on the prompt's "
                "length or on several position axes): a cached key cannot be moved by re-rotation")
    return None


def policy_refusal(family: PolicyFamily, traits: ModelTraits) -> Optional[str]:
    """Why `family` cannot be served exactly on this model; None if it can."""
    if not family.reuses_chunks:
        return None
    reason = chunk_reuse_refusal(traits)
    if reason is None and family.blends_chunks and traits.architecture not in BLEND_ARCHITECTURES:
        reason = (f"CacheBlend's layer hook covers {', '.join(sorted(BLEND_ARCHITECTURES))}, "
                  f"not {traits.architecture or 'this architecture'}")
    return reason


def model_refusals(traits: ModelTraits) -> dict[str, str]:
    """Policy family -> why this model cannot be served with it exactly."""
    return {name: reason for name, family in POLICY_FAMILIES.items()
            if (reason := policy_refusal(family, traits)) is not None}


def runtime_refusal(traits: ModelTraits) -> Optional[str]:
    """Why SGLang 0.5.23 itself would compute the model wrongly, whatever the policy; None if not."""
    if traits.nested_partial_rotary and traits.architecture in _TOP_LEVEL_PARTIAL_ROTARY:
        return ("its config puts partial_rotary_factor inside rope_parameters, and SGLang's "
                f"{traits.architecture} reads it from the top level: it would rotate the whole head "
                "(add \"partial_rotary_factor\" at the config's top level)")
    if traits.sliding_window is not None and traits.architecture in WINDOW_BLIND_ARCHITECTURES:
        return (f"SGLang's {traits.architecture} attends over the whole context, not the "
                f"{traits.sliding_window}-token sliding window its config names: prompts longer than the "
                f"window would be computed wrongly (serve it with --context-length {traits.sliding_window} "
                "or less, where the window never drops a token)")
    return None
