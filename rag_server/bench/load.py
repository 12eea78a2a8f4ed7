"""`picrag bench load`: closed-loop load with passages that repeat across requests.

Every one of the first `--pool` questions of a dev file is asked equally often (default pool:
a quarter of the requests, so each passage recurs 4 times), in a seeded random order, each time
with its passages in a fresh random order: the same passages come back in another order, as
retrieval does for related questions, so the chunk store can reuse them while SGLang's prefix
cache (`prefix`) only matches up to the first passage that moved. `--keep-order` keeps the
dataset's order (then repeats are exact and `prefix` hits up to the question).

`--shadow-rates 0,0.02` runs the picrag cells once per shadow-sampling rate, each on a server
started with that `--shadow-rate` (default: 0 only), so the cost of shadow sampling is measured
side by side in one run.

The pseudo-policy `vanilla` is the comparison a user would make: stock SGLang (its own radix
cache, its stock attention backend, no picrag plugin loaded) started by the bench on the same
model and KV pool size, sent the same prompts as plain /generate requests.

Each (policy, concurrency) cell starts from an empty cache (`/flush_cache`) and runs the same
request list: `concurrency` clients, each sending its next request as soon as the previous one
finished (closed loop). With `--warm-up`, every pool question is first asked once, in the
dataset's passage order and off the clock (as a deployment compiles its corpus before serving
it): chunk policies then start with every passage stored, `prefix` and `vanilla` with those
prompts cached; the timed requests are the same. Throughput is requests (and generated
tokens) over the cell's wall time. The store hit rate, the engine's link refusals and the
frontend's relinks come from the servers' counters, so the server must not serve other traffic
during the run.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from threading import Lock
from typing import Any

import httpx

from picrag_core.policies import policy_names
from rag_server.bench.common import (
    BenchError,
    Measured,
    add_dataset_arguments,
    add_server_arguments,
    chunk_counters,
    command_line,
    fmt,
    load_layout,
    machine_description,
    measure,
    model_path_of,
    parse_policies,
    read_rows,
    render_table,
    reporting_errors,
    server,
    shuffled,
    unavailable_entries,
)
from rag_server.launch.runtime import RuntimeConfig, SGLangRuntime, cuda_available
from rag_server.service.percentile import percentile
from retrieval.prompt_layout import CompiledPrompt

VANILLA = "vanilla"
FRONTEND_METRICS = "/picrag/metrics"  # the frontend's relinks and shadow pairs (stock SGLang: 404)
# Stock SGLang's attention backends, where picrag's own subclass them.
STOCK_ATTENTION = {"cpu": "torch_native", "cuda": "flashinfer"}


@dataclass(frozen=True)
class LoadOptions:
    dataset: Path
    policies: str
    concurrency: tuple[int, ...]
    requests: int
    out: Path
    pool: int | None = None  # None: requests // 4
    shadow_rates: tuple[float, ...] = (0.0,)  # one picrag server per rate
    max_total_tokens: int | None = None  # KV pool of the servers started here; None: picrag serve's default
    max_passages: int | None = None
    max_tokens: int = 16
    keep_order: bool = False
    warm_up: bool = False  # each pool question asked once, off the clock, before each cell
    seed: int = 0
    url: str | None = None
    model: str | None = None
    port: int = 8032
    command: str = ""


@dataclass
class Cell:
    policy: str
    concurrency: int
    shadow_rate: float | None  # the picrag server's --shadow-rate; None: vanilla
    requests: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    reused_token_fraction: float
    # Chunks found in the store at link time / chunks linked; None where the policy does not
    # use the chunk store. Near 1 by construction: the frontend compiles before it links.
    link_hit_rate: float | None
    # Compiles (head + passages) that found their piece already stored: the reuse across
    # requests, from the server's picrag_compile_chunk_* counters; None without compiles.
    store_hit_rate: float | None = None
    # Links the frontend sent again because a chunk was missing, and links the engine refused
    # unrun for that reason (each refusal is one relink that computed nothing); None: vanilla.
    relinks: int | None = None
    link_refusals: int | None = None
    shadow_pairs: int | None = None  # shadow pairs the frontend sent during the cell


def pool_size(options: LoadOptions) -> int:
    return options.pool or max(1, options.requests // 4)


def build_requests(options: LoadOptions, layout) -> tuple[list[CompiledPrompt], list[CompiledPrompt]]:
    """(the timed requests, the warm-up: with --warm-up every pool question once, its passages in
    the dataset's order; otherwise none)."""
    rows = read_rows(options.dataset, pool_size(options), options.max_passages)
    warm_up = [layout.build(row.question, row.passages) for row in rows] if options.warm_up else []
    rng = random.Random(options.seed)
    picks = [rows[i % len(rows)] for i in range(options.requests)]
    rng.shuffle(picks)
    prompts = []
    for row in picks:
        passages = row.passages if options.keep_order else shuffled(row.passages, rng)
        prompts.append(layout.build(row.question, passages))
    return prompts, warm_up


def flush_when_idle(client: httpx.Client, timeout_s: float = 60.0) -> None:
    """Empty the runtime's cache. SGLang refuses a flush (400) while it still holds requests,
    which it may for a moment after the last answer of a burst has come back."""
    deadline = time.monotonic() + timeout_s
    while (response := client.post("/flush_cache")).status_code != 200:
        if time.monotonic() >= deadline:
            raise BenchError(f"/flush_cache kept failing for {timeout_s:.0f} s: {response.status_code} "
                             f"{response.text[:200]}")
        time.sleep(0.05)  # the runtime lets go of a finished request within milliseconds


def run_cell(url: str, prompts: list[CompiledPrompt], policy: str, concurrency: int, max_tokens: int,
             shadow_rate: float | None = None) -> Cell:
    """One cell; `policy` VANILLA sends plain prompts."""
    queue = list(enumerate(prompts))
    lock = Lock()
    done: list[Measured] = []

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=1800) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    _, prompt = queue.pop(0)
                measured = measure(client, prompt, None if policy == VANILLA else policy, max_tokens)
                with lock:
                    done.append(measured)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    wall = time.perf_counter() - started
    hits, misses = sum(m.report.chunk_hits for m in done), sum(m.report.chunk_misses for m in done)
    ttfts = [m.ttft_s for m in done]
    return Cell(
        policy=policy, concurrency=concurrency, shadow_rate=shadow_rate, requests=len(done), wall_s=wall,
        requests_per_s=len(done) / wall,
        output_tokens_per_s=sum(m.report.completion_tokens for m in done) / wall,
        prompt_tokens_per_s=sum(m.report.prompt_tokens for m in done) / wall,
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        reused_token_fraction=sum(m.report.reused_tokens for m in done) / max(sum(m.report.prompt_tokens for m in done), 1),
        link_hit_rate=hits / (hits + misses) if hits + misses else None,
    )


