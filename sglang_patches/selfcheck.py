"""The engine's part of the start-up self-check: keys moved by re-rotation equal fresh keys.

Chunk reuse moves cached post-RoPE keys to new positions with picrag_core.rope_shift, which
takes the model's rotary embedding to be a pure rotation by position * theta_i, read from its
`cos_sin_cache`. A rotary embedding that does anything else (multi-axis positions, a scale
that depends on position or length, a kernel that reads another table) would get reused keys
at the wrong positions, and answers silently worse. So when the chunk cache starts, the
model's own rotary embedding module rotates a fixed set of keys at positions p.. and at
p + o..; the keys at p, shifted by o, must equal the keys at p + o within the KV dtype's
rounding. The result stays on the tree cache and is reported in the runtime's `/server_info`
(every `internal_states` entry's `picrag_rope_check`), where the frontend reads it before it
links any prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from picrag_core.engine_report import SERVER_INFO_KEY
from picrag_core.rope_shift import KeyShifter, RopeShiftError, rotary_embedding_of

# The tree cache attribute and the /server_info key that hold the check.
ROPE_CHECK_ATTR = "picrag_rope_check"
HOOK_TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController.get_internal_state"
)

# (start, offset) pairs: a move by one position, moves of the size passages make in a prompt,
# and far moves, where low-frequency dimensions have turned enough to show a wrong scale.
# Moves beyond the model's positions are left out.
MOVES = ((0, 1), (3, 37), (11, 1000), (5, 4000), (2, 30000))
_TOKENS = 8
_HEADS = 2


@dataclass(frozen=True)
class RopeCheck:
    passed: bool
    detail: str  # what was compared, or why it failed
    dtype: str  # the KV cache's dtype, in which the keys were compared

    def as_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "detail": self.detail, "dtype": self.dtype}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rope_shifter(model: torch.nn.Module, kv_dtype: torch.dtype) -> tuple[Optional[KeyShifter], RopeCheck]:
    """The KeyShifter of `model` and its check; no shifter when none describes the model's RoPE."""
    try:
        rotary = rotary_embedding_of(model)
        shifter = KeyShifter.from_rotary_embedding(rotary)
    except RopeShiftError as exc:
        return None, RopeCheck(False, f"cached keys cannot be re-rotated for this model: {exc}", dtype_name(kv_dtype))
    return shifter, check_rope_shift(rotary, shifter, kv_dtype)


def _tolerance(kv_dtype: torch.dtype, table_dtype: torch.dtype, last_position: int, scale: float) -> float:
    # Each side is rounded to the KV dtype once or twice and its angles come from table rows
    # rounded to the table's dtype; fp32 angles pos * theta carry ~eps32 * pos radians of
    # error. A move by even one wrong position differs by O(scale).
    eps = torch.finfo
    relative = 4 * eps(kv_dtype).eps + 4 * eps(table_dtype).eps + 4 * eps(torch.float32).eps * last_position
    return relative * scale + 1e-6


def _rotate(rotary: torch.nn.Module, keys: torch.Tensor, start: int) -> torch.Tensor:
    positions = torch.arange(start, start + keys.shape[0], device=keys.device)
    # The module's own forward, as the model calls it (it may rotate in place: pass copies).
    _, rotated = rotary(positions, keys.clone(), keys.clone())
    return rotated


@torch.no_grad()
def check_rope_shift(rotary: torch.nn.Module, shifter: KeyShifter, kv_dtype: torch.dtype) -> RopeCheck:
    """Keys rotated by `rotary` at p and moved by `shifter` to p + o against keys rotated at p + o."""
    device = shifter.cos_sin_cache.device
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(_TOKENS, _HEADS * rotary.head_size, generator=generator).to(device, kv_dtype)
    scale = keys.float().abs().max().item()
    moves = [(start, offset) for start, offset in MOVES if start + offset + _TOKENS <= shifter.max_position]
    if not moves:
        return RopeCheck(False, f"the rotary table holds only {shifter.max_position} positions", dtype_name(kv_dtype))
    worst = 0.0
    for start, offset in moves:
        try:
            at_start = _rotate(rotary, keys, start)
            fresh = _rotate(rotary, keys, start + offset)
        except Exception as exc:  # whatever the module raises: it does not take plain positions
            return RopeCheck(False, f"the model's rotary embedding ({type(rotary).__name__}) failed on "
                             f"plain positions: {type(exc).__name__}: {exc}", dtype_name(kv_dtype))
        shifted = shifter.shift(at_start.view(_TOKENS, _HEADS, -1), offset).flatten(1)
        tolerance = _tolerance(kv_dtype, shifter.cos_sin_cache.dtype, start + offset + _TOKENS, scale)
        error = (shifted.float() - fresh.float()).abs().max().item()
        if error > tolerance:
            return RopeCheck(False, f"keys computed at {start}.. and re-rotated by {offset} differ from keys "
                             f"computed at {start + offset}.. by {error:.3g} (tolerance {tolerance:.3g}): "
                             f"{type(rotary).__name__} is not the rotation the chunk cache applies",
                             dtype_name(kv_dtype))
        if (at_start.float() - fresh.float()).abs().max().item() <= 4 * tolerance:
            return RopeCheck(False, f"keys computed at {start}.. and at {start + offset}.. are equal: the "
                             "rotary embedding does not depend on position", dtype_name(kv_dtype))
        worst = max(worst, error / tolerance)
    return RopeCheck(True, f"keys re-rotated by {', '.join(str(o) for _, o in moves)} positions equal fresh "
                     f"keys (largest error {worst:.2f} of the tolerance)", dtype_name(kv_dtype))


def add_rope_check(result, controller, *args, **kwargs):
    """AFTER hook on the scheduler's internal-state readback: adds the rope check."""
    check: Optional[RopeCheck] = getattr(controller.scheduler.tree_cache, ROPE_CHECK_ATTR, None)
    if check is not None:
        result.internal_state[SERVER_INFO_KEY] = check.as_json()
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, add_rope_check, HookType.AFTER)
