"""Re-rotated keys equal the keys of a fresh prefill at the new positions.

Layer 0 is context-free up to RoPE, so the layer-0 keys of a chunk prefilled alone and then
shifted to offset o must equal the layer-0 keys of the same tokens prefilled at positions
o, o+1, ...: computed here with the real model's weights and SGLang's own rotary embedding.
"""

import json

import pytest
import torch
from safetensors import safe_open

from picrag_core.rope_shift import KeyShifter, RopeShiftError


@pytest.fixture(scope="module")
def layer0(default_model_dir):
    config = json.loads((default_model_dir / "config.json").read_text())
    with safe_open(default_model_dir / "model.safetensors", "pt") as f:
        weights = {
            name: f.get_tensor(name)
            for name in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                         "model.layers.0.self_attn.k_proj.weight")
        }
    return config, weights


def prerope_keys(config, weights, token_ids):
    x = weights["model.embed_tokens.weight"][torch.tensor(token_ids)]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])
    x = x * weights["model.layers.0.input_layernorm.weight"]
    k = x @ weights["model.layers.0.self_attn.k_proj.weight"].T
    return k.view(len(token_ids), config["num_key_value_heads"], config["head_dim"])


def sglang_rope(config, rope_scaling=None):
    from sglang.srt.layers.rotary_embedding import get_rope

    return get_rope(
        head_size=config["head_dim"], rotary_dim=config["head_dim"],
        max_position=config["max_position_embeddings"],
        base=config["rope_parameters"]["rope_theta"], is_neox_style=True,
        rope_scaling=rope_scaling, dtype=torch.float32,
    )


def rope_at(rope, keys, start):
    positions = torch.arange(start, start + keys.shape[0])
    _, rotated = rope.forward_native(positions, keys.clone().flatten(1), keys.clone().flatten(1))
    return rotated.view_as(keys)


def fp32_angle_tolerance(keys, last_position):
    # The tables hold fp32 angles pos * theta: each is rounded to ~eps32 * pos radians, so a
    # key rotated in two steps and one rotated in one step may differ by that much times |k|.
    # A rotation by even one wrong position would differ by O(|k|).
    return 4 * torch.finfo(torch.float32).eps * last_position * keys.abs().max().item() + 1e-5


TOKENS = [504, 3575, 282, 4649, 314, 7042, 30, 1392, 5281, 281, 260, 1342, 28, 7]


@pytest.mark.parametrize("offset", [1, 37, 1999, int(torch.randint(2, 8000, (1,), generator=torch.Generator().manual_seed(7)))])
def test_shifted_layer0_keys_equal_fresh_prefill_at_offset(layer0, offset):
    config, weights = layer0
    rope = sglang_rope(config)
    keys = prerope_keys(config, weights, TOKENS)
    alone = rope_at(rope, keys, 0)
    shifted = KeyShifter.from_rotary_embedding(rope).shift(alone, offset)
    fresh = rope_at(rope, keys, offset)
    assert not torch.allclose(alone, fresh, atol=1e-3)
    tol = fp32_angle_tolerance(keys, offset + len(TOKENS))
    torch.testing.assert_close(shifted, fresh, atol=tol, rtol=0)


def test_shift_with_llama3_rope_scaling(layer0):
    config, weights = layer0
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 2048}
    rope = sglang_rope(config, scaling)
    plain = sglang_rope(config)
    keys = prerope_keys(config, weights, TOKENS)
    offset = 3001
    fresh = rope_at(rope, keys, offset)
    assert not torch.allclose(fresh, rope_at(plain, keys, offset), atol=1e-3)
    shifted = KeyShifter.from_rotary_embedding(rope).shift(rope_at(rope, keys, 0), offset)
    tol = fp32_angle_tolerance(keys, offset + len(TOKENS))
    torch.testing.assert_close(shifted, fresh, atol=tol, rtol=0)


