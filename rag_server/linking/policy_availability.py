"""Which link policies a server can run, and why not.

Families that compute tokens inside the prompt need one of picrag's attention backends
(sglang_patches.attention_backends; the engine refuses them elsewhere, for the same reason).
Families that repair need a CacheRepair checkpoint for the served model
(rag_server/launch/repair_checkpoint.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Optional

from sglang_patches.attention_backends import backend_refusal
from sglang_patches.policies import POLICY_FAMILIES, parse_policy

logger = logging.getLogger(__name__)


def unavailable_policies(attention_backend: str, repair_unavailable: Optional[str]) -> dict[str, str]:
    """Policy family -> why this server cannot run it."""
    unavailable = {}
    for family in POLICY_FAMILIES.values():
        reasons = [reason for reason in (backend_refusal(family, attention_backend),
                                         repair_unavailable if family.repairs else None) if reason]
        if reasons:
            unavailable[family.name] = "; ".join(reasons)
    return unavailable


def default_policy(requested: Optional[str], built_ins: Sequence[str], unavailable: Mapping[str, str]) -> str:
    """The server's default policy: `requested` (refused later if unavailable), else the first
    of `built_ins` this server can run (the last one must always run)."""
    if requested is not None:
        return requested
    for name in built_ins:
        family = parse_policy(name).family.name
        if family not in unavailable:
            return name
        logger.warning("default policy %s unavailable here (%s)", name, unavailable[family])
    raise ValueError(f"none of the default policies {', '.join(built_ins)} can run here")