TABLE_COLUMNS = ("policy", "concurrency", "shadow rate", "requests", "req/s", "output tok/s", "prompt tok/s",
                 "TTFT p50 (s)", "TTFT p99 (s)", "reused token share", "store hit rate", "link hit rate", "relinks")


def markdown_table(cells: list[Cell], unavailable: list[dict[str, str]]) -> str:
    rows = [(c.policy, str(c.concurrency), fmt(c.shadow_rate), str(c.requests), fmt(c.requests_per_s, 3),
             fmt(c.output_tokens_per_s), fmt(c.prompt_tokens_per_s, 0), fmt(c.ttft_p50_s), fmt(c.ttft_p99_s),
             fmt(c.reused_token_fraction), fmt(c.store_hit_rate), fmt(c.link_hit_rate), fmt(c.relinks, 0))
            for c in cells]
    return render_table(TABLE_COLUMNS, rows, unavailable)


@contextmanager
def vanilla_server(model_dir: Path, log: Path, max_total_tokens: int | None) -> Iterator[str]:
    """Stock SGLang on `model_dir`, with picrag serve's KV pool size and no picrag plugin."""
    device = "cuda" if cuda_available() else "cpu"
    config = RuntimeConfig(model_path=model_dir, device=device, attention_backend=STOCK_ATTENTION[device],
                           radix_cache_backend=None, plugins=False)
    if max_total_tokens:
        config.max_total_tokens = max_total_tokens
    runtime = SGLangRuntime(config, log_file=log)
    runtime.start()
    try:
        yield runtime.url
    finally:
        runtime.stop()


