"""Which link policies a server can run, and why not.

LegoLink (k > 0) and CacheBlend compute tokens that sit inside the prompt, so their attention
must be masked by true position. picrag's backends do that (`picrag_native` on CPU,
`picrag_flashinfer` on CUDA); on any other backend those requests would attend to later tokens,
so the server refuses them with the reason instead of answering wrongly. CacheRepair needs a
checkpoint for the served model (rag_server/launch/repair_checkpoint.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Optional

from sglang_patches.link_hints import split_policy

logger = logging.getLogger(__name__)

POSITION_MASKED_BACKENDS = ("picrag_native", "picrag_flashinfer")
POSITION_MASKED_POLICIES = ("legolink", "cacheblend")
FALLBACK_POLICY = "naive"


def unavailable_policies(attention_backend: str, repair_unavailable: Optional[str]) -> dict[str, str]:
    unavailable = {}
    if attention_backend not in POSITION_MASKED_BACKENDS:
        for family in POSITION_MASKED_POLICIES:
            unavailable[family] = (
                f"it needs attention masked by true position, which the {attention_backend!r} attention "
                f"backend does not do (picrag's backends do: {', '.join(POSITION_MASKED_BACKENDS)})"
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
