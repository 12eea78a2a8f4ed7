"""`picrag bench transparency`: the cache-transparency fuzzer against a running server.

    picrag bench transparency --url http://127.0.0.1:8000 --seed 7 --requests 5000 --out report.json

The server must serve nothing else during the run: the fuzzer flushes its cache before every
episode and every reference. Engine routes need the runtime's URL behind `picrag serve`: found
among this machine's processes, or given with --engine-url (`none`: frontend routes only). Exit
status 1 when a violation was found; the JSON report names the seed, the counts per policy,
route and form, the measured deviations and every violation with the requests that caused it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import httpx

from rag_server.bench.common import BenchError, model_path_of, reporting_errors
from rag_server.bench.transparency import TOLERANCE, FuzzConfig, fuzz
from rag_server.bench.transparency_requests import AUTO, POLICIES, ROUTES, VANILLA, GeneratorSettings, Words
from rag_server.bench.transparency_wire import Wire
from picrag_core.policies import PolicyError, parse_policy, policy_names


def register(commands) -> None:
    """Add `bench transparency` to the `bench` command group's subparsers."""
    parser = commands.add_parser(
        "transparency", help="differential fuzzer: no answer may depend on what other requests did",
        description="Play seeded sequences of colliding requests (every policy, route, hint form and logprob "
        "field) against a running picrag server and compare each answer with the same request on a flushed "
        "cache.",
    )
    parser.add_argument("--url", required=True, help="the running picrag server (it must serve nothing else)")
    parser.add_argument("--engine-url", default=None, metavar="URL",
                        help="the SGLang runtime behind it (default: found among this machine's processes; "
                        "'none': leave out the engine routes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=500, metavar="N", help="requests played (default 500)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="start no episode after this long, and report what was played (default: none)")
    parser.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N",
                        help="play episodes I, I+N, I+2N, ... of the seed's list, to split one run over N "
                        "servers of the same build (default 0/1: all)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: all)")
    parser.add_argument("--routes", default=",".join(ROUTES), help="comma-separated (default: all)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help=f"allowed first-token log-probability deviation (default {TOLERANCE:g})")
    parser.add_argument("--no-start-len-zero", action="store_true",
                        help="never send logprob_start_len 0: fuzz the rest on a runtime that such a request stops")
    parser.add_argument("--no-cross-checks", action="store_true",
                        help="skip the batch-form and frontend-against-runtime checks")
    parser.add_argument("--model", default=None, metavar="PRESET|PATH",
                        help="the tokenizer to build passages with (default: the server's model folder)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE", help="write the JSON report here")
    parser.set_defaults(func=_main)


def runtime_url_of(frontend_url: str) -> Optional[str]:
    """The runtime under the local `picrag serve` listening on `frontend_url`'s port."""
    import psutil

    from rag_server.launch.runtime import runtime_url_under

    port = str(urlparse(frontend_url).port)
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if "serve" not in command or "--port" not in command or command[command.index("--port") + 1] != port:
            continue
        try:
            url = runtime_url_under(process.pid)
        except psutil.Error:
            continue
        if url is not None:
            return url
    return None


def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    try:
        shard = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N") from None
    if not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= I < N")
    return shard


def _routes(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in ROUTES]
    if unknown or not names:
        raise BenchError(f"unknown route(s) {unknown or text!r}; known: {', '.join(ROUTES)}")
    return names


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(policy_names(text))
    try:
        for name in names:
            if name not in (AUTO, VANILLA):
                parse_policy(name)
    except PolicyError as exc:
        raise BenchError(str(exc)) from None
    if not names:
        raise BenchError("--policies names no policy")
    return names


@reporting_errors("transparency")
def _main(args) -> int:
    from transformers import AutoTokenizer

    from rag_server.bench.load import flush_when_idle

    url = args.url.rstrip("/")
    engine_url = None if args.engine_url == "none" else args.engine_url or runtime_url_of(url)
    routes = _routes(args.routes)
    if engine_url is None:
        routes = tuple(r for r in routes if not r.startswith("engine"))
        print("picrag bench transparency: no runtime URL: engine routes left out", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(model_path_of(url, args.model))
    settings = GeneratorSettings(policies=_policies(args.policies), routes=routes,
                                 start_len_zero=not args.no_start_len_zero)
    config = FuzzConfig(seed=args.seed, requests=args.requests, tolerance=args.tolerance, generator=settings,
                        cross_checks=not args.no_cross_checks, time_budget_s=args.time_budget, shard=args.shard)
    with httpx.Client(base_url=url, timeout=600) as frontend, \
            httpx.Client(base_url=engine_url or url, timeout=600) as engine:
        wire = Wire(frontend, engine if engine_url else None, Words.of_tokenizer(tokenizer), tokenizer.bos_token_id)
        report = fuzz(wire, lambda: flush_when_idle(frontend), config)
    text = json.dumps({"command": " ".join(["picrag", *sys.argv[1:]]), "url": url, "engine_url": engine_url,
                       "config": dataclasses.asdict(config), **report.as_json()}, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    shard = "" if args.shard == (0, 1) else f" (shard {args.shard[0]}/{args.shard[1]})"
    print(f"seed {report.seed}{shard}: {report.requests} requests, {report.victims} victims, {report.references} "
          f"references, {sum(report.violation_counts.values())} violation(s) in {report.wall_s:.0f} s; "
          f"deviation {json.dumps(report.deviations.as_json())}", file=sys.stderr)
    for signature, count in sorted(report.violation_counts.items()):
        print(f"  {signature}: {count}", file=sys.stderr)
    if report.stopped is not None:
        print(f"  the server stopped answering: {json.dumps(report.stopped)}", file=sys.stderr)
    return 0 if report.passed else 1
