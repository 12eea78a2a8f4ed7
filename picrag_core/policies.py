"""Every link policy picrag serves: one record per policy family, and the parser of policy names.

A policy name is a family, optionally with its parameter: ``legolink:4`` (k = 4),
``cacheblend:0.3`` (ratio 0.3); the selecting families also take ``,K`` after their ratio
(``select:0.15,16``: the first 16 tokens of every chunk as well). A family named bare gets its
default parameter (``legolink`` is ``legolink:16``). Everything that depends on what a policy does (the wire format in
picrag_core.link_hints, the chunk cache's routing and grafting, the frontend's availability
checks, the CLI's help) reads the family's flags here, never its name. Adding a policy is one
record in the table below plus the module that holds its algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union


class PolicyError(ValueError):
    """A policy name, or a link request, that cannot be served."""


@dataclass(frozen=True)
class ParamKind:
    """A family's parameter: how it is written after the colon and which values it takes."""

    name: str  # the LinkRequest field and kv_hints payload key that carry it
    letter: str  # as written in help: legolink:K
    whole: bool  # an int written in digits; else any float
    low: float
    high: float

    def requirement(self) -> str:
        if self.whole:
            return f"a whole number {self.letter} >= {self.low:g}"
        return f"a number {self.low:g} <= {self.letter} <= {self.high:g}"

    def parse(self, family: str, text: str) -> Union[int, float]:
        value: Union[int, float, None] = None
        try:
            if self.whole:
                value = int(text) if text.isascii() and text.isdigit() else None
            else:
                value = float(text)
        except ValueError:  # not a number, or more digits than int() reads
            pass
        if value is None or not self.holds(value):
            raise PolicyError(f"{family}:{self.letter} needs {self.requirement()}, got {text!r}")
        return value

    def holds(self, value: Union[int, float]) -> bool:
        # Compared as they are: a huge int has no float (math.isnan would overflow).
        return not (isinstance(value, float) and math.isnan(value)) and self.low <= value <= self.high


# k travels in kv_hints to the scheduler, whose messages (msgpack) hold 64-bit integers.
K = ParamKind("k", "K", whole=True, low=0, high=2**63 - 1)
RATIO = ParamKind("ratio", "R", whole=False, low=0.0, high=1.0)
PARAM_KINDS = {kind.name: kind for kind in (K, RATIO)}


@dataclass(frozen=True)
class PolicyFamily:
    name: str
    summary: str  # one line, for CLI help and docs
    param: Optional[str] = None  # a PARAM_KINDS name: "k" or "ratio"
    default_param: Union[int, float, None] = None
    # Compiles the prompt's chunks alone and links them (the frontend compiles them first).
    reuses_chunks: bool = False
    # Looks its prompt up in the radix tree; False: computes every token.
    matches_tree: bool = True
    # Its linked requests are inserted into the radix tree for later requests to share.
    inserts_into_tree: bool = True
    # Computes tokens that sit inside the prompt: attention must be masked by true position.
    position_masked: bool = False
    # Chunks are compiled and stored behind this many sink tokens (the model's BOS), whose KV
    # is never linked.
    sink_tokens: int = 0
    # The prompt goes to the runtime reordered (picrag_core.reordered_layout): the chunk
    # tokens it recomputes (LegoLink's first k of every chunk, a selection's tokens) move behind
    # the chunks' kept tokens and are computed.
    reordered_layout: bool = False
    # The name may add ",K" after the parameter: the first K tokens of every chunk are recomputed
    # as well (select:0.15,16).
    takes_k: bool = False
    # Recomputes the chunk tokens the question attends to most over the linked KV: the frontend
    # first links the prompt as this family to measure that attention (rag_server/linking/selection.py).
    scored_as: Optional[str] = None
    # Chunks are extend tokens whose cached KV is placed in the forward (sglang_patches.steps.cacheblend)
    # instead of grafted into the tree as prefix.
    blends_chunks: bool = False
    # Grafted chunk KV is corrected by the CacheRepair network (sglang_patches.steps.kv_repair).
    repairs: bool = False
    # The family served instead when the engine holds no repair checkpoint.
    unrepaired: Optional[str] = None

    @property
    def param_kind(self) -> Optional[ParamKind]:
        return PARAM_KINDS[self.param] if self.param else None

    @property
    def syntax(self) -> str:
        """How the family is written: 'legolink[:K]', 'naive', 'select[:R[,K]]'."""
        kind = self.param_kind
        if kind is None:
            return self.name
        return f"{self.name}[:{kind.letter}[,{K.letter}]]" if self.takes_k else f"{self.name}[:{kind.letter}]"

    def policy(self, param: Union[int, float, None] = None, k: int = 0) -> Policy:
        return Policy(self, self.default_param if param is None else param, k if self.takes_k else 0)


