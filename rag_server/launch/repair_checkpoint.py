"""Which CacheRepair checkpoint `picrag serve` gives the runtime, checked against the model.

A checkpoint named with `--repair-checkpoint` must have been trained for the served model:
anything else stops the server with the reason. Without the flag, the checkpoint shipped in
`cache_repair/checkpoints/<model folder name>` is used when its fingerprint matches; when none
fits, the server runs without one and refuses policy `cacherepair` with that reason.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "cache_repair" / "checkpoints"


def choose_repair_checkpoint(model_path: Path, requested: Optional[Path]) -> tuple[Optional[Path], Optional[str]]:
    """(checkpoint to load, None) or (None, why cacherepair is unavailable). Raises
    picrag_core.repair.checkpoint.RepairCheckpointError for a bad or foreign `requested` one."""
    from picrag_core.repair.checkpoint import RepairCheckpointError, RepairCheckpointMismatch, read_checkpoint_config
    from picrag_core.model_fingerprint import model_fingerprint

    fingerprint = model_fingerprint(model_path, torch.float32)
    if requested is not None:
        _, trained_for, _ = read_checkpoint_config(requested)
        if trained_for != fingerprint:
            raise RepairCheckpointMismatch(
                f"CacheRepair checkpoint {requested} was trained for model fingerprint {trained_for}, "
                f"but {model_path} has fingerprint {fingerprint}"
            )
        return requested, None
    shipped = SHIPPED_DIR / model_path.name
    how_to = "train one with `picrag repair pairs` and `picrag repair train`, then serve with --repair-checkpoint DIR"
    if not (shipped / "config.json").is_file():
        return None, f"no CacheRepair checkpoint for model {model_path.name}: {how_to}"
    try:
        _, trained_for, _ = read_checkpoint_config(shipped)
    except RepairCheckpointError as exc:
        return None, f"the shipped CacheRepair checkpoint is unusable ({exc}): {how_to}"
    if trained_for != fingerprint:
        logger.warning("shipped CacheRepair checkpoint %s is for another model build; cacherepair is off", shipped)
        return None, f"the shipped CacheRepair checkpoint was trained for another build of {model_path.name}: {how_to}"
    return shipped, None
