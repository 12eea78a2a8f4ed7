"""A decode step on CPU without SGLang's per-layer boundary objects: the same arithmetic, fewer ops.

SGLang's Llama and Qwen2 models hand every layer's input and output through stage boundaries
(``attn_boundary``/``ffn_boundary``, a residual stream on the forward batch) built for tensor,
pipeline and data parallelism, LoRA and fused quantised norms. None of that applies to one CPU
process, but on a decode step, one token per request, the boundaries' Python costs more than the
layer's arithmetic: about 60 us a layer, a tenth of a SmolLM2 token, next to a plain transformers
loop that has none of it. On a decode batch of a single-process float32 model this hook runs the
model's own modules in the order the boundaries would (embedding; per layer: add-and-norm,
attention, add-and-norm, MLP; final add-and-norm), with the RMSNorm written out as SGLang's
forward_native computes it, so the result is bit for bit SGLang's. Every other batch (prefill,
CacheBlend's, parallel or LoRA runs, other dtypes, any capture of hidden states) runs SGLang's
own forward.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

logger = logging.getLogger(__name__)

HOOK_TARGETS = (
    "sglang.srt.models.llama.LlamaModel.forward",
    "sglang.srt.models.qwen2.Qwen2Model.forward",
)


def _plain_norm(norm) -> bool:
    """An RMSNorm whose forward_native is x * rsqrt(mean(x^2) + eps) * weight in float32."""
    return (getattr(norm, "has_weight", False) and norm.variance_size_override is None
            and not norm.cast_x_before_out_mul and not norm.fp32_residual and norm.override_orig_dtype is None
            and norm.weight.dtype == torch.float32)


def applies(model, input_ids: torch.Tensor, forward_batch, input_embeds, pp_proxy_tensors) -> bool:
    """Cached per model: everything that does not change between steps."""
    plain = getattr(model, "_picrag_lean_decode", None)
    if plain is None:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        plain = (parallel.tp_size == 1 and parallel.pp_size == 1 and parallel.dp_size == 1
                 and not model.layers_to_capture and model.embed_tokens.weight.device.type == "cpu"
                 and model.embed_tokens.weight.dtype == torch.float32
                 and all(_plain_norm(norm) for norm in _norms(model)))
        model._picrag_lean_decode = plain
        logger.info("picrag lean decode %s for %s", "on" if plain else "off (not a one-process float32 CPU model)",
                    type(model).__name__)
    return (plain and input_embeds is None and pp_proxy_tensors is None and input_ids.shape[0] > 0
            and forward_batch.forward_mode.is_decode() and not _has_lora(forward_batch))


def _norms(model):
    yield model.norm
    for layer in model.layers[model.start_layer:model.end_layer]:
        yield layer.input_layernorm
        yield layer.post_attention_layernorm


def _has_lora(forward_batch) -> bool:
    return any(lora_id is not None for lora_id in (getattr(forward_batch, "lora_ids", None) or ()))


def _add_norm(norm, x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) with forward_native's float32 ops in its order."""
    if residual is not None:
        x = x + residual
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(variance + norm.variance_epsilon) * norm.weight, x


def forward(original, model, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
            input_embeds: Optional[torch.Tensor] = None, pp_proxy_tensors=None):
    if not applies(model, input_ids, forward_batch, input_embeds, pp_proxy_tensors):
        return original(model, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
    hidden_states, residual = model.embed_tokens(input_ids), None
    for layer in model.layers[model.start_layer:model.end_layer]:
        hidden_states, residual = _add_norm(layer.input_layernorm, hidden_states, residual)
        hidden_states = layer.self_attn(positions=positions, hidden_states=hidden_states, forward_batch=forward_batch)
        hidden_states, residual = _add_norm(layer.post_attention_layernorm, hidden_states, residual)
        hidden_states = layer.mlp(hidden_states, forward_batch=forward_batch)
    return _add_norm(model.norm, hidden_states, residual)[0]


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target in HOOK_TARGETS:
        HookRegistry.register(target, forward, HookType.AROUND)