def run_cells(url: str, prompts: list[CompiledPrompt], warm_up: list[CompiledPrompt], policy: str,
              options: LoadOptions, progress: bool, shadow_rate: float | None = None) -> list[Cell]:
    """The cells of `policy`, one per concurrency; `warm_up` is sent before each (untimed, its
    counters not counted)."""
    cells = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for concurrency in options.concurrency:
            flush_when_idle(client)
            if warm_up:
                run_cell(url, warm_up, policy, concurrency, 1)
            before, frontend_before = chunk_counters(client), chunk_counters(client, FRONTEND_METRICS)
            cell = run_cell(url, prompts, policy, concurrency, options.max_tokens, shadow_rate)
            after, frontend_after = chunk_counters(client), chunk_counters(client, FRONTEND_METRICS)
            delta = {k: after.get(k, 0) - before.get(k, 0)
                     for k in ("compile_chunk_hits", "compile_chunk_misses", "link_refusals")}
            total = delta["compile_chunk_hits"] + delta["compile_chunk_misses"]
            cell.store_hit_rate = delta["compile_chunk_hits"] / total if total else None
            if policy != VANILLA:
                grew = {k: int(frontend_after.get(k, 0) - frontend_before.get(k, 0))
                        for k in ("frontend_relinks", "shadow_requests")}
                cell.relinks, cell.shadow_pairs = grew["frontend_relinks"], grew["shadow_requests"]
                cell.link_refusals = int(delta["link_refusals"])
            cells.append(cell)
            if progress:
                shadow = f" (shadow rate {shadow_rate:g})" if shadow_rate else ""
                print(f"{policy} x{concurrency}{shadow}: {cell.requests_per_s:.3f} req/s, "
                      f"TTFT p50 {cell.ttft_p50_s:.2f} s", file=sys.stderr, flush=True)
    return cells


def run_load(options: LoadOptions, progress: bool = True) -> dict[str, Any]:
    names = policy_names(options.policies)
    with_vanilla = VANILLA in names
    picrag_policies = ",".join(name for name in names if name != VANILLA)
    choices = parse_policies(picrag_policies) if picrag_policies else []
    runnable = [c.name for c in choices if c.available]
    unavailable = unavailable_entries(choices)
    options.out.mkdir(parents=True, exist_ok=True)
    cells: list[Cell] = []
    if options.url is not None and len(options.shadow_rates) > 1:
        raise BenchError("--shadow-rates with several rates starts a server per rate: drop --url")
    for rate in options.shadow_rates if runnable else ():
        log = options.out / ("server.log" if rate == 0 else f"server-shadow-{rate:g}.log")
        serve_args = ["--shadow-rate", f"{rate:g}"]
        if options.max_total_tokens:
            serve_args += ["--max-total-tokens", str(options.max_total_tokens)]
        with server(options.url, options.model, options.port, log, serve_args) as url:
            if options.url is not None:
                rate = httpx.get(f"{url}/picrag/quality", timeout=30).json()["shadow_settings"]["rate"]
            model_dir = model_path_of(url, options.model)
            prompts, warm_up = build_requests(options, load_layout(model_dir))
            for policy in runnable:
                cells += run_cells(url, prompts, warm_up, policy, options, progress, rate)
    if with_vanilla:
        if not runnable:
            from picrag_core.model_store import resolve_model

            model_dir = resolve_model(options.model)  # None: the default preset, as `picrag serve`
            prompts, warm_up = build_requests(options, load_layout(model_dir))
        with vanilla_server(model_dir, options.out / "vanilla.log", options.max_total_tokens) as url:
            cells += run_cells(url, prompts, warm_up, VANILLA, options, progress)
    report = {
        "command": options.command,
        "dataset": str(options.dataset),
        "model": str(model_dir),
        "machine": machine_description(),
        "settings": {"requests": options.requests, "pool": pool_size(options),
                     "shadow_rates": list(options.shadow_rates), "max_total_tokens": options.max_total_tokens,
                     "max_passages": options.max_passages,
                     "max_tokens": options.max_tokens, "keep_order": options.keep_order,
                     "warm_up": options.warm_up, "seed": options.seed,
                     "prompt_tokens_mean": statistics.fmean(len(p.input_ids) for p in prompts)},
        "method": "closed loop; each cell starts from a flushed cache"
                  + (", then every pool question asked once off the clock," if options.warm_up else "")
                  + " and runs the same request list",
        "cells": [asdict(c) for c in cells],
        "unavailable": unavailable,
    }
    (options.out / "load.json").write_text(json.dumps(report, indent=2))
    (options.out / "load.md").write_text(markdown_table(cells, unavailable))
    return report


