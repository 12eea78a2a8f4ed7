"""Move post-RoPE keys to a new position with the model's own rotary tables.

SGLang's KV pool holds keys after RoPE. RoPE rotates every (x1_i, x2_i) pair by the angle
pos * theta_i, so a key computed at position p is moved to position p + d by one more
rotation by d * theta_i: R(p + d) = R(d) R(p). The angle table is the model's own
`cos_sin_cache` row d, so any per-dimension frequency change (Llama-3 rope scaling) is
honoured. A table scaled by one constant (YaRN's mscale) is divided by it first; tables whose
magnitude varies are not rotations and are refused rather than silently mis-rotated.
"""

from __future__ import annotations

import torch


class RopeShiftError(ValueError):
    pass


class KeyShifter:
    def __init__(self, cos_sin_cache: torch.Tensor, head_dim: int, rotary_dim: int, is_neox_style: bool):
        half = rotary_dim // 2
        cos, sin = cos_sin_cache[:, :half].double(), cos_sin_cache[:, half:rotary_dim].double()
        magnitude = cos.square() + sin.square()
        scale = magnitude.mean()
        if not torch.allclose(magnitude, scale.expand_as(magnitude), rtol=1e-4, atol=1e-6):
            raise RopeShiftError(
                "the model's rotary table scales magnitudes by position or dimension; "
                "delta re-rotation of cached keys is only exact for rotations times one constant"
            )
        if not torch.allclose(scale, torch.ones_like(scale), atol=1e-4):
            # YaRN multiplies cos and sin by one constant m: a key at p is m R(p) k, and at p + d
            # it is R(d) (m R(p) k), so the shift is the table's rotation with m divided out.
            cos_sin_cache = (cos_sin_cache.double() / scale.sqrt()).to(cos_sin_cache.dtype)
        self.cos_sin_cache = cos_sin_cache
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style

    @classmethod
    def from_rotary_embedding(cls, rotary_emb: torch.nn.Module) -> KeyShifter:
        if getattr(rotary_emb, "position_start", 0):
            raise RopeShiftError("rotary embeddings with a position offset are not supported")
        return cls(
            rotary_emb.cos_sin_cache,
            head_dim=rotary_emb.head_size,
            rotary_dim=rotary_emb.rotary_dim,
            is_neox_style=rotary_emb.is_neox_style,
        )

    @property
    def max_position(self) -> int:
        return self.cos_sin_cache.shape[0]

    def shift(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """keys [n, heads, head_dim] computed at positions p -> the same keys at p + delta
        (delta may be negative)."""
        if delta == 0:
            return keys
        return self.shift_each(keys, torch.full((keys.shape[0],), delta, dtype=torch.int64))

    def shift_each(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Like `shift`, with its own delta per token (deltas [n]): one pass for many chunks."""
        return self.rotate(keys, self.rotation(deltas, keys))

    def rotation(self, deltas: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) of shifting each token by its delta, [n, 1, rotary_dim / 2], on the
        device of keys like `like`, in at least fp32: computed once, applied to every layer's
        keys with `rotate`."""
        if deltas.numel() and int(deltas.abs().max()) >= self.max_position:
            raise RopeShiftError(f"shifts outside the model's {self.max_position} positions")
        half = self.rotary_dim // 2
        rows = self.cos_sin_cache.index_select(0, deltas.abs().to(self.cos_sin_cache.device))
        rows = rows.to(like.device, torch.promote_types(like.dtype, torch.float32)).unsqueeze(1)  # [n, 1, rot]
        # R(-d) is R(d) with the sine negated.
        sign = torch.where(deltas < 0, -1.0, 1.0).to(rows.device, rows.dtype)[:, None, None]
        return rows[..., :half], rows[..., half : self.rotary_dim] * sign

    def rotate(self, keys: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = rotation
        half = self.rotary_dim // 2
        k = keys.to(cos.dtype)
        rot, rest = k[..., : self.rotary_dim], k[..., self.rotary_dim :]
        if not self.is_neox_style:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
            return torch.cat((rotated, rest), dim=-1).to(keys.dtype)
        x1, x2 = rot[..., :half], rot[..., half:]
        if torch.is_grad_enabled() and (k.requires_grad or cos.requires_grad or sin.requires_grad):
            # Training back-propagates through the rotation; writes into `out=` are not differentiable.
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1).to(keys.dtype)
        # Written into one output, half by half: no temporary per half and no concatenation
        # (fewer passes over memory, which bounds this on CPU for a request's keys over every
        # layer), with the rounding of x1 * cos - x2 * sin and x2 * cos + x1 * sin exactly.
        out = torch.empty_like(k)
        o1, o2 = out[..., :half], out[..., half : self.rotary_dim]
        torch.mul(x1, cos, out=o1)
        o1.sub_(x2 * sin)
        torch.mul(x2, cos, out=o2)
        o2.add_(x1 * sin)
        out[..., self.rotary_dim :] = rest
        return out.to(keys.dtype)


def rotary_embedding_of(model: torch.nn.Module) -> torch.nn.Module:
    """The model's (first) SGLang rotary embedding module."""
    for module in model.modules():
        if hasattr(module, "cos_sin_cache") and hasattr(module, "is_neox_style"):
            return module
    raise RopeShiftError(f"no rotary embedding found in {type(model).__name__}")
