"""The CacheRepair network: stale chunk KV in, a normalised residual for every layer out.

Tokens of one request (all chunks concatenated in prompt order) form one sequence. Each
token's stale K and V of every (layer, kv-head) are compressed to a few numbers, projected to
the network width and fused with the LLM's frozen token embedding. The blocks attend
bidirectionally inside a chunk and causally from earlier chunks to later ones: a chunk's
error comes from the context it did not see, which is exactly the earlier chunks. Stale
features are re-injected before every block through zero-initialised projections, and the
output head is zero-initialised, so an untrained network repairs nothing (residual exactly 0)
and training starts from the stale cache rather than from noise.

Everything before the first block is per token and reads only the token's own chunk: the
compressed stale features, the input projection and each block's re-injection. That part is
`ChunkInputs`, computed for one chunk alone; serving keeps it with the stored chunk, so a chunk
linked again pays only for the blocks and the head (sglang_patches.steps.kv_repair).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from picrag_core.repair.config import RepairConfig
from picrag_core.repair.normalization import KVStats


def chunk_ids_for(lengths: list[int]) -> torch.Tensor:
    """The network's chunk ids for chunks of these lengths, concatenated in prompt order: [T]
    int64, each token the index of its chunk (training pairs and serving build them alike)."""
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int64),
                                   torch.tensor(lengths, dtype=torch.int64))


def chunk_attention_mask(chunk_ids: torch.Tensor) -> torch.Tensor:
    """[T, T] bool, True where token i may attend to token j: chunk_ids[j] <= chunk_ids[i]."""
    return chunk_ids[None, :] <= chunk_ids[:, None]


@dataclass(frozen=True)
class ChunkInputs:
    """What the network's blocks take for some tokens: the input projection [T, W] and each
    block's re-injected stale features [blocks, T, W]. Per token, so one chunk's may be
    computed alone, kept, and concatenated with other chunks' later."""

    hidden: torch.Tensor
    reinjected: torch.Tensor

    @staticmethod
    def cat(parts: list[ChunkInputs]) -> ChunkInputs:
        return ChunkInputs(torch.cat([p.hidden for p in parts]), torch.cat([p.reinjected for p in parts], dim=1))


