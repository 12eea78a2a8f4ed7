"""Run a reordered (LegoLink) prompt's extend tokens at their true positions.

SGLang numbers extend tokens prefix_len, prefix_len + 1, ... For a prompt sent in LegoLink's
order (sglang_patches.legolink_layout) the tokens carry their true positions instead; the
attention backend gets the true position of every row entry so that a query attends exactly
to the tokens before it in the original prompt. An AFTER hook on `ForwardBatch.init_new` (the
one place the batch's positions are made) rewrites them for such requests only.
"""

from __future__ import annotations

import torch

HOOK_TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
TRUE_POSITIONS_ATTR = "picrag_true_positions"


def true_positions(order: list[int], length: int) -> list[int]:
    # Output tokens (after a retraction, say) follow the prompt in both orders.
    return order[:length] + list(range(len(order), length))


def apply_true_positions(forward_batch, _cls, batch, *_args, **_kwargs):
    from sglang_patches.chunk_cache import POSITIONS_ATTR

    if not forward_batch.forward_mode.is_extend() or forward_batch.extend_prefix_lens_cpu is None:
        return forward_batch
    by_request: dict[int, torch.Tensor] = {}
    starts = forward_batch.extend_start_loc.tolist()
    for index, req in enumerate(batch.reqs):
        order = getattr(req, POSITIONS_ATTR, None)
        if order is None:
            continue
        prefix = forward_batch.extend_prefix_lens_cpu[index]
        length = prefix + forward_batch.extend_seq_lens_cpu[index]
        row = torch.tensor(true_positions(order, length), dtype=torch.int64, device=forward_batch.positions.device)
        forward_batch.positions[starts[index] : starts[index] + length - prefix] = row[prefix:].to(
            forward_batch.positions.dtype
        )
        by_request[index] = row
    if by_request:
        setattr(forward_batch, TRUE_POSITIONS_ATTR, by_request)
    return forward_batch


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, apply_true_positions, HookType.AFTER)
