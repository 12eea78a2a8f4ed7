"""The requests the transparency fuzzer sends: passages built to collide, and seeded sequences of
requests over them.

Passages are lists of real word tokens (a byte-level BPE vocabulary's " word" tokens), so one
token list is both a `/generate` prompt and, decoded, a `/rag/query` document. They come in
families built to collide at the token level wherever the chunk cache shares KV:

* a base passage C;
* C[:m] + other tokens: the same start, another end (a stored chunk's causal prefix, and the
  KV a bidirectional repair computes for it, are different things);
* other tokens + C[j:] for small j: the same rest behind other first tokens (LegoLink reuses
  the rest of a chunk and recomputes its first k tokens);
* any passage as one chunk or split into two back-to-back chunks (split and merged spans);
* heads (the tokens before the first chunk): equal, sharing all but their last tokens, or empty.

An episode is a short sequence played on a flushed cache. Its requests draw from one passage
family and mostly share one policy, so that they reach the same tree namespace, and vary
everything else a client controls: route, single or batched form, logprob fields, extra_key,
a client-set LegoLink layout, compile actions.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from picrag_core.policies import parse_policy

AUTO = "auto"
VANILLA = "vanilla"  # a plain prompt, no kv_hints (SGLang's own request)
# Every policy family, with small parameters so that chunks hold more than k tokens.
POLICIES = ("prefix", "naive", "legolink:2", "legolink:4", "legolink0", "cacheblend:0.3", "cacherepair",
            "cacherepair+legolink:4", "select:0.3", "select:0.2,2", "cacherepair+select:0.2,2", AUTO)

GENERATE = "generate"  # the frontend's /generate (compiles, links, relinks)
ENGINE = "engine"  # the runtime's /generate: picrag.compile of the pieces, then the runtime's link
RAG = "rag"  # /rag/query with inline documents
CHAT = "chat"  # /v1/chat/completions with the picrag extension
COMPILE = "compile"  # a picrag.compile action sent to the frontend (an attacker; answers nothing)
ENGINE_COMPILE = "engine_compile"  # the same, straight to the runtime
# Unannotated prompts whose passages the frontend finds itself (rag_server/linking/chunk_discovery.py):
# the passages as paragraphs of the message or text, the policy in the body's discovery control.
PLAIN_CHAT = "plain_chat"  # /v1/chat/completions, documents inside the user message
PLAIN_COMPLETION = "plain_completion"  # /v1/completions with a text prompt
PLAIN_GENERATE = "plain_generate"  # /generate with `text` and no hints
ROUTES = (GENERATE, ENGINE, RAG, CHAT, COMPILE, ENGINE_COMPILE, PLAIN_CHAT, PLAIN_COMPLETION, PLAIN_GENERATE)
# How often each route is drawn: mostly linked /generate, where every client field applies.
ROUTE_WEIGHTS = {GENERATE: 0.32, ENGINE: 0.16, RAG: 0.08, CHAT: 0.06, COMPILE: 0.08, ENGINE_COMPILE: 0.1,
                 PLAIN_CHAT: 0.07, PLAIN_COMPLETION: 0.05, PLAIN_GENERATE: 0.08}
TEXT_ROUTES = (RAG, CHAT)
PLAIN_ROUTES = (PLAIN_CHAT, PLAIN_COMPLETION, PLAIN_GENERATE)
COMPILE_ROUTES = (COMPILE, ENGINE_COMPILE)
EXTRA_KEYS = ("tenant-a", "tenant-b")

_WORD = re.compile(r"^Ġ[a-z]{3,9}$")  # byte-level BPE: Ġ is the leading space


@dataclass(frozen=True)
class Words:
    """Single-token words of the model's vocabulary: token id -> its text (with the space)."""

    text_of: dict[int, str]

    @classmethod
    def of_tokenizer(cls, tokenizer) -> Words:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        found = {i: " " + p[1:] for i, p in enumerate(pieces) if isinstance(p, str) and _WORD.match(p)}
        if len(found) < 100:
            raise ValueError(f"only {len(found)} single-token words in the vocabulary: not a byte-level BPE?")
        return cls(found)

    @property
    def ids(self) -> list[int]:
        return sorted(self.text_of)

    def text(self, tokens: Sequence[int]) -> str:
        return "".join(self.text_of[t] for t in tokens).strip()


