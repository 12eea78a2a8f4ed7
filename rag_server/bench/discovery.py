"""`picrag bench discovery`: LMCache's blending stress workload, sent as clients send it.

Each request is a system prompt, then N documents in ONE user message joined by blank lines,
in one permutation of the N (LMCache's `benchmarks/blend_v2` workload), streamed through the
OpenAI SDK unmodified. Three forms of the same requests run side by side in one run, each from
an emptied cache:

* `prefix`: the documents in the message, `"picrag": {"discover": false}`: SGLang's chat route
  and its prefix cache, what any OpenAI-compatible server without chunk reuse gives;
* `annotated`: the same documents through picrag's chat extension (`picrag.documents`), with a
  one-line question as the user message;
* `discovered`: the documents in the message and nothing else: picrag finds them itself.

Scenarios stress what LMCache's workload stresses: `base` (4 documents of 100 words, a
100-word system prompt), `boundaries` (20 documents), `permutations` (more orders than the
chunk store needs, and prompts that overflow a prefix cache), `identical` (a 6-word
vocabulary: look-alike windows everywhere), `prefix` (a system prompt that dominates the
prompt), `novel` (documents never seen before in every request) and `flood` (every request at
once). The first request of a scenario is on the clock (its documents are compiled then).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from rag_server.bench.common import (add_server_arguments, command_line, fmt, machine_description, render_table,
                                     reporting_errors, server)
from rag_server.bench.load import flush_when_idle
from rag_server.service.percentile import percentile

FORMS = ("prefix", "annotated", "discovered")
ANNOTATED_QUESTION = "Summarize the documents."


@dataclass(frozen=True)
class Scenario:
    name: str
    documents: int = 4
    words: int = 100  # per document
    system_words: int = 100
    vocabulary: int = 1000
    permutations: int = 12
    concurrency: int = 1
    novel: bool = False  # every request brings documents of its own


SCENARIOS = {s.name: s for s in (
    Scenario("base"),
    Scenario("boundaries", documents=20, words=25, permutations=6),
    Scenario("permutations", documents=6, words=60, permutations=24),
    Scenario("identical", vocabulary=6),
    Scenario("prefix", documents=4, words=30, system_words=1200, permutations=8),
    Scenario("novel", permutations=8, novel=True),
    Scenario("flood", permutations=12, concurrency=12),
)}


def _words(rng: random.Random, pool: list[str], count: int) -> str:
    return " ".join(rng.choice(pool) for _ in range(count))


def _vocabulary(size: int, seed: int) -> list[str]:
    """Distinct pseudo-words (LMCache's generator's shape: syllables and a number)."""
    rng = random.Random(seed)
    return [rng.choice("bcdfghjklmnprstvz") + rng.choice("aeiou") + rng.choice("bcdfgklmnprst") + str(i)
            for i in range(size)]


def build_requests(scenario: Scenario, seed: int) -> list[tuple[str, list[str]]]:
    """(system prompt, documents in order) of every request."""
    rng = random.Random(seed)
    pool = _vocabulary(scenario.vocabulary, seed)
    system = _words(rng, ["the", "system", "will", "process", "your", "request", "and", "provide", "an", "answer",
                          "based", "on", "context"], scenario.system_words)
    if scenario.novel:
        return [(system, [_words(rng, pool, scenario.words) for _ in range(scenario.documents)])
                for _ in range(scenario.permutations)]
    documents = [_words(rng, pool, scenario.words) for _ in range(scenario.documents)]
    orders: list[tuple[int, ...]] = []
    if scenario.permutations >= _factorial(scenario.documents):
        orders = list(itertools.permutations(range(scenario.documents)))[:scenario.permutations]
    else:
        seen = set()
        while len(orders) < scenario.permutations:
            order = tuple(rng.sample(range(scenario.documents), scenario.documents))
            if order not in seen:
                seen.add(order)
                orders.append(order)
    return [(system, [documents[i] for i in order]) for order in orders]


def _factorial(n: int) -> int:
    out = 1
    for i in range(2, n + 1):
        out *= i
    return out


def chat_body(form: str, system: str, documents: list[str], max_tokens: int) -> dict[str, Any]:
    """The chat completions body of one request in one form (what the OpenAI SDK sends)."""
    body: dict[str, Any] = {"model": "default", "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if form == "annotated":
        return {**body, "messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": ANNOTATED_QUESTION}],
                "picrag": {"documents": [{"text": d} for d in documents]}}
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(documents)}]
    return {**body, "messages": messages, **({"picrag": {"discover": False}} if form == "prefix" else {})}


@dataclass
class Timed:
    ttft_s: float
    prompt_tokens: int
    discovered_chunks: int


def send(url: str, body: dict[str, Any]) -> Timed:
    """One request through the OpenAI SDK, streamed; TTFT is the first content delta."""
    import openai

    extra = {key: body[key] for key in ("picrag",) if key in body}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=1800, max_retries=0)
    started = time.perf_counter()
    first = None
    prompt_tokens = chunks = 0
    stream = client.chat.completions.create(
        model=body["model"], messages=body["messages"], max_tokens=body["max_tokens"], temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra or None)
    for event in stream:
        if event.choices and event.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if event.usage:
            prompt_tokens = event.usage.prompt_tokens
        found = (event.model_extra or {}).get("picrag") or {}
        chunks = (found.get("discovered") or {}).get("chunks", chunks)
    return Timed((first or time.perf_counter()) - started, prompt_tokens, chunks)


@dataclass
class Row:
    scenario: str
    form: str
    requests: int
    concurrency: int
    prompt_tokens: float
    discovered_chunks: float
    cold_ttft_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    wall_s: float


def run_form(url: str, scenario: Scenario, form: str, requests: list[tuple[str, list[str]]],
             max_tokens: int) -> Row:
    with httpx.Client(base_url=url, timeout=600) as client:
        flush_when_idle(client)
    bodies = [chat_body(form, system, documents, max_tokens) for system, documents in requests]
    started = time.perf_counter()
    cold = send(url, bodies[0])
    with ThreadPoolExecutor(scenario.concurrency) as pool:
        timed = [cold, *pool.map(lambda body: send(url, body), bodies[1:])]
    ttfts = [t.ttft_s for t in timed]
    return Row(scenario.name, form, len(timed), scenario.concurrency,
               statistics.mean(t.prompt_tokens for t in timed), statistics.mean(t.discovered_chunks for t in timed),
               cold.ttft_s, percentile(ttfts, 50), percentile(ttfts, 95), time.perf_counter() - started)


@dataclass(frozen=True)
class DiscoveryOptions:
    scenarios: tuple[str, ...]
    out: Path
    requests: int | None = None  # per scenario and form; None: the scenario's own
    max_tokens: int = 8
    seed: int = 42
    url: str | None = None
    model: str | None = None
    port: int = 8034
    command: str = ""


def run_discovery(options: DiscoveryOptions) -> dict[str, Any]:
    options.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    with server(options.url, options.model, options.port, options.out / "server.log",
                ["--no-index", "--shadow-rate", "0"]) as url:
        for name in options.scenarios:
            scenario = SCENARIOS[name]
            if options.requests is not None:
                scenario = dataclasses.replace(scenario, permutations=options.requests)
            requests = build_requests(scenario, options.seed)
            for form in FORMS:
                rows.append(run_form(url, scenario, form, requests, options.max_tokens))
                print(f"{name:>13} {form:>10}: TTFT p50 {rows[-1].ttft_p50_s:.2f} s", flush=True)
    report = {"command": options.command, "machine": machine_description(),
              "scenarios": {name: asdict(SCENARIOS[name]) for name in options.scenarios},
              "requests_per_form": options.requests,
              "rows": [asdict(row) for row in rows]}
    (options.out / "discovery.json").write_text(json.dumps(report, indent=1))
    (options.out / "discovery.md").write_text(render(rows, options.command))
    return report


def render(rows: list[Row], command: str) -> str:
    by_key = {(row.scenario, row.form): row for row in rows}
    table = []
    for row in rows:
        prefix = by_key.get((row.scenario, "prefix"))
        annotated = by_key.get((row.scenario, "annotated"))
        table.append([row.scenario, row.form, str(row.requests), str(row.concurrency), fmt(row.prompt_tokens, 0),
                      fmt(row.discovered_chunks, 1), fmt(row.cold_ttft_s), fmt(row.ttft_p50_s), fmt(row.ttft_p95_s),
                      fmt(prefix.ttft_p50_s / row.ttft_p50_s) + "x" if prefix else "-",
                      fmt(row.ttft_p50_s / annotated.ttft_p50_s) + "x" if annotated else "-"])
    columns = ["scenario", "form", "requests", "concurrency", "prompt tokens", "chunks found", "cold TTFT s",
               "TTFT p50 s", "TTFT p95 s", "p50 speed-up over prefix", "p50 / annotated p50"]
    return f"`{command}`\n\n" + render_table(columns, table, [])


def _scenarios(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown or text!r}; known: {', '.join(SCENARIOS)}")
    return names


def register(commands) -> None:
    """Add `bench discovery` to the `bench` command group's subparsers."""
    parser = commands.add_parser(
        "discovery", help="LMCache's blending stress workload through the OpenAI SDK: prefix-only, annotated "
        "and discovered passages side by side",
        description="Permutations of documents in one chat message, the forms side by side from an emptied "
        "cache each (discovery.json, discovery.md in --out).")
    parser.add_argument("--scenarios", type=_scenarios, default=tuple(SCENARIOS),
                        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)")
    parser.add_argument("--requests", type=int, default=None, metavar="N",
                        help="requests per scenario and form (default: each scenario's own)")
    parser.add_argument("--max-tokens", type=int, default=8, help="new tokens per request (default 8)")
    parser.add_argument("--seed", type=int, default=42)
    add_server_arguments(parser, default_port=8034)
    parser.set_defaults(func=_main)


@reporting_errors("discovery")
def _main(args) -> int:
    options = DiscoveryOptions(args.scenarios, args.out, args.requests, args.max_tokens, args.seed, args.url,
                               args.model, args.port, command_line())
    run_discovery(options)
    print((options.out / "discovery.md").read_text())
    print(f"-> {options.out}/discovery.json, discovery.md")
    return 0
