"""Which link policies a server can run, and why not.

Families that compute tokens inside the prompt (LegoLink with k > 0, CacheBlend: their
`position_masked` flag in sglang_patches.policies) need attention masked by true position.
picrag's backends do that (`picrag_native` on CPU, `picrag_flashinfer` on CUDA); on any other
backend those requests would attend to later tokens, so the server refuses them with the reason
instead of answering wrongly. Families that repair need a CacheRepair checkpoint for the served
model (rag_server/launch/repair_checkpoint.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Optional

from sglang_patches.policies import POLICY_FAMILIES, parse_policy

logger = logging.getLogger(__name__)

POSITION_MASKED_BACKENDS = ("picrag_native", "picrag_flashinfer")



def unavailable_policies(attention_backend: str, repair_unavailable: Optional[str]) -> dict[str, str]:
    """Policy family -> why this server cannot run it."""
    unavailable = {}
    for family in POLICY_FAMILIES.values():
        reasons = []
        if family.position_masked and attention_backend not in POSITION_MASKED_BACKENDS:
            reasons.append(
                f"it needs attention masked by true position, which the {attention_backend!r} attention "
                f"backend does not do (picrag's backends do: {', '.join(POSITION_MASKED_BACKENDS)})"
            )
        if family.repairs and repair_unavailable:
            reasons.append(repair_unavailable)
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