@pytest.mark.parametrize("neox", [True, False])
def test_shift_is_exact_rotation_composition_in_float64(neox):
    head_dim, positions = 64, 5000
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    shifter = KeyShifter(table, head_dim=head_dim, rotary_dim=head_dim, is_neox_style=neox)
    keys = torch.randn(9, 3, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def rotate_at(k, start):
        rows = [shifter.shift(k[i : i + 1], start + i) if start + i else k[i : i + 1] for i in range(len(k))]
        return torch.cat(rows)

    torch.testing.assert_close(shifter.shift(rotate_at(keys, 0), 4321), rotate_at(keys, 4321), atol=1e-9, rtol=0)


def test_negative_shift_inverts_a_positive_one(layer0):
    config, weights = layer0
    shifter = KeyShifter.from_rotary_embedding(sglang_rope(config))
    keys = rope_at(sglang_rope(config), prerope_keys(config, weights, TOKENS), 0)
    there_and_back = shifter.shift(shifter.shift(keys, 1234), -1234)
    torch.testing.assert_close(there_and_back, keys, atol=fp32_angle_tolerance(keys, 1234), rtol=0)


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_in_place_and_differentiable_neox_rotations_agree_bit_for_bit(rotary_dim):
    # Serving writes the rotation into one output; training takes the differentiable form.
    # Both must give the same bits, or a network trained through one is served through another.
    head_dim = 64
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.arange(3000, dtype=torch.float32)[:, None] * inv_freq
    shifter = KeyShifter(torch.cat((angles.cos(), angles.sin()), dim=-1), head_dim, rotary_dim, is_neox_style=True)
    keys = torch.randn(11, 5, 2, head_dim, generator=torch.Generator().manual_seed(3))
    cos, sin = shifter.rotation(torch.tensor([0, 5, -7, 2999, -1, 17, 300, -300, 1, 2, 3]), keys)
    rotation = (cos.unsqueeze(1), sin.unsqueeze(1))
    in_place = shifter.rotate(keys, rotation)
    differentiable = shifter.rotate(keys.clone().requires_grad_(True), rotation)
    assert differentiable.requires_grad
    assert torch.equal(in_place, differentiable.detach())
    assert torch.equal(in_place[..., rotary_dim:], keys[..., rotary_dim:])


def test_a_table_scaled_by_one_constant_shifts_as_its_rotation():
    # YaRN's mscale multiplies cos and sin by one m: keys at p are m R(p) k, and at p + d
    # R(d) (m R(p) k); a table whose magnitude varies by position is no rotation at all.
    head_dim = 16
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(600, dtype=torch.float64)[:, None] * inv_freq
    scaled = torch.cat((angles.cos(), angles.sin()), dim=-1) * 1.2
    shifter = KeyShifter(scaled, head_dim=head_dim, rotary_dim=head_dim, is_neox_style=True)
    keys = torch.randn(4, 2, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    at = lambda p: KeyShifter(scaled / 1.2, head_dim, head_dim, True).shift(keys, p) * 1.2  # noqa: E731
    torch.testing.assert_close(shifter.shift(at(10), 321), at(331), atol=1e-9, rtol=0)
    varying = scaled * torch.linspace(1.0, 1.5, 600, dtype=torch.float64)[:, None]
    with pytest.raises(RopeShiftError, match="scales magnitudes"):
        KeyShifter(varying, head_dim=head_dim, rotary_dim=head_dim, is_neox_style=True)


# The RoPE variants of the families picrag serves, as their configs write them (SGLang's factory
# builds each): keys rotated at p and moved by re-rotation must equal keys rotated at p + o.
ROPE_VARIANTS = {
    "default": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
}


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_every_served_rope_variant_re_rotates_exactly(variant, partial, neox):
    from sglang.srt.layers.rotary_embedding.factory import get_rope

    from sglang_patches.selfcheck import check_rope_shift

    head_dim = 64
    scaling = ROPE_VARIANTS[variant]
    if scaling is not None:
        scaling = {**scaling, "type": scaling["rope_type"]}
    rope = get_rope(head_dim, int(head_dim * partial), 32768, 500000, is_neox_style=neox, rope_scaling=scaling,
                    dtype=torch.float32)
    shifter = KeyShifter.from_rotary_embedding(rope)
    check = check_rope_shift(rope, shifter, torch.float32)
    assert check.passed, check.detail


def test_longrope_is_not_one_rotation_per_position():
    # Phi-3.5's LongRoPE switches frequencies with the prompt's length: the model support table
    # refuses chunk reuse for it before any key is moved.
    from picrag_core.model_support import ModelTraits, chunk_reuse_refusal

    config = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "max_position_embeddings": 131072,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48}}
    assert "longrope" in chunk_reuse_refusal(ModelTraits.of_config(config))
