"""CacheBlend-r inside SGLang's forward: selective recompute of the chunk tokens that drift most.

A ``cacheblend`` request reaches the forward with its head as cached prefix and every other
token (chunks and question) as extend tokens, in the original order. Then, as in the CacheBlend
paper:

1. When the forward batch is built, each chunk token's extend slot receives the chunk's cached
   KV (looked up in the chunk store by content, keys rotated to the token's position) for the
   layers after the check layer, and the cached check-layer V is kept aside.
2. Layers 0 and 1 (``CHECK_LAYER``) run on every token, writing fresh KV for all of them.
3. After the check layer, chunk tokens are ranked by sum((V_fresh - V_cached)^2) over heads and
   dims; the top ``ratio`` of them, every non-chunk token (question, evicted chunks) and the
   request's last token stay. The batch is shrunk to those rows: hidden states (through the
   residual stream's handoff), positions, ``out_cache_loc`` and the extend lengths.
4. Later layers compute the kept rows only; they attend to the whole row, where dropped chunk
   tokens keep the cached KV written in step 1. The attention backend masks by position
   (the annotations' ``query_positions``), since the kept rows are scattered through the row.

The logits processor picks each request's last extend row from the shrunk lengths, so decoding
and other requests in the batch are untouched. Step 1 runs when the batch is made
(sglang_patches.steps.batch_annotations); steps 2-4 in an AROUND hook on the decoder layers of the
supported models (LAYER_HOOK_TARGETS).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_patches.plan.segments import ChunkSpan
from sglang_patches.steps.forward_annotations import annotations_of

logger = logging.getLogger(__name__)

CHECK_LAYER = 1

# The decoder layers that hand rows on through SGLang's residual stream, which `_shrink` folds;
# picrag_core.model_support.BLEND_ARCHITECTURES names the architectures built of them, and
# cacheblend is refused for any other (tests/test_sglang_seams.py holds the two together).
LAYER_HOOK_TARGETS = (
    "sglang.srt.models.llama.LlamaDecoderLayer.forward",
    "sglang.srt.models.qwen2.Qwen2DecoderLayer.forward",
    "sglang.srt.models.qwen3.Qwen3DecoderLayer.forward",
)


@dataclass
class BlendPlan:
    """One cacheblend request's blend, once its prefix is matched (it lives in the request's state)."""

    cache: object  # the ChunkRadixCache holding the chunks
    ratio: float
    sources: list[ChunkSpan]  # the chunks after the matched prefix (sglang_patches.plan.link_plan.blend_sources)
    stats: object  # the request's LinkStats


@dataclass
class _BlendRows:
    """One cacheblend request's extend rows in this forward batch."""

    batch_index: int
    candidates: torch.Tensor  # extend-row indices (within the request) that hold cached KV
    cached_v: torch.Tensor  # [candidates, heads, dim]: the cache's check-layer V
    ratio: float
    stats: object


@dataclass
class BlendState:
    kv_pool: object
    requests: list[_BlendRows]
    positions: Optional[torch.Tensor] = None  # the kept rows' positions, once shrunk


def select_rows(deviation: torch.Tensor, candidates: torch.Tensor, length: int, ratio: float,
                logprob_from: Optional[int] = None) -> torch.Tensor:
    """Extend-row indices computed after the check layer: the top `ratio` of candidates by
    deviation, every non-candidate row, the last row and every row from `logprob_from` on (the
    rows whose input log-probabilities the request asked for: only a computed row has one),
    ascending."""
    keep = torch.ones(length, dtype=torch.bool)
    keep[candidates] = False
    n_top = min(len(candidates), math.ceil(ratio * len(candidates)))
    if n_top:
        keep[candidates[torch.topk(deviation, n_top).indices]] = True
    keep[length - 1] = True
    if logprob_from is not None:
        keep[logprob_from:] = True
    return keep.nonzero().squeeze(1)


@torch.no_grad()
def prepare_blend(forward_batch, states: list) -> Optional[BlendState]:
    """Put the cached KV of the batch's cacheblend requests in place (step 1); `states`: the
    requests' link states (sglang_patches.plan.link_state), in batch order."""
    requests = []
    kv_pool = None
    starts = forward_batch.extend_start_loc.tolist()
    for index, state in enumerate(states):
        plan: Optional[BlendPlan] = None if state is None else state.blend
        if plan is None:
            continue
        kv_pool = plan.cache.kv_pool
        rows = _place_cached_kv(
            plan, forward_batch.extend_prefix_lens_cpu[index], forward_batch.extend_seq_lens_cpu[index],
            forward_batch.out_cache_loc[starts[index] : starts[index] + forward_batch.extend_seq_lens_cpu[index]],
        )
        if rows is not None:
            candidates, cached_v = rows
            requests.append(_BlendRows(index, candidates, cached_v, plan.ratio, plan.stats))
    return BlendState(kv_pool=kv_pool, requests=requests) if requests else None