def _rate_list(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(",") if v.strip())
    if not values or not all(0 <= v <= 1 for v in values):
        raise ValueError(f"--shadow-rates needs rates within [0, 1], not {text!r}")
    return values


def _concurrency_list(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency needs positive integers, not {text!r}")
    return values


def register(commands) -> None:
    """Add `bench load` to the `bench` command group's subparsers."""
    load = commands.add_parser(
        "load", help="closed-loop load with passage reuse: throughput, TTFT p50/p99, cache hit rates",
        description="Closed-loop load from dev questions whose passages repeat across requests; "
        "one table over policies x concurrency in one run (load.json, load.md in --out).",
    )
    add_dataset_arguments(load)
    load.add_argument("--policies", default=f"prefix,naive,{VANILLA}",
                      help=f"picrag policies, and {VANILLA!r}: stock SGLang started here on the same model")
    load.add_argument("--concurrency", type=_concurrency_list, default=(1, 4, 16), metavar="N,N,...")
    load.add_argument("--requests", type=int, default=64, help="requests per cell (default 64)")
    load.add_argument("--pool", type=int, default=None,
                      help="distinct questions, each asked equally often (default: requests / 4)")
    load.add_argument("--max-tokens", type=int, default=16, help="new tokens per request (default 16)")
    load.add_argument("--keep-order", action="store_true", help="do not shuffle passages per request")
    load.add_argument("--warm-up", action="store_true",
                      help="before each cell, ask every pool question once off the clock (a corpus compiled ahead)")
    load.add_argument("--max-total-tokens", type=int, default=None,
                      help="KV pool (tokens) of the servers started here, vanilla's too (default: picrag serve's)")
    load.add_argument("--shadow-rates", type=_rate_list, default=(0.0,), metavar="R,R,...",
                      help="run the picrag cells on a server per shadow-sampling rate (default 0)")
    load.add_argument("--seed", type=int, default=0)
    add_server_arguments(load, default_port=8032)
    load.set_defaults(func=_main)


@reporting_errors("load")
def _main(args) -> int:
    options = LoadOptions(
        dataset=args.dataset, policies=args.policies, concurrency=args.concurrency, requests=args.requests,
        out=args.out, pool=args.pool, max_passages=args.max_passages, max_tokens=args.max_tokens,
        keep_order=args.keep_order, warm_up=args.warm_up, seed=args.seed, shadow_rates=args.shadow_rates,
        max_total_tokens=args.max_total_tokens, url=args.url,
        model=args.model, port=args.port, command=command_line(),
    )
    report = run_load(options)
    print((options.out / "load.md").read_text())
    print(f"-> {options.out}/load.json, load.md")
    return 0 if report["cells"] else 1
