"""A trained repairer on disk: weights, config + model fingerprint, normalisation statistics.

    DIR/weights.safetensors   trainable weights only (the LLM's embedding is not copied)
    DIR/config.json           RepairConfig, model_fingerprint, training summary
    DIR/kv_stats.safetensors  stale_rms and delta_sigma, [L, H, 2, D]

A repairer only means something for the exact model it was trained on, so loading compares
the stored fingerprint with the serving model's and refuses a mismatch. Files are written to
temporary names and renamed, so an interrupted save never leaves a half-written file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from picrag_core.file_digest import file_sha256
from picrag_core.repair.config import RepairConfig
from picrag_core.repair.network import KVRepairer, RepairNetwork
from picrag_core.repair.normalization import KVStats

WEIGHTS_FILE = "weights.safetensors"
CONFIG_FILE = "config.json"
STATS_FILE = "kv_stats.safetensors"


class RepairCheckpointError(ValueError):
    """A checkpoint folder that is missing, corrupt or inconsistent with its own config."""


class RepairCheckpointMismatch(RepairCheckpointError):
    """A valid checkpoint trained for another model."""


def _replace(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def save_checkpoint(
    directory: Path, network: RepairNetwork, config: RepairConfig, stats: KVStats, fingerprint: str,
    extra: dict[str, Any],
) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = {name: t.detach().cpu().contiguous() for name, t in network.state_dict().items()}
    stats_cpu = {name: t.cpu() for name, t in stats.to("cpu").tensors().items()}
    metadata = {"model_fingerprint": fingerprint}
    _replace(directory / WEIGHTS_FILE, lambda p: save_file(weights, p, metadata=metadata))
    _replace(directory / STATS_FILE, lambda p: save_file(stats_cpu, p, metadata=metadata))
    document = {**config.to_dict(), "model_fingerprint": fingerprint, "training": extra}
    _replace(directory / CONFIG_FILE, lambda p: p.write_text(json.dumps(document, indent=2) + "\n"))


def read_checkpoint_config(directory: Path) -> tuple[RepairConfig, str, dict[str, Any]]:
    """(config, model fingerprint, training summary) of a checkpoint folder."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise RepairCheckpointError(f"no CacheRepair checkpoint at {directory} ({CONFIG_FILE} missing)")
    try:
        document = json.loads(path.read_text())
        return RepairConfig.from_dict(document), str(document["model_fingerprint"]), document.get("training", {})
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise RepairCheckpointError(f"corrupt CacheRepair config {path}: {exc!r}") from exc


def checkpoint_identity(directory: Path) -> dict[str, Any]:
    """What names a checkpoint in a benchmark's results: its folder, its weights' SHA-256 (two
    trainings into one folder differ only there), the network's shape and its training steps."""
    directory = Path(directory)
    config, _, training = read_checkpoint_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise RepairCheckpointError(f"CacheRepair checkpoint file {weights} is missing")
    return {"path": str(directory.resolve()), "weights_sha256": file_sha256(weights),
            "width": config.width, "blocks": config.blocks, "compress_dim": config.compress_dim,
            "training_steps": training.get("steps")}


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise RepairCheckpointError(f"CacheRepair checkpoint file {path} is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        raise RepairCheckpointError(f"corrupt CacheRepair checkpoint file {path}: {exc}") from exc


def load_repairer(directory: Path, embedding: torch.Tensor, expected_fingerprint: str) -> KVRepairer:
    directory = Path(directory)
    config, fingerprint, _ = read_checkpoint_config(directory)
    if fingerprint != expected_fingerprint:
        raise RepairCheckpointMismatch(
            f"CacheRepair checkpoint {directory} was trained for model fingerprint {fingerprint}, "
            f"but the serving model's fingerprint is {expected_fingerprint}: train a repairer for this "
            "model (picrag repair pairs / train) or serve the model it was trained on"
        )
    try:
        network = RepairNetwork(config, embedding)
        network.load_state_dict(_load_tensors(directory / WEIGHTS_FILE))
    except (RuntimeError, ValueError) as exc:
        if isinstance(exc, RepairCheckpointError):
            raise
        raise RepairCheckpointError(f"CacheRepair checkpoint {directory} does not match its config: {exc}") from exc
    stats = _load_tensors(directory / STATS_FILE)
    expected = (config.num_layers, config.num_kv_heads, 2, config.head_dim)
    for name in ("stale_rms", "delta_sigma"):
        if name not in stats or tuple(stats[name].shape) != expected:
            found = tuple(stats[name].shape) if name in stats else "missing"
            raise RepairCheckpointError(f"{directory / STATS_FILE}: {name} is {found}, expected {expected}")
    return KVRepairer(network, KVStats.from_tensors(stats), fingerprint)