class StreamCompression(nn.Module):
    """One independent D -> C linear map per (layer, head, K|V) stream."""

    def __init__(self, layer_heads: int, head_dim: int, compress_dim: int):
        super().__init__()
        bound = 1.0 / math.sqrt(head_dim)
        # Groups in the order (layer, head, K|V).
        self.weight = nn.Parameter(torch.empty(2 * layer_heads, head_dim, compress_dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(2 * layer_heads, compress_dim))

    def forward(self, k: torch.Tensor, v: torch.Tensor, rms: torch.Tensor | None = None) -> torch.Tensor:
        """k, v [T, L, H, D] -> [T, L * H * 2 * C]. K and V go through their maps apart, so the
        request's KV is never stacked into one more copy. `rms` [L, H, 2, D]: the inputs are
        raw and each is divided by its stream's RMS, folded into the weights."""
        tokens, _, _, head_dim = k.shape
        weight = self.weight if rms is None else self.weight / rms.reshape(self.weight.shape[0], head_dim, 1)
        weight, bias = weight.view(-1, 2, *weight.shape[1:]), self.bias.view(-1, 2, self.bias.shape[-1])
        parts = [torch.einsum("tgd,gdc->tgc", x.reshape(tokens, -1, head_dim), weight[:, i]) + bias[:, i]
                 for i, x in enumerate((k, v))]
        return torch.stack(parts, dim=2).reshape(tokens, -1)


def zero_linear(in_dim: int, out_dim: int) -> nn.Linear:
    layer = nn.Linear(in_dim, out_dim)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


class Block(nn.Module):
    """Pre-norm transformer block with an explicit boolean attention mask."""

    def __init__(self, width: int, heads: int, ffn_mult: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ffn_norm = nn.LayerNorm(width)
        self.ffn = nn.Sequential(nn.Linear(width, ffn_mult * width), nn.GELU(), nn.Linear(ffn_mult * width, width))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        tokens, width = h.shape
        q, k, v = self.qkv(self.attn_norm(h)).view(tokens, 3, self.heads, width // self.heads).unbind(1)
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        h = h + self.proj(attended.transpose(0, 1).reshape(tokens, width))
        return h + self.ffn(self.ffn_norm(h))


class RepairNetwork(nn.Module):
    def __init__(self, config: RepairConfig, embedding: torch.Tensor):
        super().__init__()
        if tuple(embedding.shape) != (config.vocab_size, config.embed_dim):
            raise ValueError(
                f"token embedding is {tuple(embedding.shape)}, the config expects "
                f"({config.vocab_size}, {config.embed_dim})"
            )
        self.config = config
        # The LLM's own frozen embeddings: large, and recoverable from the model folder.
        self.register_buffer("embedding", embedding.detach().float(), persistent=False)
        c = config
        compressed = c.kv_groups * c.compress_dim
        self.compress = StreamCompression(c.num_layers * c.num_kv_heads, c.head_dim, c.compress_dim)
        self.stale_in = nn.Linear(compressed, c.width)
        self.token_in = nn.Linear(c.embed_dim, c.width)
        self.reinject = nn.ModuleList(zero_linear(compressed, c.width) for _ in range(c.blocks))
        self.blocks = nn.ModuleList(Block(c.width, c.attn_heads, c.ffn_mult) for _ in range(c.blocks))
        self.out_norm = nn.LayerNorm(c.width)
        self.head = zero_linear(c.width, 2 * c.num_layers * c.num_kv_heads * c.head_dim)

    def chunk_inputs(self, stale_k: torch.Tensor, stale_v: torch.Tensor, token_ids: torch.Tensor,
                     scales: KVStats | None = None) -> ChunkInputs:
        """The per-token part of the network for tokens [T] and their normalised RoPE-free stale
        K/V [T, L, H, D] (raw with `scales`: the normalisation is folded into the compression)."""
        features = self.compress(stale_k, stale_v, None if scales is None else scales.stale_rms)
        hidden = self.stale_in(features) + self.token_in(self.embedding[token_ids])
        return ChunkInputs(hidden, torch.stack([reinject(features) for reinject in self.reinject]))

    def residual_from(self, inputs: ChunkInputs, chunk_ids: torch.Tensor,
                      scales: KVStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's chunks' inputs, concatenated in prompt order -> (res_k, res_v), each
        [T, L, H, D]: normalised, or raw with `scales` (the de-normalisation folded into the head)."""
        c = self.config
        h, mask = inputs.hidden, chunk_attention_mask(chunk_ids)
        for reinjected, block in zip(inputs.reinjected, self.blocks):
            h = block(h + reinjected, mask)
        weight, bias = self.head.weight, self.head.bias
        if scales is not None:
            out_scale = scales.delta_sigma.reshape(-1)  # (L, H, K|V, D): the head's output order
            weight, bias = weight * out_scale[:, None], bias * out_scale
        out = F.linear(self.out_norm(h), weight, bias).view(len(h), c.num_layers, c.num_kv_heads, 2, c.head_dim)
        return out[..., 0, :], out[..., 1, :]

    def forward(
        self, stale_k: torch.Tensor, stale_v: torch.Tensor, token_ids: torch.Tensor, chunk_ids: torch.Tensor,
        scales: KVStats | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised RoPE-free stale K/V [T, L, H, D] -> normalised residuals (res_k, res_v).

        With `scales`: raw stale K/V in, raw residuals out. The normalisation is folded into the
        compression weights and the de-normalisation into the output head (the same arithmetic
        up to rounding), so serving makes no extra pass over the request's KV for either."""
        return self.residual_from(self.chunk_inputs(stale_k, stale_v, token_ids, scales), chunk_ids, scales)

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def in_precision(device: torch.device, precision: torch.dtype):
    """A context in which the network's products run in `precision` (autocast; a no-op for float32)."""
    return torch.autocast(device.type, dtype=precision, enabled=precision != torch.float32)


class KVRepairer:
    """A trained network with its normalisation statistics, in raw RoPE-free coordinates."""

    def __init__(self, network: RepairNetwork, stats: KVStats, fingerprint: str):
        self.network = network.eval()
        self.stats = stats
        self.fingerprint = fingerprint
        self.checkpoint_digest = _digest(network, stats)

    @property
    def config(self) -> RepairConfig:
        return self.network.config

    @property
    def device(self) -> torch.device:
        return self.network.embedding.device

    def to(self, device: torch.device | str) -> KVRepairer:
        self.network.to(device)
        self.stats = self.stats.to(device)
        return self

    @torch.no_grad()
    def chunk_inputs(self, stale_k: torch.Tensor, stale_v: torch.Tensor, token_ids: torch.Tensor) -> ChunkInputs:
        """One chunk's network inputs from its raw RoPE-free stale K/V [n, L, H, D] and tokens [n]
        (computed for the chunk alone: the same bits whichever request asks)."""
        device = self.device
        return self.network.chunk_inputs(stale_k.to(device, torch.float32), stale_v.to(device, torch.float32),
                                         token_ids.to(device), scales=self.stats)

    @torch.no_grad()
    def residual_from(self, inputs: list[ChunkInputs], chunk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw float32 residuals of a request's chunks from their inputs, in prompt order."""
        return self.network.residual_from(ChunkInputs.cat(inputs), chunk_ids.to(self.device), scales=self.stats)

    @torch.no_grad()
    def residual(
        self, stale_k: torch.Tensor, stale_v: torch.Tensor, token_ids: torch.Tensor, chunk_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw RoPE-free stale K/V [T, L, H, D] -> raw float32 residuals on the repairer's device:
        repaired = stale + residual, before re-rotating K to its global positions.

        Served in float32 on every device: the tree shares repaired KV between requests whose
        network passes held other chunks besides, and bfloat16's rounding depends on them (it
        moved a victim's first-token log-probabilities by 8e-4 where float32 moves them by about
        1e-5: sglang_patches.plan.keys)."""
        device = self.device
        return self.network(stale_k.to(device, torch.float32), stale_v.to(device, torch.float32),
                            token_ids.to(device), chunk_ids.to(device), scales=self.stats)


def _digest(network: RepairNetwork, stats: KVStats) -> str:
    """SHA-256 of what the repairer computes with (its weights and statistics): repaired KV is
    filed under it (sglang_patches.plan.keys), so two checkpoints never share repaired KV."""
    digest = hashlib.sha256()
    tensors = {**network.state_dict(), **stats.tensors()}
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
