"""Which link policy a request is served with, decided in one place.

`picrag serve` builds one `PolicyResolver` when it starts and every route asks it: `/rag/query`
and the chat extension for their default and for what they may serve (rag_server/service/
rag_service.py), `/generate` for a client's link and for prompts with chunk markers
(rag_server/api/native_routes.py), the link pipeline for what a link is sent as, `auto` for the
families it may pick, the page for its policy menu, and the CLI for the names it accepts.

What it knows:
- the **default**: `--default-policy`, else the first of DEFAULT_POLICIES this server can run;
- **availability** per family: the served model must allow it (picrag_core.model_support: no
  chunk reuse on sliding-window layers, latent attention or position-dependent RoPE, CacheBlend
  only where its layer hook reaches); families that compute tokens inside the prompt need one of picrag's
  attention backends (picrag_core.attention_backends), families that repair need a CacheRepair
  checkpoint for the served model (rag_server/launch/repair_checkpoint.py);
- the **fallback** after a failed start-up self-check (rag_server/linking/reuse_gate.py):
  chunk-reusing families are served as `--on-selfcheck-failure` says, or refused; a refused
  default becomes `prefix`. (A repairing family sent straight to an engine without a checkpoint
  is served as its `unrepaired` family there: the frontend refuses it first.)
- **auto's candidates**: every family it may serve.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from rag_server.linking.reuse_gate import REFUSE, ReuseGate
from picrag_core.attention_backends import backend_refusal
from picrag_core.link_hints import LinkRequest
from picrag_core.model_support import ModelTraits, policy_refusal
from picrag_core.policies import POLICY_FAMILIES, Policy, PolicyError, PolicyFamily, parse_policy

logger = logging.getLogger(__name__)

# The link policy when a request names none: CacheRepair, which on the dev sets closes more of
# reuse's first-token KL than LegoLink (k 16) and is faster to first token, on both shipped
# models (docs/benchmarks.md). The server falls back along DEFAULT_POLICIES where the served
# model has no checkpoint, the attention backend cannot mask by position, or the model allows
# no chunk reuse at all (sliding windows, latent attention: SGLang's own prefix cache); "full"
# is one flag away (picrag serve --default-policy full).
DEFAULT_POLICIES = ("cacherepair", "legolink", "naive", "prefix")
DEFAULT_POLICY = DEFAULT_POLICIES[0]
# Per request, the cheapest policy within the quality target (rag_server/service/auto_policy.py).
AUTO = "auto"
AUTO_SUMMARY = "the cheapest policy within the server's quality target"
# What `auto` stands for until it has chosen, and where nothing qualifies.
AUTO_FALLBACK = "full"


class PolicyUnavailable(PolicyError):
    """A policy this server cannot serve (HTTP 400 with the reason)."""


@dataclass(frozen=True)
class NamedPolicy:
    """A policy parsed once, where a request or the server's settings name it; answers report
    it as it was named ('legolink', where the policy's canonical name is 'legolink:16').

    `auto` is chosen per request once the prompt is built; until then `policy` holds its
    fallback, `full`."""

    name: str
    policy: Policy
    auto: bool = False

    @classmethod
    def parse(cls, name: str) -> NamedPolicy:
        if name == AUTO:
            return cls(name, parse_policy(AUTO_FALLBACK), auto=True)
        return cls(name, parse_policy(name))

    @classmethod
    def of(cls, policy: Policy) -> NamedPolicy:
        return cls(policy.name, policy)

    @property
    def family(self) -> PolicyFamily:
        return self.policy.family


def engine_refusals(attention_backend: Optional[str], repair_unavailable: Optional[str],
                    model: Optional[ModelTraits] = None) -> dict[str, str]:
    """Policy family -> why an engine on `attention_backend` serving `model` cannot run it;
    `repair_unavailable`: why the engine holds no CacheRepair checkpoint (None: it holds one)."""
    refusals = {}
    for family in POLICY_FAMILIES.values():
        reasons = [reason for reason in (policy_refusal(family, model) if model is not None else None,
                                         backend_refusal(family, attention_backend),
                                         repair_unavailable if family.repairs else None) if reason]
        if reasons:
            refusals[family.name] = "; ".join(reasons)
    return refusals


@dataclass(frozen=True)
class Served:
    """The policy resolver's one answer for a request."""

    policy: NamedPolicy  # what the request is served with
    warning: Optional[str] = None  # set exactly where another policy than the one asked for serves it: why
    reason: Optional[str] = None  # set where `auto` chose the policy asked for: why it did

    def link(self, link: LinkRequest) -> LinkRequest:
        """`link` (a client's, or one built for the asked policy) as it is sent: as it is, or
        under the policy served instead."""
        return link if self.warning is None else link.like(self.policy.policy)


@dataclass(frozen=True)
class PolicyResolver:
    default: NamedPolicy
    refusals: Mapping[str, str] = field(default_factory=dict)  # family -> why the engine cannot run it
    gate: ReuseGate = ReuseGate()  # chunk reuse after the start-up self-check

    @classmethod
    def start(cls, requested: Optional[str] = None, refusals: Mapping[str, str] | None = None,
              gate: ReuseGate = ReuseGate(), built_ins: Sequence[str] = DEFAULT_POLICIES) -> PolicyResolver:
        """The resolver of a server whose engine refuses `refusals` (family -> why). Its default:
        `requested`, else the first of `built_ins` the engine runs (the last one must run); raises
        PolicyError for a name that does not parse, PolicyUnavailable for one the server refuses."""
        refusals = dict(refusals or {})
        if requested is None:
            requested = next((name for name in built_ins if cls._family_of(name) not in refusals), None)
            if requested is None:
                raise PolicyUnavailable(f"none of the default policies {', '.join(built_ins)} can run here")
            for name in built_ins[:built_ins.index(requested)]:
                logger.warning("default policy %s unavailable here (%s)", name, refusals[cls._family_of(name)])
        return cls(NamedPolicy.parse(requested), refusals).gated(gate)

    @staticmethod
    def _family_of(name: str) -> str:
        return parse_policy(name).family.name

    def gated(self, gate: ReuseGate) -> PolicyResolver:
        """This resolver after the start-up self-check `gate`: a default it refuses becomes
        `prefix`, so that requests naming no policy are still answered."""
        resolver = PolicyResolver(self.default, self.refusals, gate)
        default = self.default
        if default.family.name in resolver._gate_refusals():
            default = NamedPolicy.parse("prefix")
        resolver = PolicyResolver(default, self.refusals, gate)
        if default.family.name in resolver.unavailable:
            raise PolicyUnavailable(f"default policy {default.name!r} is unavailable: "
                                    f"{resolver.unavailable[default.family.name]}")
        return resolver

    def _gate_refusals(self) -> dict[str, str]:
        refusal = self.gate.refusal
        if refusal is None or self.gate.on_failure != REFUSE:
            return {}
        return {family.name: refusal for family in POLICY_FAMILIES.values() if family.reuses_chunks}

    @property
    def unavailable(self) -> dict[str, str]:
        """Policy family -> why this server refuses it."""
        return {**self.refusals, **self._gate_refusals()}

    def resolve(self, named: NamedPolicy) -> Served:
        """What a request asking for `named` (`auto` already chosen) is served with: decided once
        per request, at the edge, and carried from there (the plan, the link it is sent as).
        Raises PolicyUnavailable for a family this server does not serve."""
        unavailable = self.unavailable
        if named.family.name in unavailable:
            raise PolicyUnavailable(f"policy {named.family.name!r} is unavailable on this server: "
                                    f"{unavailable[named.family.name]}")
        family = named.family
        if not (family.reuses_chunks and self.gate.refusal is not None and self.gate.on_failure != REFUSE):
            return Served(named)
        instead = parse_policy(self.gate.on_failure)
        return Served(NamedPolicy.of(instead), f"policy {named.name} served as {instead.name}: {self.gate.refusal}")

    @property
    def auto_excluded(self) -> dict[str, str]:
        """Families `auto` must not pick (family -> why): those this server refuses, and every
        chunk-reusing one while the self-check turns reuse away."""
        excluded = self.unavailable
        if self.gate.refusal is not None:
            for family in POLICY_FAMILIES.values():
                if family.reuses_chunks:
                    excluded.setdefault(family.name, self.gate.refusal)
        return excluded

    def menu(self) -> list[dict]:
        """Every policy family with whether this server serves it (and why not), then `auto`."""
        unavailable = self.unavailable
        families = [{"name": family.name, "syntax": family.syntax, "summary": family.summary,
                     "available": family.name not in unavailable, "reason": unavailable.get(family.name)}
                    for family in POLICY_FAMILIES.values()]
        return [*families, {"name": AUTO, "syntax": AUTO, "summary": AUTO_SUMMARY, "available": True, "reason": None}]
