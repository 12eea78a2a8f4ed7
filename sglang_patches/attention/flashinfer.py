"""picrag's CUDA attention backend: SGLang's FlashInfer backend, plus extends masked by true position.

LegoLink's link tokens and CacheBlend's kept rows sit inside the prompt, so their queries must
see the row entries whose *true* position is not after theirs, not a prefix of the row
(sglang_patches.attention.masks). SGLang's FlashInfer backend plans one causal paged/ragged
prefill per batch before the forward; it cannot express that, and CacheBlend shrinks the batch
after the plan. So an extend batch that carries either annotation runs, per request,
FlashInfer's single-request prefill over the request's gathered K/V with a custom mask
(plain causal for the batch's unannotated requests). Every other batch, and every decode, is
SGLang's stock FlashInfer path, untouched.

Importable without CUDA or FlashInfer (SGLang guards its own FlashInfer import); the kernel is
looked up on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Optional

import torch

from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_patches.attention.native import gather_kv
from picrag_core.attention_backends import FLASHINFER_BACKEND
from sglang_patches.plan.link_state import AttentionReport
from sglang_patches.steps.context_attention import accumulate
from sglang_patches.steps.forward_annotations import annotations_of
from sglang_patches.attention.masks import position_mask

BACKEND_NAME = FLASHINFER_BACKEND
# The contract of flashinfer.single_prefill_with_kv_cache (NHD layout): q [q_len, Hq, D],
# k/v [kv_len, Hkv, D]; custom_mask [q_len, kv_len] bool, True = attend; causal aligns the
# queries with the last q_len keys.
PrefillKernel = Callable[..., torch.Tensor]


def flashinfer_prefill() -> PrefillKernel:
    from flashinfer import single_prefill_with_kv_cache

    return single_prefill_with_kv_cache


def position_masked_extend(
    query: torch.Tensor,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
    rows: Sequence[torch.Tensor],
    extend_lens: Sequence[int],
    true_positions: Mapping[int, torch.Tensor],
    query_positions: Mapping[int, torch.Tensor],
    prefill: PrefillKernel,
    attention: Optional[Mapping[int, AttentionReport]] = None,
    *,
    sm_scale: float,
    logits_soft_cap: Optional[float] = None,
    window_left: int = -1,
) -> torch.Tensor:
    """Attention of a batch's extend queries [tokens, Hq, D] over each request's row of KV slots.

    Annotated requests attend under their position mask (sliding windows are not applied to
    them, as in picrag_native); the others attend causally, aligned to the row's end. Requests
    in `attention` have their question's attention summed (sglang_patches.steps.context_attention)."""
    output = torch.empty_like(query)
    start = 0
    for index, (slots, q_len) in enumerate(zip(rows, extend_lens)):
        end = start + q_len
        key, value = gather_kv(key_buffer, value_buffer, slots, query.dtype)
        mask = position_mask(
            q_len, len(slots), true_positions.get(index), query_positions.get(index), query.device
        )
        output[start:end] = prefill(
            query[start:end], key, value,
            custom_mask=mask, causal=mask is None, sm_scale=sm_scale,
            window_left=window_left if mask is None else -1, logits_soft_cap=logits_soft_cap,
        )
        if attention and index in attention:
            accumulate(attention[index], query[start:end].movedim(0, 1), key, sm_scale, mask,
                       torch.arange(len(slots) - q_len, len(slots), device=query.device))
        start = end
    return output


class PositionMaskedFlashInferBackend(FlashInferAttnBackend):
    def __init__(self, model_runner, **kwargs):
        super().__init__(model_runner, **kwargs)
        # The base class runs these checks only for its own exact class.
        if model_runner.prefill_attention_backend_str == BACKEND_NAME:
            self._check_kv_attention_access("prefill", self.prefill_kv_access)
        if model_runner.decode_attention_backend_str == BACKEND_NAME:
            self._check_kv_attention_access("decode", self.decode_kv_access)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        annotations = annotations_of(forward_batch)
        if not annotations or layer.is_cross_attention:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if self.prefill_uses_dequant_workspace:
            raise NotImplementedError(
                f"{BACKEND_NAME}: position-masked extends (legolink, cacheblend) do not support a quantized KV cache"
            )
        if save_kv_cache and k is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer,
                KVWriteLoc.for_layer(forward_batch, layer, swa_loc=self.forward_metadata.swa_out_cache_loc),
                k, v, *self._kv_write_scales(layer),
            )
        req_to_token = self.req_to_token_pool.req_to_token
        rows = [
            req_to_token[pool_index, :kv_len]
            for pool_index, kv_len in zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist())
        ]
        window = layer.sliding_window_size
        output = position_masked_extend(
            q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            rows, forward_batch.extend_seq_lens.tolist(), annotations.true_positions, annotations.query_positions,
            flashinfer_prefill(), annotations.attention,
            sm_scale=layer.scaling, logits_soft_cap=layer.logit_cap or None,
            window_left=window if window is not None else -1,
        )
        return output.view(-1, layer.tp_q_head_num * layer.head_dim)


def create_backend(runner) -> PositionMaskedFlashInferBackend:
    if runner.use_mla_backend:
        raise ValueError(f"--attention-backend {BACKEND_NAME} serves MHA/GQA models only, not MLA")
    return PositionMaskedFlashInferBackend(runner, init_new_workspace=runner.init_new_workspace)


def register() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(create_backend)