@dataclass(frozen=True)
class Prompt:
    head: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]  # back to back after the head
    question: tuple[int, ...]

    @property
    def input_ids(self) -> list[int]:
        ids = list(self.head)
        for chunk in self.chunks:
            ids.extend(chunk)
        return ids + list(self.question)

    @property
    def spans(self) -> list[tuple[int, int]]:
        spans, start = [], len(self.head)
        for chunk in self.chunks:
            spans.append((start, start + len(chunk)))
            start += len(chunk)
        return spans


@dataclass(frozen=True)
class Logprobs:
    """The logprob fields of a /generate body; the default asks for none."""

    return_logprob: bool = False
    start_len: Optional[int] = None  # logprob_start_len; None: SGLang's default
    top: int = 0  # top_logprobs_num
    full_first_token: bool = False  # the link field first_token_logprobs (whole vocabulary)
    span: int = 0  # the link field span_logprobs: the last this many positions' distributions


@dataclass(frozen=True)
class Request:
    route: str
    policy: str  # a policy name, AUTO (text routes) or VANILLA
    prompts: tuple[Prompt, ...]  # several: SGLang's batch form (input_ids a list of lists)
    batch: bool = False
    logprobs: Logprobs = Logprobs()
    extra_key: Optional[str] = None
    # A LegoLink-family prompt the client reordered itself, with "layout": "legolink" in its hint.
    client_layout: bool = False
    max_new_tokens: int = 8

    @property
    def victim(self) -> bool:
        """Whether it answers something to compare (compile actions answer nothing)."""
        return self.route not in COMPILE_ROUTES

    def with_policy(self, policy: str) -> Request:
        return dataclasses.replace(self, policy=policy)

    def singles(self) -> list[Request]:
        """Each prompt of a batch as its own single-form request."""
        return [dataclasses.replace(self, prompts=(p,), batch=False) for p in self.prompts]

    def describe(self, words: Optional[Words] = None) -> dict[str, Any]:
        """The request as the report shows it: enough to send it again."""
        out: dict[str, Any] = {"route": self.route, "policy": self.policy, "form": "batch" if self.batch else "single"}
        if self.logprobs != Logprobs():
            default = dataclasses.asdict(Logprobs())
            out["logprobs"] = {k: v for k, v in dataclasses.asdict(self.logprobs).items() if v != default[k]}
        if self.extra_key is not None:
            out["extra_key"] = self.extra_key
        if self.client_layout:
            out["client_layout"] = True
        out["prompts"] = [{"head": list(p.head), "chunks": [list(c) for c in p.chunks], "question": list(p.question)}
                          for p in self.prompts]
        return out


