"""What `picrag serve` says at start about the model it serves: whether it can be served on the
chosen attention backend at all, which link policies it refuses for that model and why, and
whether its architecture is one picrag's model matrix tests."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from picrag_core.model_support import TESTED_ARCHITECTURES, ModelTraits, model_refusals
from picrag_core.attention_backends import model_backend_refusal

logger = logging.getLogger(__name__)


class ModelUnservable(ValueError):
    """The model cannot be served on this attention backend (the message says why)."""


def served_model_traits(model_path: Path, attention_backend: Optional[str],
                        context_length: Optional[int] = None) -> ModelTraits:
    """The traits of the model folder's config.json served with `context_length` (None: the
    config's), after logging what they refuse; raises ModelUnservable when the backend cannot
    serve the model at all."""
    traits = ModelTraits.of_config(json.loads((Path(model_path) / "config.json").read_text()), context_length)
    refusal = model_backend_refusal(traits, attention_backend)
    if refusal:
        raise ModelUnservable(f"{model_path}: {refusal}")
    if traits.architecture not in TESTED_ARCHITECTURES:
        logger.warning("%s is not among the architectures picrag's model matrix tests (%s): its policies "
                       "are served on what its config says and on the start-up self-check",
                       traits.architecture, ", ".join(sorted(TESTED_ARCHITECTURES)))
    for family, reason in model_refusals(traits).items():
        logger.warning("policy %s is refused for %s: %s", family, traits.architecture, reason)
    return traits
