"""RoPE on CPU with a few ops per layer: cos/sin gathered once per forward, not once per layer.

Without sgl-kernel, SGLang applies RoPE with `RotaryEmbedding.forward_native`: in every layer
it gathers cos/sin for the batch's positions, then rotates q and k apart, about 25 small tensor
ops per layer. At one decode token per request those ops' dispatch is the cost, not their
arithmetic (the rotary was 5% of a decode step's profile, a plain transformers loop's 2.4%).
Every layer of a model shares one RotaryEmbedding and receives the same positions tensor in
one forward, so this gathers cos/sin (each half repeated to the full head, as transformers
keeps it) once per positions tensor and rotates q and k in five ops: as one tensor when k's
columns follow q's in one buffer (the qkv projection's output, as SGLang's models split it).
The result is bit for bit forward_native's: x1*cos + (-x2)*sin rounds exactly as x1*cos - x2*sin.

Only the shape the dev models use takes this path (NeoX style, the whole head rotated, no
offsets, no fused KV write); anything else runs SGLang's own forward_native.
"""

from __future__ import annotations

from typing import Optional

import torch

HOOK_TARGET = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_native"
_CACHE_ATTR = "_picrag_cos_sin"  # (positions tensor, its version, cos, sin) of the last forward


def _cos_sin(rope, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as [tokens, 1, head size]; kept while the same positions tensor, unchanged,
    comes back (the next layer of the same forward)."""
    cached = getattr(rope, _CACHE_ATTR, None)
    if (cached is not None and cached[0] is positions and cached[1] == positions._version
            and cached[2].dtype == dtype):
        return cached[2], cached[3]
    cos, sin = rope.cos_sin_cache.index_select(0, positions.flatten()).to(dtype).chunk(2, dim=-1)
    cos, sin = (torch.cat((half, half), dim=-1).unsqueeze(1) for half in (cos, sin))
    setattr(rope, _CACHE_ATTR, (positions, positions._version, cos, sin))
    return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def forward_native(original, rope, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                   offsets: Optional[torch.Tensor] = None, fused_set_kv_buffer_arg=None):
    if (offsets is not None or fused_set_kv_buffer_arg is not None or not rope.is_neox_style
            or rope.rotary_dim != rope.head_size or hasattr(rope, "sin_cos_cache") or positions.ndim != 1):
        return original(rope, positions, query, key, offsets, fused_set_kv_buffer_arg)
    tokens, head = positions.shape[0], rope.head_size
    cos, sin = _cos_sin(rope, positions, query.dtype)
    if _adjacent(query, key):  # q and k cut from one qkv projection: rotated as one tensor
        q_heads = query.shape[-1] // head
        both = _rotate(query.as_strided((tokens, q_heads + key.shape[-1] // head, head), (query.stride(0), head, 1)),
                       cos, sin)
        return both[:, :q_heads].reshape(query.shape), both[:, q_heads:].reshape(key.shape)
    q = _rotate(query.view(tokens, -1, head), cos, sin)
    k = _rotate(key.view(tokens, -1, head), cos, sin)
    return q.reshape(query.shape), k.reshape(key.shape)


def _adjacent(query: torch.Tensor, key: torch.Tensor) -> bool:
    """k's columns follow q's in the same rows of one buffer (SGLang splits q, k, v that way)."""
    return (query.ndim == key.ndim == 2 and query.dtype == key.dtype and query.stride() == key.stride()
            and query.stride(1) == 1 and query.untyped_storage().data_ptr() == key.untyped_storage().data_ptr()
            and key.storage_offset() == query.storage_offset() + query.shape[1])


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, forward_native, HookType.AROUND)