@dataclass(frozen=True)
class Corpus:
    heads: tuple[tuple[int, ...], ...]
    families: tuple[tuple[tuple[int, ...], ...], ...]  # each: base, same start, same rest (two)
    questions: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, words: Words, rng: random.Random, families: int = 3) -> Corpus:
        ids = words.ids

        def fresh(n: int) -> tuple[int, ...]:
            return tuple(rng.choice(ids) for _ in range(n))

        built = []
        for _ in range(families):
            base = fresh(rng.randint(24, 44))
            cut = rng.choice([len(base) - 1, rng.randint(len(base) // 2, len(base) - 1)])
            other_first = rng.choice([1, 2])
            built.append((
                base,
                base[:cut] + fresh(rng.randint(4, 20)),  # same start, another end
                fresh(other_first) + base[other_first:],  # the same rest after k = 2
                fresh(4) + base[4:],  # the same rest after k = 4
            ))
        head = fresh(rng.randint(8, 14))
        heads = (head, head[:-3] + fresh(3), fresh(rng.randint(8, 14)), ())
        questions = tuple(fresh(rng.randint(5, 9)) for _ in range(3))
        return cls(heads, tuple(built), questions)


@dataclass(frozen=True)
class GeneratorSettings:
    policies: tuple[str, ...] = POLICIES
    routes: tuple[str, ...] = ROUTES
    min_episode: int = 2
    max_episode: int = 6
    max_new_tokens: int = 8
    bos: Optional[int] = None  # the model's BOS: compiles of legolink0's pieces put sinks before a chunk
    # logprob_start_len 0 (no prefix may match at all) among the logprob fields; False to fuzz the
    # rest on a runtime that a request with it stops.
    start_len_zero: bool = True


@dataclass
class Generator:
    """Seeded episodes of requests over one corpus."""

    words: Words
    seed: int
    settings: GeneratorSettings = field(default_factory=GeneratorSettings)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.corpus = Corpus.build(self.words, self.rng)
        self._used: list[Prompt] = []  # the prompts of the episode being generated

    def episodes(self, requests: int) -> list[list[Request]]:
        """Episodes holding `requests` requests in all."""
        out, left = [], requests
        while left > 0:
            size = min(left, self.rng.randint(self.settings.min_episode, self.settings.max_episode))
            out.append(self.episode(size))
            left -= size
        return out

    def episode(self, size: int) -> list[Request]:
        rng = self.rng
        family = rng.choice(self.corpus.families)
        policy = rng.choice(self.settings.policies)
        self._used = []
        return [self.request(family, policy if rng.random() < 0.7 else rng.choice(self.settings.policies))
                for _ in range(size)]

    def _prompt(self, family: Sequence[tuple[int, ...]], split: bool = True) -> Prompt:
        """Often a prompt the episode sent before (the same prompt under other fields), else a new one."""
        if self._used and self.rng.random() < 0.4:
            return self.rng.choice(self._used)
        prompt = self._new_prompt(family, split)
        self._used.append(prompt)
        return prompt

    def _new_prompt(self, family: Sequence[tuple[int, ...]], split: bool) -> Prompt:
        rng = self.rng
        head = rng.choice(self.corpus.heads[:2]) if rng.random() < 0.8 else rng.choice(self.corpus.heads)
        passages = [rng.choice(family) for _ in range(rng.choice([1, 1, 2]))]
        if rng.random() < 0.2:
            passages.append(rng.choice(rng.choice(self.corpus.families)))
        chunks: list[tuple[int, ...]] = []
        for passage in passages:
            if split and rng.random() < 0.25:
                cut = rng.randint(4, len(passage) - 4)
                chunks += [passage[:cut], passage[cut:]]
            else:
                chunks.append(passage)
        return Prompt(head, tuple(chunks), rng.choice(self.corpus.questions))

    def _plain_prompt(self, family: Sequence[tuple[int, ...]]) -> Prompt:
        """A prompt of 4-7 passages, repeats and other families' included, some split in two
        paragraphs; often one the episode sent before."""
        rng = self.rng
        if self._used and rng.random() < 0.4:
            return rng.choice(self._used)
        chunks: list[tuple[int, ...]] = []
        for _ in range(rng.randint(4, 7)):
            passage = rng.choice(family) if rng.random() < 0.8 else rng.choice(rng.choice(self.corpus.families))
            if rng.random() < 0.2:
                cut = rng.randint(4, len(passage) - 4)
                chunks += [passage[:cut], passage[cut:]]
            else:
                chunks.append(passage)
        prompt = Prompt(rng.choice(self.corpus.heads), tuple(chunks), rng.choice(self.corpus.questions))
        self._used.append(prompt)
        return prompt

    def request(self, family: Sequence[tuple[int, ...]], policy: str) -> Request:
        rng = self.rng
        routes = self.settings.routes
        route = rng.choices(routes, [ROUTE_WEIGHTS[r] for r in routes])[0]
        if route in COMPILE_ROUTES:
            return self._compile(route, family)
        if route in PLAIN_ROUTES:
            # Enough passages for discovery's thresholds: shared, repeated, split into paragraphs.
            prompt = self._plain_prompt(family)
            logprobs = Logprobs(return_logprob=True, top=5) if route == PLAIN_GENERATE and rng.random() < 0.5 \
                else Logprobs()
            return Request(route, policy, (prompt,), logprobs=logprobs, max_new_tokens=self.settings.max_new_tokens)
        if route in TEXT_ROUTES:
            if policy == VANILLA:
                policy = "prefix"
            # Documents are whole passages (the layout puts its own head before them).
            prompt = self._prompt(family, split=False)
            return Request(route, policy, (prompt,), max_new_tokens=self.settings.max_new_tokens)
        if policy == AUTO:  # auto is a RAG route's choice; /generate links a named policy
            policy = rng.choice([p for p in self.settings.policies if p != AUTO] or ["naive"])
        if rng.random() < 0.1:
            policy = VANILLA
        batch = rng.random() < 0.25
        prompts = tuple(self._prompt(family) for _ in range(2 if batch else 1))
        reorders = policy != VANILLA and parse_policy(policy).family.reordered_layout
        client_layout = route == GENERATE and reorders and rng.random() < 0.3
        shortest = min(prompts, key=lambda p: len(p.input_ids))  # logprob_start_len applies to every prompt
        return Request(route, policy, prompts, batch=batch, logprobs=self._logprobs(shortest, policy),
                       extra_key=rng.choice(EXTRA_KEYS) if rng.random() < 0.15 else None,
                       client_layout=client_layout, max_new_tokens=self.settings.max_new_tokens)

    def _logprobs(self, prompt: Prompt, policy: str) -> Logprobs:
        rng = self.rng
        pick = rng.random()
        if pick < 0.3:
            return Logprobs()
        if pick < 0.6:
            return Logprobs(return_logprob=True, top=5)
        if pick < 0.8:
            # Inside the prompt, mostly inside a chunk: SGLang caps its prefix match there.
            start = rng.randint(len(prompt.head), len(prompt.input_ids) - 1)
            return Logprobs(return_logprob=True, start_len=start, top=rng.choice([0, 5]))
        if pick < 0.9:
            return Logprobs(return_logprob=True, start_len=0 if self.settings.start_len_zero else None)
        if policy == VANILLA:
            return Logprobs(return_logprob=True, top=5)
        # Half of these also ask for the last positions' distributions, whose tree match stops
        # before them (all after the last chunk).
        after_chunks = len(prompt.input_ids) - (prompt.spans[-1][1] if prompt.spans else 0)
        span = rng.randint(1, min(8, after_chunks)) if rng.random() < 0.5 else 0
        return Logprobs(return_logprob=rng.random() < 0.5, full_first_token=True, span=span)

    def _compile(self, route: str, family: Sequence[tuple[int, ...]]) -> Request:
        """Pieces anyone may compile: passages, their starts, heads, a passage behind sinks."""
        rng = self.rng
        pieces = []
        for _ in range(rng.randint(1, 3)):
            passage = rng.choice(family)
            pick = rng.random()
            if pick < 0.4:
                pieces.append(passage)
            elif pick < 0.7:
                pieces.append(passage[: rng.randint(4, len(passage) - 1)])
            elif pick < 0.85 or self.settings.bos is None:
                pieces.append(rng.choice(self.corpus.heads[:3]))
            else:
                pieces.append((self.settings.bos,) * 3 + passage)
        return Request(route, "compile", (Prompt((), tuple(pieces), ()),), max_new_tokens=0)
