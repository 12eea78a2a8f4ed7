"""picrag annotates each extend ForwardBatch from its requests' link plans, once, and keeps the
annotations on SGLang's copy of the batch.

An AFTER hook on `ForwardBatch.init_new` (the one place a batch's positions are made) builds one
ForwardAnnotations (sglang_patches.steps.forward_annotations): the true positions of prompts sent
reordered (sglang_patches.steps.positions) and CacheBlend's cached KV put in place
(sglang_patches.steps.cacheblend), and where the question's attention is summed for links that ask
(sglang_patches.steps.context_attention) and which positions' distributions are reported
(sglang_patches.steps.span_report). The requests' grafts are done by then, so their chunk leases end
here (sglang_patches.tree.chunk_cache). SGLang 0.5.23's eager runner then copies the batch into
static buffers and runs the model on a *new* ForwardBatch made by `dataclasses.replace`, which
keeps dataclass fields only: an AFTER hook on `EagerRunner.load_batch` carries the annotations
over; without it the attention backend and the layers would silently see none.
"""

from __future__ import annotations

from sglang_patches.steps.forward_annotations import ATTR, ForwardAnnotations

INIT_HOOK_TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
HOOK_TARGET = "sglang.srt.model_executor.runner.eager_runner.EagerRunner.load_batch"


def annotate(forward_batch, _cls, batch, *_args, **_kwargs):
    from sglang_patches.steps.cacheblend import prepare_blend
    from sglang_patches.plan.link_plan import plan_of
    from sglang_patches.plan.link_state import state_of
    from sglang_patches.steps.positions import true_positions_of

    if not forward_batch.forward_mode.is_extend() or forward_batch.extend_prefix_lens_cpu is None:
        return forward_batch
    plans = [plan_of(req) for req in batch.reqs]
    if not any(plans):
        return forward_batch
    states = [state_of(req) for req in batch.reqs]
    stats = {index: state.stats for index, state in enumerate(states) if state is not None}
    annotations = ForwardAnnotations(
        true_positions=true_positions_of(forward_batch, plans), blend=prepare_blend(forward_batch, states),
        attention={index: s.context_attention for index, s in stats.items() if s.context_attention is not None},
        # A re-prefill after a retraction (its output so far in the prompt) reports nothing again.
        spans={index: s.span for index, s in stats.items() if s.span is not None and not batch.reqs[index].output_ids},
    )
    for state in states:
        if state is not None:
            state.release_lease()
    if annotations:
        setattr(forward_batch, ATTR, annotations)
    return forward_batch


def carry_annotations(loaded, _runner, forward_batch, *_args, **_kwargs):
    if loaded is not forward_batch and hasattr(forward_batch, ATTR):
        setattr(loaded, ATTR, getattr(forward_batch, ATTR))
    return loaded


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(INIT_HOOK_TARGET, annotate, HookType.AFTER)
    HookRegistry.register(HOOK_TARGET, carry_annotations, HookType.AFTER)
