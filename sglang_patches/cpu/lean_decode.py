"""A decode step on CPU without SGLang's per-layer boundary objects: the same arithmetic, fewer ops.

SGLang's Llama and Qwen2 models hand every layer's input and output through stage boundaries
(``attn_boundary``/``ffn_boundary``, a residual stream on the forward batch) built for tensor,
pipeline and data parallelism, LoRA and fused quantised norms, and its linear layers look up
parallel groups and enter a symmetric-memory context on every call. None of that applies to one
CPU process, but on a decode step, one token per request, that Python is paid per layer while
the arithmetic is small, and a plain transformers loop pays none of it. On a decode batch of a
single-process float32 model this hook runs the model's own modules in the order the boundaries
would (embedding; per layer: add-and-norm, attention, add-and-norm, MLP; final add-and-norm),
with the RMSNorm written out as SGLang's forward_native computes it and the unquantised
projections as the F.linear that SGLang's linear layers end in, so the result is bit for bit
SGLang's. RoPE, attention and the activation stay SGLang's modules. Every other batch (prefill,
CacheBlend's, parallel or LoRA runs, other dtypes or quantisations, any capture of hidden
states) runs SGLang's own forward.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

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


def _plain_linear(linear) -> bool:
    """A linear layer whose forward, in one process, is F.linear(x, weight, bias)."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    return (type(linear.quant_method) is UnquantizedLinearMethod and not getattr(linear, "use_intel_amx_backend", False)
            and not linear.skip_bias_add and linear.weight.dtype == torch.float32)


def _plain_layer(layer) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    return (_plain_norm(layer.input_layernorm) and _plain_norm(layer.post_attention_layernorm)
            and all(_plain_linear(linear) for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            and mlp.dual_gemm.mode is None and not mlp.activation_quant.enabled)


def applies(model, input_ids: torch.Tensor, forward_batch, input_embeds, pp_proxy_tensors) -> bool:
    """Cached per model: everything that does not change between steps."""
    plain = getattr(model, "_picrag_lean_decode", None)
    if plain is None:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        plain = (parallel.tp_size == 1 and parallel.pp_size == 1 and parallel.dp_size == 1 and not _rl_on_policy()
                 and not model.layers_to_capture and model.embed_tokens.weight.device.type == "cpu"
                 and model.embed_tokens.weight.dtype == torch.float32
                 and _plain_norm(model.norm) and all(_plain_layer(layer) for layer in _layers(model)))
        model._picrag_lean_decode = plain
        logger.info("picrag lean decode %s for %s", "on" if plain else "off (not a one-process float32 CPU model)",
                    type(model).__name__)
    return (plain and input_embeds is None and pp_proxy_tensors is None and input_ids.shape[0] > 0
            and forward_batch.forward_mode.is_decode() and not _has_lora(forward_batch))


def _rl_on_policy() -> bool:
    """SGLang's RL on-policy mode, where Qwen2's MLP computes in bfloat16."""
    from sglang.srt.runtime_context import get_exec

    return get_exec().deterministic.rl_on_policy_target is not None


def _layers(model):
    # Indexed, as SGLang's own loop does: slicing a ModuleList builds a new one every forward.
    return (model.layers[index] for index in range(model.start_layer, model.end_layer))


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
    for layer in _layers(model):
        hidden_states, residual = _add_norm(layer.input_layernorm, hidden_states, residual)
        hidden_states = _attention(layer.self_attn, positions, hidden_states, forward_batch)
        hidden_states, residual = _add_norm(layer.post_attention_layernorm, hidden_states, residual)
        mlp = layer.mlp
        hidden_states = _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_up_proj, hidden_states)))
    return _add_norm(model.norm, hidden_states, residual)[0]


def _linear(linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, linear.weight, linear.bias)


def _attention(attn, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
    """LlamaAttention's and Qwen2Attention's forward on CPU, with the projections as _linear."""
    q, k, v = _linear(attn.qkv_proj, hidden_states).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = attn.rotary_emb(positions, q, k)
    return _linear(attn.o_proj, attn.attn(q, k, v, forward_batch))


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target in HOOK_TARGETS:
        HookRegistry.register(target, forward, HookType.AROUND)
