"""Which of issue 32's four known ways to break cache transparency a violation looks like.

Read off the victim and its (minimal, when shrunk) attackers, so a report can say which seeds
found which case; a violation that matches none is reported as "other" (a new way).

1. `legolink-rest`: a reordered family's victim after an attacker whose chunk has the victim
   chunk's rest behind other first k tokens;
2. `repair-context`: a repairing family's victim after an attacker whose chunk starts like a
   victim chunk and then differs (the repaired KV of the shared tokens saw the other tokens);
3. `logprob-start`: an attacker of the victim's policy that set logprob_start_len inside its
   prompt (SGLang's capped prefix match);
4. `batch-hints`: hints in SGLang's batch form through the frontend (served where the single
   form is refused, or answered otherwise), or a client-set LegoLink layout.
"""

from __future__ import annotations

from typing import Optional

from rag_server.bench.transparency_requests import AUTO, GENERATE, VANILLA, Request
from picrag_core.link_hints import LinkRequest
from picrag_core.policies import parse_policy

LEGOLINK_REST = "1-legolink-rest"
REPAIR_CONTEXT = "2-repair-context"
LOGPROB_START = "3-logprob-start"
BATCH_HINTS = "4-batch-hints"
OTHER = "other"


def _chunks(requests: list[Request]) -> list[tuple[int, ...]]:
    return [chunk for request in requests for prompt in request.prompts for chunk in prompt.chunks]


def _same_rest(victim: Request, attackers: list[Request]) -> bool:
    k = LinkRequest.of(victim.policy, []).k  # LegoLink's k, or a selecting family's ",K"
    mine = _chunks([victim])
    return any(len(theirs) > k and theirs[k:] == chunk[k:] and theirs[:k] != chunk[:k]
               for chunk in mine for theirs in _chunks(attackers))


def _same_start(victim: Request, attackers: list[Request]) -> bool:
    mine = _chunks([victim])
    return any(theirs != chunk and theirs[:2] == chunk[:2] for chunk in mine for theirs in _chunks(attackers))


def likely_case(check: str, victim: Request, preceding: list[Request],
                minimal: Optional[list[Request]]) -> Optional[str]:
    """The known case a violation of `check` on `victim` after `preceding` (shrunk to `minimal`,
    None if not shrunk) looks like."""
    # A batch through the frontend is forwarded as it is: unchecked, and its chunks not compiled.
    if victim.client_layout or (victim.batch and victim.route == GENERATE):
        return BATCH_HINTS
    attackers = minimal if minimal is not None else preceding
    if check == "form":
        # On the runtime, a batch's prompts are each other's attackers.
        victim, attackers = preceding[0], victim.singles()
    if any(a.client_layout and a.batch for a in attackers):
        return BATCH_HINTS
    same_policy = [a for a in attackers if a.policy == victim.policy]
    capped = [a for a in same_policy if a.logprobs.start_len is not None]
    if any(a.prompts == victim.prompts for a in capped):
        return LOGPROB_START
    if victim.policy not in (AUTO, VANILLA):
        family = parse_policy(victim.policy).family
        if family.reordered_layout and _same_rest(victim, same_policy):
            return LEGOLINK_REST
        if family.repairs and _same_start(victim, same_policy):
            return REPAIR_CONTEXT
    if capped or victim.logprobs.start_len is not None:
        return LOGPROB_START
    return OTHER