def _place_cached_kv(plan: BlendPlan, prefix: int, length: int, extend_slots: torch.Tensor):
    cache = plan.cache
    pool = cache.kv_pool
    rows, sources, deltas = [], [], []
    with cache.held_chunks([source.stored for source in plan.sources]) as held:
        for source, slots in zip(plan.sources, held):
            lo, hi = max(source.start, prefix), min(source.end, prefix + length - 1)  # last row: always computed
            if lo >= hi or slots is None:  # None: evicted since the match, its tokens simply computed
                continue
            rows.append(torch.arange(lo - prefix, hi - prefix))
            sources.append(slots[lo - source.start : hi - source.start].to(torch.int64))
            deltas.append(torch.full((hi - lo,), source.start, dtype=torch.int64))
        plan.stats.chunk_hits = len(rows)
        plan.stats.chunk_misses = len(plan.sources) - len(rows)
        if not rows:
            return None
        rows_t, src, delta = torch.cat(rows), torch.cat(sources), torch.cat(deltas)
        dst = extend_slots[rows_t].to(torch.int64)
        cached_v = pool.get_value_buffer(pool.start_layer + CHECK_LAYER)[src].clone()
        if plan.ratio < 1.0:
            cache.copy_shifted(src, dst, delta, first_layer=CHECK_LAYER + 1)
    return rows_t, cached_v


def run_layer(original, layer, positions, hidden_states, forward_batch, *args, **kwargs):
    """AROUND hook on a decoder layer's forward (steps 2-4)."""
    annotations = annotations_of(forward_batch)
    state: Optional[BlendState] = None if annotations is None else annotations.blend
    if state is None:
        return original(layer, positions, hidden_states, forward_batch, *args, **kwargs)
    if state.positions is not None:
        positions = state.positions
    out = original(layer, positions, hidden_states, forward_batch, *args, **kwargs)
    if state.positions is None and layer.self_attn.attn.layer_id == state.kv_pool.start_layer + CHECK_LAYER:
        out = _shrink(state, forward_batch, positions, out)
    return out


@torch.no_grad()
def _shrink(state: BlendState, forward_batch, positions: torch.Tensor, hidden_states):
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

    fresh_v = state.kv_pool.get_value_buffer(state.kv_pool.start_layer + CHECK_LAYER)
    lengths = list(forward_batch.extend_seq_lens_cpu)
    starts = forward_batch.extend_start_loc.tolist()
    by_index = {rows.batch_index: rows for rows in state.requests}
    kept_rows, new_lengths, query_positions = [], [], {}
    for index, length in enumerate(lengths):
        rows = by_index.get(index)
        if rows is None:
            keep = torch.arange(length)
        else:
            slots = forward_batch.out_cache_loc[starts[index] + rows.candidates].to(torch.int64)
            deviation = (fresh_v[slots].float() - rows.cached_v.float()).square().sum(dim=(1, 2))
            logprob_starts = forward_batch.extend_logprob_start_lens_cpu
            keep = select_rows(deviation, rows.candidates, length, rows.ratio,
                               None if logprob_starts is None else logprob_starts[index])
            dropped = length - len(keep)
            rows.stats.reused_tokens += dropped
            rows.stats.computed_tokens -= dropped
            query_positions[index] = forward_batch.extend_prefix_lens_cpu[index] + keep.to(positions.device)
        kept_rows.append(starts[index] + keep)
        new_lengths.append(len(keep))
    kept = torch.cat(kept_rows).to(positions.device)
    _shrink_batch(forward_batch, kept, lengths, new_lengths)
    state.positions = positions[kept]
    forward_batch.positions = state.positions
    annotations_of(forward_batch).query_positions = query_positions
    # The residual stream holds a pending (output, residual) pair for every row: fold it into
    # one written residual and keep the selected rows (the stream's own eager-break handoff).
    full = residual_batch.stream_of(forward_batch).snapshot(hidden_states)
    residual_batch.clear(forward_batch)
    return residual_batch.set_written(full[kept].contiguous(), forward_batch)


def _shrink_batch(forward_batch, kept: torch.Tensor, lengths: list[int], new_lengths: list[int]) -> None:
    device = forward_batch.extend_seq_lens.device
    forward_batch.out_cache_loc = forward_batch.out_cache_loc[kept]
    forward_batch.extend_seq_lens = torch.tensor(new_lengths, dtype=forward_batch.extend_seq_lens.dtype, device=device)
    forward_batch.extend_seq_lens_cpu = new_lengths
    starts = [0]
    for length in new_lengths[:-1]:
        starts.append(starts[-1] + length)
    forward_batch.extend_start_loc = torch.tensor(starts, dtype=forward_batch.extend_start_loc.dtype, device=device)
    forward_batch.extend_num_tokens = sum(new_lengths)
    if forward_batch.extend_logprob_start_lens_cpu is not None:
        # Input logprobs stay available for the tail that is always computed (the question).
        forward_batch.extend_logprob_start_lens_cpu = [
            max(0, new - (old - start))
            for new, old, start in zip(new_lengths, lengths, forward_batch.extend_logprob_start_lens_cpu)
        ]


def blend_plan(cache, plan, prefix_len: int, stats) -> Optional[BlendPlan]:
    """The chunks of a cacheblend request (its link plan, `plan`) that follow its matched prefix."""
    sources = [source for source in plan.blend_sources if source.end > prefix_len]
    if not sources:
        return None
    return BlendPlan(cache=cache, ratio=plan.link.ratio, sources=sources, stats=stats)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target in LAYER_HOOK_TARGETS:
        HookRegistry.register(target, run_layer, HookType.AROUND)
