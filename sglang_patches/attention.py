"""picrag's CPU attention backend: SGLang's torch_native backend, extend computed on real queries only.

`TorchNativeAttnBackend._run_sdpa_forward_extend` pads each request's query to the whole
sequence and runs causal SDPA over all of it, so an extend costs O(seq_len^2) however much of
the prefix is cached (measured: a prompt with everything but the question cached still took
40% of a cold prefill). Here each request's extend queries attend to the row's gathered K/V
with a causal mask offset by the prefix length: O(extend_len * seq_len). Both extend and decode
gather a request's K/V with index_select, about 3x faster than tensor indexing on CPU (the
gather was a fifth of vanilla's decode step).

On CUDA picrag uses FlashInfer (sglang_patches.flashinfer_attention), whose paged prefill
already computes only the extend rows.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_patches.position_masks import batch_annotations, position_mask

BACKEND_NAME = "picrag_native"


def offset_causal_mask(
    q_len: int, kv_len: int, device: torch.device, sliding_window: Optional[int] = None
) -> torch.Tensor:
    """Query i sits at position kv_len - q_len + i and sees keys at positions <= its own."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None and sliding_window > -1:
        mask &= k_pos >= q_pos - sliding_window
    return mask


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype):
    """A request's K and V as [tokens, heads, dim]; index_select is ~3x faster than indexing."""
    key, value = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
    if key.dtype != dtype:
        key, value = key.to(dtype), value.to(dtype)
    return key, value


def attend_row(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: Optional[float],
    enable_gqa: bool,
    mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """One request's queries ([heads, queries, dim]) attending to its row, the K/V at `slots`;
    the output is [queries, heads, dim], the layout of the backend's output rows."""
    key, value = gather_kv(k_cache, v_cache, slots, query.dtype)
    out = scaled_dot_product_attention(
        query.unsqueeze(0), key.movedim(0, 1).unsqueeze(0), value.movedim(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
    )
    return out.squeeze(0).movedim(0, 1)


class QueryOnlyTorchNativeBackend(TorchNativeAttnBackend):
    # Per batch index: the true position of every row entry (reordered LegoLink prompts) and
    # the positions of the queries when they are not the row's last entries (CacheBlend).
    _true_positions: dict[int, torch.Tensor] = {}
    _query_positions: dict[int, torch.Tensor] = {}

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._true_positions, self._query_positions = batch_annotations(forward_batch)
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def _run_sdpa_forward_extend(
        self,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_prefix_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        encoder_lens: Optional[torch.Tensor] = None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size: Optional[int] = None,
    ):
        if encoder_lens is not None or not causal:
            return super()._run_sdpa_forward_extend(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa,
                causal, is_cross_attn, sliding_window_size,
            )
        # [tokens, heads, dim] -> [heads, tokens, dim]
        query = query.movedim(0, 1)
        start_q = 0
        for seq_idx in range(seq_lens.shape[0]):
            q_len = int(extend_seq_lens[seq_idx])
            kv_len = int(seq_lens[seq_idx])
            end_q = start_q + q_len
            slots = req_to_token[req_pool_indices[seq_idx], :kv_len]
            mask = position_mask(
                q_len, kv_len, self._true_positions.get(seq_idx), self._query_positions.get(seq_idx), query.device
            )
            if mask is not None:
                is_causal = False
            elif q_len == kv_len and (sliding_window_size is None or sliding_window_size < 0):
                mask, is_causal = None, True
            else:
                mask = offset_causal_mask(q_len, kv_len, query.device, sliding_window_size)
                is_causal = False
            output[start_q:end_q] = attend_row(
                query[:, start_q:end_q, :], k_cache, v_cache, slots, scaling, enable_gqa, mask, is_causal
            )
            start_q = end_q
        return output

    def _run_sdpa_forward_decode(
        self,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        encoder_lens: Optional[torch.Tensor] = None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size: Optional[int] = None,
    ):
        if encoder_lens is not None or (sliding_window_size is not None and sliding_window_size > -1):
            return super()._run_sdpa_forward_decode(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size,
            )
        query = query.movedim(0, 1)
        for seq_idx in range(seq_lens.shape[0]):
            slots = req_to_token[req_pool_indices[seq_idx], : int(seq_lens[seq_idx])]
            output[seq_idx : seq_idx + 1] = attend_row(
                query[:, seq_idx : seq_idx + 1, :], k_cache, v_cache, slots, scaling, enable_gqa
            )
        return output


def register() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(QueryOnlyTorchNativeBackend)
