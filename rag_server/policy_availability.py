"""Which link policies a server can run, and why not.

LegoLink (k > 0) and CacheBlend compute tokens that sit inside the prompt, so their attention
must be masked by true position. Only picrag's CPU backend (`picrag_native`) does that today; on
another backend (FlashInfer on CUDA) those requests would attend to later tokens, so the server
refuses them with the reason instead of answering wrongly. CacheRepair needs a checkpoint for
the served model (rag_server/repair_checkpoint.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Optional

from sglang_patches.link_hints import split_policy

logger = logging.getLogger(__name__)

POSITION_MASKED_BACKEND = "picrag_native"
POSITION_MASKED_POLICIES = ("legolink", "cacheblend")
FALLBACK_POLICY = "naive"


def unavailable_policies(attention_backend: str, repair_unavailable: Optional[str]) -> dict[str, str]:
    unavailable = {}
    if attention_backend != POSITION_MASKED_BACKEND:
        for family in POSITION_MASKED_POLICIES:
            unavailable[family] = (
                f"it needs attention masked by true position, which the {attention_backend!r} attention "
                f"backend does not do (only {POSITION_MASKED_BACKEND!r}, the CPU backend, does)"
            )
    if repair_unavailable:
        unavailable["cacherepair"] = repair_unavailable
    return unavailable


def default_policy(requested: Optional[str], built_in: str, unavailable: Mapping[str, str]) -> str:
    """The server's default policy: `requested` (refused if unavailable), else the built-in one,
    else FALLBACK_POLICY when the built-in one cannot run here."""
    if requested is not None:
        return requested
    family, _ = split_policy(built_in)
    if family in unavailable:
        logger.warning("default policy %s unavailable (%s): using %s", built_in, unavailable[family], FALLBACK_POLICY)
        return FALLBACK_POLICY
    return built_in
