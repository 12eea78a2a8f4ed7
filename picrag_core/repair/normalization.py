"""Per-(layer, kv-head, K|V, dim) scales that put every KV stream on a unit scale.

KV magnitudes differ by orders of magnitude across layers and dims (a few massive
dimensions dominate), so the network sees stale KV divided by its RMS and predicts the
residual divided by the RMS of (joint - stale). Streams whose joint and stale values agree
(layer 0 is context-free: its K and V depend on the token alone) get delta_sigma 0: their
residual is exactly 0 and they add nothing to the loss, instead of asking the network to
fit rounding noise blown up to unit scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# delta_sigma below this fraction of stale_rms is rounding noise, not context.
CONTEXT_FREE_RATIO = 1e-3
_TINY = 1e-12


@dataclass
class KVStats:
    stale_rms: torch.Tensor  # [L, H, 2, D], index 0 = K (RoPE-free), 1 = V
    delta_sigma: torch.Tensor  # [L, H, 2, D], RMS of joint - stale; 0 where context-free

    def normalise(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k / self.stale_rms[:, :, 0], v / self.stale_rms[:, :, 1]

    def denormalise_residual(self, res_k: torch.Tensor, res_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return res_k * self.delta_sigma[:, :, 0], res_v * self.delta_sigma[:, :, 1]

    def normalise_delta(self, delta_k: torch.Tensor, delta_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training target: (joint - stale) / delta_sigma, 0 on context-free streams."""
        inverse = torch.where(self.delta_sigma > 0, 1.0 / self.delta_sigma.clamp_min(_TINY), 0.0)
        return delta_k * inverse[:, :, 0], delta_v * inverse[:, :, 1]

    def to(self, device: torch.device | str) -> KVStats:
        return KVStats(self.stale_rms.to(device), self.delta_sigma.to(device))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"stale_rms": self.stale_rms.contiguous(), "delta_sigma": self.delta_sigma.contiguous()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> KVStats:
        return cls(tensors["stale_rms"].float(), tensors["delta_sigma"].float())


class KVStatsAccumulator:
    """Streaming sums of squares over training pairs, one request at a time."""

    def __init__(self) -> None:
        self.stale_sq: torch.Tensor | None = None
        self.delta_sq: torch.Tensor | None = None
        self.tokens = 0

    def add(self, stale_k: torch.Tensor, stale_v: torch.Tensor, target_k: torch.Tensor, target_v: torch.Tensor) -> None:
        """RoPE-free [T, L, H, D] tensors of one pair."""
        stale = torch.stack((stale_k, stale_v), dim=3).double()  # [T, L, H, 2, D]
        delta = torch.stack((target_k, target_v), dim=3).double() - stale
        stale_sq, delta_sq = stale.square().sum(0), delta.square().sum(0)
        if self.stale_sq is None:
            self.stale_sq, self.delta_sq = stale_sq, delta_sq
        else:
            self.stale_sq += stale_sq
            self.delta_sq += delta_sq
        self.tokens += stale.shape[0]

    def finish(self) -> KVStats:
        if self.stale_sq is None or self.tokens == 0:
            raise ValueError("no training pairs to compute KV statistics from")
        stale_rms = (self.stale_sq / self.tokens).sqrt().float().clamp_min(_TINY)
        delta_sigma = (self.delta_sq / self.tokens).sqrt().float()
        delta_sigma = torch.where(delta_sigma < CONTEXT_FREE_RATIO * stale_rms, 0.0, delta_sigma)
        return KVStats(stale_rms, delta_sigma)
