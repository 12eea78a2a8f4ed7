"""picrag's CPU RoPE (sglang_patches.cpu.rotary) against SGLang's own forward_native: bit for bit."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

from sglang_patches.cpu import rotary

HEAD, Q_HEADS, KV_HEADS = 64, 9, 3  # SmolLM2-135M's attention


def sglang_forward_native():
    """SGLang's function, whether or not the plugin's hook already wraps the class attribute."""
    function = RotaryEmbedding.forward_native
    return getattr(function, "__wrapped__", function)


def rope(neox: bool = True, rotary_dim: int = HEAD) -> RotaryEmbedding:
    return RotaryEmbedding(HEAD, rotary_dim, 4096, 100000, neox, torch.float32)


def qkv_split(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as SGLang's models cut them from one qkv projection: adjacent column blocks."""
    qkv = torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD, dtype=dtype)
    q, k, _ = qkv.split([Q_HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7])
def test_equals_sglang_bit_for_bit_on_q_and_k_cut_from_one_projection(tokens, dtype):
    torch.manual_seed(tokens)
    module, original = rope(), sglang_forward_native()
    positions = torch.randint(0, 4000, (tokens,))
    q, k = qkv_split(tokens, dtype)
    assert rotary._adjacent(q, k)
    expected = original(module, positions, q, k)
    got = rotary.forward_native(original, module, positions, q, k)
    for e, g in zip(expected, got):
        assert g.shape == e.shape and g.dtype == e.dtype and torch.equal(g, e)


def test_equals_sglang_on_separate_q_and_k_and_falls_back_where_it_does_not_apply():
    torch.manual_seed(0)
    original, positions = sglang_forward_native(), torch.tensor([3, 900, 4000])
    q, k = torch.randn(3, Q_HEADS * HEAD), torch.randn(3, KV_HEADS * HEAD)
    assert not rotary._adjacent(q, k)
    for module in (rope(), rope(neox=False), rope(rotary_dim=HEAD // 2)):
        for e, g in zip(original(module, positions, q, k), rotary.forward_native(original, module, positions, q, k)):
            assert torch.equal(g, e)
    offsets = torch.tensor([1, 1, 1])
    for e, g in zip(original(rope(), positions, q, k, offsets),
                    rotary.forward_native(original, rope(), positions, q, k, offsets)):
        assert torch.equal(g, e)


def test_cos_sin_are_reused_within_a_forward_and_never_for_other_positions():
    original, module = sglang_forward_native(), rope()
    q, k = qkv_split(2, torch.float32)
    positions = torch.tensor([5, 6])
    rotary.forward_native(original, module, positions, q, k)
    first = getattr(module, rotary._CACHE_ATTR)[2]
    rotary.forward_native(original, module, positions, q, k)  # the next layer: the same tensor
    assert getattr(module, rotary._CACHE_ATTR)[2] is first
    positions[1] = 3000  # changed in place: gathered again
    for e, g in zip(original(module, positions, q, k), rotary.forward_native(original, module, positions, q, k)):
        assert torch.equal(g, e)
    other = torch.tensor([5, 6])  # equal values, another tensor: gathered again, same result
    rotary.forward_native(original, module, other, q, k)
    assert getattr(module, rotary._CACHE_ATTR)[0] is other
