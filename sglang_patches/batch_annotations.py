"""picrag's per-forward annotations survive SGLang's eager-runner batch copy.

picrag attaches attributes to a ForwardBatch when it is built (true positions of reordered
LegoLink prompts, CacheBlend's state). SGLang 0.5.23's eager runner then copies the batch into
static buffers and runs the model on a *new* ForwardBatch made by `dataclasses.replace`, which
keeps dataclass fields only. An AFTER hook on `EagerRunner.load_batch` carries the annotations
over; without it the attention backend and the layers would silently see none.
"""

from __future__ import annotations

HOOK_TARGET = "sglang.srt.model_executor.runner.eager_runner.EagerRunner.load_batch"


def annotation_names() -> tuple[str, ...]:
    from sglang_patches.cacheblend import STATE_ATTR
    from sglang_patches.positions import TRUE_POSITIONS_ATTR

    return (TRUE_POSITIONS_ATTR, STATE_ATTR)


def carry_annotations(loaded, _runner, forward_batch, *_args, **_kwargs):
    if loaded is forward_batch:
        return loaded
    for name in annotation_names():
        value = getattr(forward_batch, name, None)
        if value is not None:
            setattr(loaded, name, value)
    return loaded


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, carry_annotations, HookType.AFTER)