_FAMILIES = (
    PolicyFamily(
        "full", "nothing reused, nothing stored (the quality baseline)",
        matches_tree=False, inserts_into_tree=False,
    ),
    PolicyFamily("prefix", "SGLang's own exact-prefix radix cache"),
    PolicyFamily(
        "naive", "every chunk's stored KV re-positioned and reused; only the question is computed",
        reuses_chunks=True,
    ),
    PolicyFamily(
        "legolink", "naive, plus the first K tokens of every chunk recomputed in context (EPIC's LegoLink)",
        param="k", default_param=16, reuses_chunks=True, position_masked=True, reordered_layout=True,
    ),
    PolicyFamily(
        "legolink0", "chunks compiled behind 3 sink tokens whose KV is dropped; only the question is computed",
        reuses_chunks=True, sink_tokens=3,
    ),
    PolicyFamily(
        "cacheblend", "layers 0-1 on every token, later layers on the fraction R of chunk tokens that "
        "deviate most (CacheBlend)",
        param="ratio", default_param=0.15, reuses_chunks=True, position_masked=True,
        inserts_into_tree=False, blends_chunks=True,
    ),
    PolicyFamily(
        "cacherepair", "naive, plus a learned residual on every chunk token's K and V (CacheRepair; "
        "needs a checkpoint)",
        reuses_chunks=True, repairs=True, unrepaired="naive",
    ),
    PolicyFamily(
        "cacherepair+legolink", "cacherepair's repaired chunk KV, plus the first K tokens of every "
        "chunk recomputed in context",
        param="k", default_param=16, reuses_chunks=True, position_masked=True, reordered_layout=True,
        repairs=True, unrepaired="legolink",
    ),
    PolicyFamily(
        "select", "naive, plus the fraction R of chunk tokens the question attends to most over naive's KV "
        "(and the first K of every chunk) recomputed in context",
        param="ratio", default_param=0.15, takes_k=True, reuses_chunks=True, position_masked=True,
        reordered_layout=True, scored_as="naive",
    ),
    PolicyFamily(
        "cacherepair+select", "cacherepair's repaired chunk KV, plus the fraction R of chunk tokens the question "
        "attends to most over it (and the first K of every chunk) recomputed in context",
        param="ratio", default_param=0.15, takes_k=True, reuses_chunks=True, position_masked=True,
        reordered_layout=True, repairs=True, unrepaired="select", scored_as="cacherepair",
    ),
)
POLICY_FAMILIES: dict[str, PolicyFamily] = {family.name: family for family in _FAMILIES}


@dataclass(frozen=True)
class Policy:
    family: PolicyFamily
    param: Union[int, float, None] = None
    k: int = 0  # families that take_k: the first k tokens of every chunk recomputed as well

    @property
    def name(self) -> str:
        """Canonical: 'legolink:16', 'cacheblend:0.15', 'naive', 'select:0.15,16'."""
        if self.param is None:
            return self.family.name
        return f"{self.family.name}:{self.param}" + (f",{self.k}" if self.k else "")


def parse_policy(name: str) -> Policy:
    """'legolink' -> legolink:16; 'legolink:4'; 'cacheblend:0.3'; anything else raises PolicyError."""
    base, _, text = name.partition(":")
    family = POLICY_FAMILIES.get(base)
    if family is None:
        raise PolicyError(
            f"unknown policy {name!r}; known: {', '.join(f.syntax for f in _FAMILIES)}"
        )
    kind = family.param_kind
    if kind is None:
        if text:
            raise PolicyError(f"policy {base!r} takes no parameter")
        return family.policy()
    text, comma, k_text = text.partition(",")
    if comma and not family.takes_k:
        raise PolicyError(f"policy {base!r} takes no ,{K.letter}")
    k = K.parse(base, k_text) if comma else 0
    return family.policy(kind.parse(base, text) if text else None, k)


def policy_names(text: str) -> list[str]:
    """The names of a comma-separated list ("naive,select:0.2,16,legolink:4"): a part that is a
    whole number is the ",K" of the name before it, since a selecting family writes its K so."""
    names: list[str] = []
    for part in (part.strip() for part in text.split(",")):
        if part.isdigit() and names and ":" in names[-1] and "," not in names[-1]:
            names[-1] = f"{names[-1]},{part}"
        elif part:
            names.append(part)
    return names
