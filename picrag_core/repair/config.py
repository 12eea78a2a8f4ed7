"""The repair network's shape, its training options, and what it needs from the LLM's folder.

A repairer is tied to one LLM: its input and output sizes are the LLM's KV geometry
(layers x kv-heads x head_dim) and it reads the LLM's frozen token embeddings. Both are read
from the model folder rather than from a loaded model, so training and serving never need
the LLM itself in memory. torch is imported only where a tensor is read, so the command line
can build its parser from these defaults without loading torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from picrag_core.model_support import ModelTraits, chunk_reuse_refusal

if TYPE_CHECKING:
    import torch

_EMBEDDING_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight")


class ModelFolderError(ValueError):
    pass


@dataclass(frozen=True)
class RepairConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    embed_dim: int
    vocab_size: int
    compress_dim: int = 4
    width: int = 128
    blocks: int = 4
    attn_heads: int = 4
    ffn_mult: int = 4

    def __post_init__(self) -> None:
        if self.width % self.attn_heads:
            raise ValueError(f"width {self.width} is not divisible by attn_heads {self.attn_heads}")

    @property
    def kv_groups(self) -> int:
        """Compressed (layer, head, K|V) streams."""
        return self.num_layers * self.num_kv_heads * 2

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RepairConfig:
        names = {f.name for f in fields(cls)}
        # A checkpoint's config.json also carries the fingerprint and a training summary.
        return cls(**{k: int(v) for k, v in data.items() if k in names})

    @classmethod
    def for_model(cls, model_dir: Path, **network: int) -> RepairConfig:
        """The KV geometry of an HF model folder whose KV chunks are reused; `network` overrides
        width, blocks, ..."""
        hf = read_hf_config(model_dir)
        try:
            heads = hf["num_attention_heads"]
            return cls(
                num_layers=hf["num_hidden_layers"],
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                embed_dim=hf["hidden_size"],
                vocab_size=hf["vocab_size"],
                **network,
            )
        except KeyError as exc:
            raise ModelFolderError(f"{model_dir}/config.json lacks {exc.args[0]!r}") from None


@dataclass(frozen=True)
class TrainOptions:
    steps: int = 2000
    lr: float = 1e-3
    width: int = 128
    blocks: int = 4
    compress_dim: int = 4  # numbers each (layer, head, K|V) stream of stale KV is compressed to
    warmup: int = 100
    val_every: int = 250
    seed: int = 0
    # Loss weights: the KV residual MSE and the answer KL (pairs with questions only), the
    # latter's mean taken over the last kl_positions prompt positions (0: all question tokens).
    # The KL is off by default: at equal steps it did not beat the residual term alone
    # (docs/cacherepair.md).
    residual_weight: float = 1.0
    kl_weight: float = 0.0
    kl_positions: int = 1


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFolderError(f"cannot read the model config {path}: {exc}") from exc
    # A model with sliding windows reuses chunks when served no wider than its narrowest window.
    refusal = chunk_reuse_refusal(ModelTraits.of_config(hf, ModelTraits.of_config(hf).sliding_window))
    if refusal:
        raise ModelFolderError(f"{path}: CacheRepair repairs reused chunk KV, and this model reuses none: {refusal}")
    return hf


def read_token_embedding(model_dir: Path) -> torch.Tensor:
    """The LLM's input embedding matrix [vocab, hidden] in fp32, read without loading the LLM."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        candidates = [(model_dir / weight_map[n], n) for n in _EMBEDDING_NAMES if n in weight_map]
    else:
        candidates = [(model_dir / "model.safetensors", n) for n in _EMBEDDING_NAMES]
    for path, name in candidates:
        if not path.is_file():
            continue
        with safe_open(path, "pt") as f:
            if name in f.keys():  # noqa: SIM118 - safe_open handles are not containers
                return f.get_tensor(name).float()
    raise ModelFolderError(f"no token embedding ({' or '.join(_EMBEDDING_NAMES)}) in {model_dir}")
