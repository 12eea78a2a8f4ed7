"""picrag's CPU attention backend: SGLang's torch_native backend, extend computed on real queries only.

`TorchNativeAttnBackend._run_sdpa_forward_extend` pads each request's query to the whole
sequence and runs causal SDPA over all of it, so an extend costs O(seq_len^2) however much of
the prefix is cached (measured: a prompt with everything but the question cached still took
40% of a cold prefill). Here each request's extend queries attend to the row's gathered K/V
with a causal mask offset by the prefix length: O(extend_len * seq_len). Extend gathers a
request's K/V with index_select, about 3x faster than tensor indexing on CPU. Decode keeps each
running request's K/V contiguous from one step to the next (`DecodeRows`) and copies only the
new token's: gathering the whole row at every step was about a quarter of a decode step. The
rows are stored heads first, and a decode query's heads attend grouped by their KV head
(`attend_decode`), which halved SDPA's time per decode row.

On CUDA picrag uses FlashInfer (sglang_patches.attention.flashinfer), whose paged prefill
already computes only the extend rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from picrag_core.attention_backends import NATIVE_BACKEND
from sglang_patches.steps.context_attention import accumulate
from sglang_patches.steps.forward_annotations import ForwardAnnotations, annotations_of
from sglang_patches.attention.masks import position_mask

BACKEND_NAME = NATIVE_BACKEND


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
    key: torch.Tensor,
    value: torch.Tensor,
    scale: Optional[float],
    enable_gqa: bool,
    mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """One request's queries ([heads, queries, dim]) attending to its row's K/V ([tokens, heads,
    dim]); the output is [queries, heads, dim], the layout of the backend's output rows."""
    out = scaled_dot_product_attention(
        query.unsqueeze(0), key.movedim(0, 1).unsqueeze(0), value.movedim(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
    )
    return out.squeeze(0).movedim(0, 1)


def attend_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """One decoding request's query ([heads, dim]) attending to all of its row's K/V ([kv heads,
    tokens, dim]); the output is [heads, dim]. A single query sees every key, so the query heads
    that share a KV head attend as that head's queries: no GQA expansion, and SDPA reads each KV
    head once from a [kv heads, tokens, dim] row (about half the time of a [tokens, kv heads,
    dim] row with `enable_gqa`, measured on CPU). Query head h uses KV head h // group, as in
    SDPA's `enable_gqa`."""
    heads, dim = query.shape
    kv_heads = key.shape[0]
    out = scaled_dot_product_attention(query.reshape(1, kv_heads, heads // kv_heads, dim), key.unsqueeze(0),
                                       value.unsqueeze(0), scale=scale)
    return out.reshape(heads, dim)


@dataclass
class _Row:
    slots: torch.Tensor  # [capacity]: the pool slots whose K/V the buffers hold, in row order
    keys: torch.Tensor  # [kv heads, capacity, dim]: the layout attend_decode reads fastest
    values: torch.Tensor
    length: int


class DecodeRows:
    """Each decoding request's K/V, per layer, in one contiguous buffer kept between decode steps.

    A row is gathered from the pool once and then grows by the slots that are new at each step
    (one token's). The slots a row holds are compared with the request's slots at every step, and
    a row whose slots differ is gathered again. A request slot's rows are dropped when it is
    extended (`forget`): a new request in the same request slot always starts with an extend, and
    its slots may be ones the previous request freed, with new K/V in them. Rows of requests that
    are not in a decode batch are dropped (`keep_only`), so at most the running requests' K/V is
    held twice: outside SGLang's pool accounting, but never more than the pool's size plus each
    row's growth margin (a quarter, at least 64 tokens).
    """

    def __init__(self) -> None:
        self._rows: dict[int, dict[int, _Row]] = {}  # request slot -> layer id -> row

    def __len__(self) -> int:
        return sum(len(layers) for layers in self._rows.values())

    def request_slots(self) -> list[int]:
        return sorted(self._rows)

    def forget(self, request_slots: list[int]) -> None:
        for request_slot in request_slots:
            self._rows.pop(request_slot, None)

    def keep_only(self, request_slots: list[int]) -> None:
        kept = set(request_slots)
        self.forget([slot for slot in self._rows if slot not in kept])

    def kv(self, request_slot: int, layer_id: int, slots: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V at `slots` as [kv heads, tokens, dim] views: `gather_kv`'s, heads first."""
        n = len(slots)
        layers = self._rows.setdefault(request_slot, {})
        row = layers.get(layer_id)
        if row is None or not (row.length <= n <= len(row.slots)
                               and torch.equal(row.slots[: row.length], slots[: row.length])):
            capacity = n + max(64, n // 4)
            kv_heads, dim = k_cache.shape[1:]
            row = _Row(slots.new_empty(capacity), k_cache.new_empty((kv_heads, capacity, dim), dtype=dtype),
                       v_cache.new_empty((kv_heads, capacity, v_cache.shape[2]), dtype=dtype), 0)
            layers[layer_id] = row
        if n > row.length:
            new = slots[row.length :]
            keys, values = gather_kv(k_cache, v_cache, new, dtype)
            row.keys[:, row.length : n], row.values[:, row.length : n] = keys.movedim(0, 1), values.movedim(0, 1)
            row.slots[row.length : n] = new
            row.length = n
        return row.keys[:, :n], row.values[:, :n]


class QueryOnlyTorchNativeBackend(TorchNativeAttnBackend):
    # The extend batch's annotations (sglang_patches.steps.forward_annotations): per batch index, the
    # true position of every row entry (reordered prompts), the positions of the queries when
    # they are not the row's last entries (CacheBlend), the question's attention sums.
    _annotations = ForwardAnnotations()

    _decode_layer: Optional[int] = None  # the layer of the decode forward running now
    _last_decode_layer: int = -1  # layer ids rise within a forward: a lower or equal one starts the next

    @property
    def decode_rows(self) -> DecodeRows:
        if "_decode_rows" not in self.__dict__:
            self._decode_rows = DecodeRows()
        return self._decode_rows

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._annotations = annotations_of(forward_batch) or ForwardAnnotations()
        self.decode_rows.forget(forward_batch.req_pool_indices.tolist())
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if layer.layer_id <= self._last_decode_layer:  # a new decode step
            self.decode_rows.keep_only(forward_batch.req_pool_indices.tolist())
        self._last_decode_layer = self._decode_layer = layer.layer_id
        try:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        finally:
            self._decode_layer = None

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
        annotations = self._annotations
        start_q = 0
        for seq_idx in range(seq_lens.shape[0]):
            q_len = int(extend_seq_lens[seq_idx])
            kv_len = int(seq_lens[seq_idx])
            end_q = start_q + q_len
            slots = req_to_token[req_pool_indices[seq_idx], :kv_len]
            mask = position_mask(
                q_len, kv_len, annotations.true_positions.get(seq_idx), annotations.query_positions.get(seq_idx),
                query.device,
            )
            if mask is not None:
                is_causal = False
            elif q_len == kv_len and (sliding_window_size is None or sliding_window_size < 0):
                mask, is_causal = None, True
            else:
                mask = offset_causal_mask(q_len, kv_len, query.device, sliding_window_size)
                is_causal = False
            key, value = gather_kv(k_cache, v_cache, slots, query.dtype)
            output[start_q:end_q] = attend_row(
                query[:, start_q:end_q, :], key, value, scaling, enable_gqa, mask, is_causal
            )
            report = annotations.attention.get(seq_idx)
            if report is not None:
                accumulate(report, query[:, start_q:end_q, :], key, scaling, mask,
                           torch.arange(kv_len - q_len, kv_len, device=query.device))
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
        for seq_idx in range(seq_lens.shape[0]):
            request_slot = int(req_pool_indices[seq_idx])
            slots = req_to_token[request_slot, : int(seq_lens[seq_idx])]
            if self._decode_layer is None:  # called outside forward_decode: no layer to keep rows for
                key, value = (t.movedim(0, 1) for t in gather_kv(k_cache, v_cache, slots, query.dtype))
            else:
                key, value = self.decode_rows.kv(request_slot, self._decode_layer, slots, k_cache, v_cache, query.dtype)
            output[seq_idx] = attend_decode(query[seq_idx], key, value, scaling)
        return output


def register() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(QueryOnlyTorchNativeBackend)
