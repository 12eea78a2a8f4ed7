"""`picrag bench steady`: a RAG workload held open-loop for minutes, on a cache smaller than its corpus.

Chunk caches are judged in steady state, not on a warmed pool: a store that floods or thrashes
loses its speed-up within minutes of novel traffic. This bench sends one open-loop schedule
(rag_server/bench/steady_schedule.py: Poisson arrivals, Zipf-popular questions and a share of
novel ones, every question's passages in a fresh order, a mix of routes and policies) to each
system in turn, from an emptied cache, with every chunk compiled on the clock the first time it
is seen:

* `picrag`: the schedule's own mix of policies (the server's default, `auto`, `naive`);
* `prefix`: the same picrag server, every request on SGLang's prefix cache;
* `vanilla`: stock SGLang (no picrag plugin) on the same model and KV pool, every request as a
  plain `/generate` of the prompt picrag builds.

The corpus is every passage of the QA files given (by default the dev and training files of the
three multi-hop sets): thousands of passages, many times the KV pool (`--max-total-tokens`).
Arrivals never wait for answers; at most `--clients` requests are in flight, and a request that
finds every client busy waits, its wait counted in its TTFT (from its scheduled arrival).
Results (rag_server/bench/steady_report.py): per system and minute, answered per second, TTFT
p50/p99, reuse, chunk hits by tier, compiles, evictions and relinks; picrag's speed-up over each
other system per minute; every request accounted for. Writes steady.json, steady.md and
steady.png to --out.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from rag_server.bench.common import (
    BenchError,
    chunk_counters,
    command_line,
    load_layout,
    machine_description,
    model_path_of,
    read_rows,
    reporting_errors,
    server,
)
from rag_server.bench.load import FRONTEND_METRICS, flush_when_idle, vanilla_server
from rag_server.bench.steady_client import PICRAG, PREFIX, VANILLA, Outcome, send, unsent_outcome
from rag_server.bench.steady_report import Sample, accounting, markdown, minute_rows, plot, speedups, ttft_speedups
from rag_server.bench.steady_schedule import (POLICY_MIX, ROUTES, ScheduleSettings, Scheduled, build_schedule,
                                              expected_repeat_share, repeat_share)
from retrieval.prompt_layout import PromptLayout

SYSTEMS = (PICRAG, PREFIX, VANILLA)
DEFAULT_DATASETS = tuple(f"{name}.{split}.jsonl" for name in ("hotpotqa", "2wikimultihopqa", "musique")
                         for split in ("dev", "train"))


@dataclass(frozen=True)
class SteadyOptions:
    datasets: tuple[Path, ...]
    out: Path
    schedule: ScheduleSettings
    systems: tuple[str, ...] = SYSTEMS
    clients: int = 16  # requests in flight at most
    max_tokens: int = 16
    max_total_tokens: int | None = None  # KV pool of the servers started here (None: picrag serve's)
    serve_args: tuple[str, ...] = ()  # more `picrag serve` flags for the picrag server started here
    bucket_s: float = 60.0  # the report's time step
    url: str | None = None
    model: str | None = None
    port: int = 8034
    command: str = ""


def run_system(url: str, system: str, schedule: list[Scheduled], layout: PromptLayout, options: SteadyOptions,
               default_policy: str, progress: bool) -> tuple[list[Outcome], list[Sample]]:
    """The schedule against one system, open loop; the counters sampled every bucket."""
    samples: list[Sample] = []
    stop = threading.Event()
    limits = httpx.Limits(max_connections=options.clients + 4)
    with httpx.Client(base_url=url, timeout=600, limits=limits) as client:
        flush_when_idle(client)

        def sample(at_s: float) -> None:
            counters = chunk_counters(client)
            counters.update(chunk_counters(client, FRONTEND_METRICS) if system != VANILLA else {})
            samples.append(Sample(at_s, counters))

        started = time.perf_counter()
        sample(0.0)

        def sampler() -> None:
            step = 1
            while not stop.wait(max(0.0, step * options.bucket_s - (time.perf_counter() - started))):
                sample(step * options.bucket_s)
                step += 1

        watcher = threading.Thread(target=sampler, name="steady-counters", daemon=True)
        watcher.start()
        with ThreadPoolExecutor(max_workers=options.clients, thread_name_prefix=f"steady-{system}") as pool:
            futures = []
            for request in schedule:
                time.sleep(max(0.0, request.at_s - (time.perf_counter() - started)))
                futures.append(pool.submit(send, client, request, system, layout, options.max_tokens,
                                           default_policy, started))
            # A system slower than the arrivals leaves a backlog: what no client took by the end of
            # the schedule is not sent (and reported so); what is in flight is waited for.
            time.sleep(max(0.0, options.schedule.minutes * 60.0 - (time.perf_counter() - started)))
            unsent = {index for index, future in enumerate(futures) if future.cancel()}
            outcomes = [unsent_outcome(schedule[index], system) if index in unsent else future.result()
                        for index, future in enumerate(futures)]
        stop.set()
        watcher.join()
        sample(time.perf_counter() - started)
    if progress:
        answered = sum(o.answered for o in outcomes)
        print(f"{system}: {answered} of {len(outcomes)} answered in {samples[-1].at_s:.0f} s", file=sys.stderr,
              flush=True)
    return outcomes, samples


def run_steady(options: SteadyOptions, progress: bool = True) -> dict[str, Any]:
    rows = [row for path in options.datasets for row in read_rows(path, None, None)]
    try:
        schedule = build_schedule(rows, options.schedule)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    if not schedule:
        raise BenchError("the schedule holds no request: raise --rate or --minutes")
    options.out.mkdir(parents=True, exist_ok=True)
    minutes = max(1, round(options.schedule.minutes * 60 / options.bucket_s))
    results: dict[str, tuple[list[Outcome], list[Sample]]] = {}
    model_dir: Path | None = None
    picrag_systems = [s for s in options.systems if s != VANILLA]
    serve_args = [*options.serve_args]
    if options.max_total_tokens is not None:
        serve_args += ["--max-total-tokens", str(options.max_total_tokens)]
    if picrag_systems:
        with server(options.url, options.model, options.port, options.out / "server.log", serve_args) as url:
            model_dir = model_path_of(url, options.model)
            layout = load_layout(model_dir)
            default = httpx.get(f"{url}/picrag/policies", timeout=30).json()["default"]
            for system in picrag_systems:
                results[system] = run_system(url, system, schedule, layout, options, default, progress)
    if VANILLA in options.systems:
        if model_dir is None:
            from picrag_core.model_store import resolve_model

            model_dir = resolve_model(options.model)
            layout = load_layout(model_dir)
        with vanilla_server(model_dir, options.out / "vanilla.log", options.max_total_tokens) as url:
            results[VANILLA] = run_system(url, VANILLA, schedule, layout, options, "", progress)
    per_system = {system: minute_rows(outcomes, samples, minutes, options.bucket_s)
                  for system, (outcomes, samples) in results.items()}
    others = [system for system in per_system if system != PICRAG and PICRAG in per_system]
    ratios = {system: speedups(per_system, system) for system in others}
    ttft_ratios = {system: ttft_speedups(per_system, system) for system in others}
    settings = options.schedule
    report = {
        "command": options.command,
        "model": str(model_dir),
        "machine": machine_description(),
        "settings": {**asdict(settings), "clients": options.clients, "max_tokens": options.max_tokens,
                     "max_total_tokens": options.max_total_tokens, "serve_args": list(options.serve_args),
                     "bucket_s": options.bucket_s,
                     "datasets": [str(p) for p in options.datasets], "requests": len(schedule)},
        "reuse": {"repeat_share_expected": expected_repeat_share(settings, len(schedule)),
                  "repeat_share_scheduled": repeat_share(schedule)},
        "accounting": {system: accounting(outcomes) for system, (outcomes, _) in results.items()},
        "minutes": per_system,
        "speedup_over": ratios,
        "ttft_speedup_over": ttft_ratios,
        "requests": {system: [asdict(o) for o in outcomes] for system, (outcomes, _) in results.items()},
        "counters": {system: [asdict(s) for s in samples] for system, (_, samples) in results.items()},
    }
    (options.out / "steady.json").write_text(json.dumps(report, indent=2))
    (options.out / "steady.md").write_text(markdown(per_system, ratios, ttft_ratios))
    plot(per_system, ratios, ttft_ratios, options.out / "steady.png",
         f"{Path(str(model_dir)).name}: {settings.rate:g} req/s, Zipf {settings.zipf:g}, {settings.novel:.0%} novel")
    return report


def _csv(text: str, what: str, known: tuple[str, ...] | None = None) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values:
        raise BenchError(f"--{what} names nothing")
    wrong = [v for v in values if known is not None and v not in known]
    if wrong:
        raise BenchError(f"--{what}: unknown {wrong[0]!r}; known: {', '.join(known)}")
    return values


def register(commands) -> None:
    parser = commands.add_parser(
        "steady", help="an open-loop RAG workload held for minutes on a cache smaller than its corpus: picrag, "
        "prefix-only and stock SGLang per minute",
        description="Poisson arrivals of Zipf-popular and novel questions over a corpus many times the KV pool, "
        "a mix of routes and policies, chunks compiled on the clock; the same schedule against picrag, prefix-only "
        "and stock SGLang, reported per minute (steady.json, steady.md, steady.png in --out).")
    parser.add_argument("--dataset", type=Path, action="append", default=None, metavar="FILE.jsonl",
                        help="QA rows with passages (repeatable; default: the dev and training files of HotpotQA, "
                        "2WikiMultihopQA and MuSiQue under --data)")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/qa"), help="where the default files are")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the schedule (default 10)")
    parser.add_argument("--rate", type=float, default=0.5, help="arrivals per second (default 0.5)")
    parser.add_argument("--zipf", type=float, default=1.1, help="exponent of the popular questions' Zipf law (default 1.1)")
    parser.add_argument("--novel", type=float, default=0.2, help="share of questions asked once (default 0.2)")
    parser.add_argument("--pool", type=int, default=200, help="popular questions (default 200)")
    parser.add_argument("--passages", type=int, default=5, help="passages per request (default 5)")
    parser.add_argument("--routes", default=",".join(ROUTES), help=f"route mix (default {','.join(ROUTES)})")
    parser.add_argument("--policies", default=",".join(POLICY_MIX),
                        help=f"policy mix of the picrag system (default {','.join(POLICY_MIX)})")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"systems to run (default {','.join(SYSTEMS)})")
    parser.add_argument("--clients", type=int, default=16, help="requests in flight at most (default 16)")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per answer (default 16)")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="KV pool of the servers started here (default: picrag serve's)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                        help="one more `picrag serve` flag for the picrag server started here (repeatable; "
                        "e.g. --serve-arg=--chunk-store=/var/picrag/chunks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="a running picrag server; default: start one here")
    parser.add_argument("--model", default=None, metavar="PRESET|PATH")
    parser.add_argument("--port", type=int, default=8034)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.set_defaults(func=_main)


@reporting_errors("steady")
def _main(args) -> int:
    datasets = tuple(args.dataset or (args.data / name for name in DEFAULT_DATASETS))
    schedule = ScheduleSettings(
        minutes=args.minutes, rate=args.rate, zipf=args.zipf, novel=args.novel, pool=args.pool,
        passages=args.passages, routes=_csv(args.routes, "routes", ROUTES), policies=_csv(args.policies, "policies"),
        seed=args.seed)
    options = SteadyOptions(datasets=datasets, out=args.out, schedule=schedule, systems=_csv(args.systems, "systems", SYSTEMS),
                            clients=args.clients, max_tokens=args.max_tokens, max_total_tokens=args.max_total_tokens,
                            serve_args=tuple(args.serve_arg),
                            url=args.url, model=args.model, port=args.port, command=command_line())
    run_steady(options)
    print((options.out / "steady.md").read_text())
    print(f"-> {options.out}/steady.json, steady.md, steady.png", file=sys.stderr)
    return 0
