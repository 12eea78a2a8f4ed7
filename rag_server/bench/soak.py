"""`picrag bench soak`: the steady workload held on two engines with faults injected, every request accounted for.

The bench starts `picrag serve --replicas 2` behind SGLang's gateway, with a Mooncake chunk store
whose segment fills within the run and a master it starts itself, sends the steady-state schedule
(rag_server/bench/steady_schedule.py) to it open-loop with the picrag policy mix, and injects
faults on a timeline (rag_server/bench/soak_faults.py): bursts of malformed and over-bound
bodies, slow clients that stop reading, the Mooncake master killed and started again, one engine
killed. Meanwhile it samples the server's process tree (resident memory, open files).

Then it accounts for every request of the workload: answered, refused with a status and a
reason (by reason), or lost (no status: a dropped connection or a hang past the client's
deadline); a sampled share of the answered ones is sent again, one at a time, to the then idle
server, and each answer must equal the one given under load (greedy decoding: a request's answer
does not depend on what else ran). Writes soak.json and soak.md to --out.
"""

from __future__ import annotations

import json
import random
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from rag_server.bench.common import BenchError, command_line, load_layout, machine_description, model_path_of, read_rows, \
    reporting_errors, server
from rag_server.bench.soak_faults import FaultRecord, Targets, run_timeline
from rag_server.bench.steady import DEFAULT_DATASETS, SteadyOptions, _csv, run_system
from rag_server.bench.steady_client import PICRAG, send
from rag_server.bench.steady_report import accounting, minute_rows
from rag_server.bench.steady_schedule import POLICY_MIX, ROUTES, ScheduleSettings, build_schedule
from rag_server.launch.ports import free_port

REPLICA_READY = re.compile(r"replica (\d+) ready at (\S+) \(process group (\d+)\)")
MASTER_READY = re.compile(r"mooncake master ready at \S+, metadata on port \d+ \(process group (\d+)\)")
DEADLINE_S = 300.0  # a request not answered by then is lost


@dataclass(frozen=True)
class SoakOptions:
    steady: SteadyOptions
    segment: str = "64M"  # the Mooncake segment: small enough to fill within the run
    check_share: float = 0.1  # answered requests sent again on the idle server
    monitor_s: float = 5.0
    # A server already running as the soak starts its own (`picrag serve --replicas 2 --chunk-store
    # mooncake://... --start-mooncake-master`), with the log it wrote as it started; None: start one.
    log: Path | None = None
    store: str | None = None  # that server's --chunk-store


class ResourceMonitor:
    """Peak resident memory and open files of a process and its children, sampled in the background."""

    def __init__(self, pid: int, every_s: float):
        self.pid, self.every_s = pid, every_s
        self.peak_rss = 0
        self.peak_files = 0
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-resources", daemon=True)

    def _sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        rss = files = 0
        for process in processes:
            try:
                rss += process.memory_info().rss
                files += process.num_fds()
            except psutil.Error:
                continue
        self.peak_rss, self.peak_files = max(self.peak_rss, rss), max(self.peak_files, files)
        self.samples.append({"at": time.time(), "rss": rss, "files": files, "processes": len(processes)})

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> ResourceMonitor:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _master_restarter(store: str, log: Path):
    from rag_server.launch.mooncake_master import MooncakeMaster
    from picrag_core.chunk_store_spec import parse_chunk_store

    started: list[Any] = []

    def restart() -> str:
        master = MooncakeMaster(parse_chunk_store(store), log)
        master.start()
        started.append(master)
        return f"started again on {master.spec.master}"

    return restart, started


def run_soak(options: SoakOptions, progress: bool = True) -> dict[str, Any]:
    steady = options.steady
    rows = [row for path in steady.datasets for row in read_rows(path, None, None)]
    schedule = build_schedule(rows, steady.schedule)
    if not schedule:
        raise BenchError("the schedule holds no request: raise --rate or --minutes")
    steady.out.mkdir(parents=True, exist_ok=True)
    if steady.url is not None and (options.log is None or options.store is None):
        raise BenchError("a running server is soaked with the log it started with and its --chunk-store")
    store = options.store
    if store is None:
        rpc = free_port()
        metadata = free_port(taken=[rpc])
        store = (f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{metadata}/metadata"
                 f"&segment={options.segment}&local=127.0.0.1")
    log = options.log or steady.out / "server.log"
    serve_args = ["--replicas", "2", "--chunk-store", store, "--start-mooncake-master", "--chunk-store-timeout", "5",
                  "--shadow-rate", "0"]
    if steady.max_total_tokens:
        serve_args += ["--max-total-tokens", str(steady.max_total_tokens)]
    restart_master, restarted = _master_restarter(store, steady.out / "mooncake-restarted.log")
    faults: list[FaultRecord] = []
    with server(steady.url, steady.model, steady.port, log, serve_args) as url:
        text = log.read_text(errors="replace")
        replicas = sorted(REPLICA_READY.findall(text))
        master = MASTER_READY.search(text)
        model_dir = model_path_of(url, steady.model)
        layout = load_layout(model_dir)
        targets = Targets(url, len(layout.tokenizer), [int(group) for _, _, group in replicas],
                          int(master.group(1)) if master else None, restart_master)
        default = httpx.get(f"{url}/picrag/policies", timeout=30).json()["default"]
        serve_pid = _serve_pid(url)
        stop = threading.Event()
        try:
            with ResourceMonitor(serve_pid, options.monitor_s) as resources:
                started = time.perf_counter()
                injector = threading.Thread(target=run_timeline, args=(targets, steady.schedule.minutes, started,
                                                                       stop, faults), name="soak-faults", daemon=True)
                injector.start()
                outcomes, samples = run_system(url, PICRAG, schedule, layout, steady, default, progress)
                stop.set()
                injector.join()
            healthy = httpx.get(f"{url}/health", timeout=60).status_code == 200
            checked = _check_answers(url, schedule, outcomes, layout, steady, default, options.check_share)
        finally:
            stop.set()
            for master_process in restarted:
                master_process.stop()
    counted = accounting(outcomes)
    report = {
        "command": steady.command,
        "model": str(model_dir),
        "machine": machine_description(),
        "settings": {**asdict(steady.schedule), "clients": steady.clients, "max_tokens": steady.max_tokens,
                     "max_total_tokens": steady.max_total_tokens, "segment": options.segment, "replicas": 2,
                     "requests": len(schedule), "deadline_s": DEADLINE_S},
        "accounting": counted,
        "faults": [asdict(f) for f in faults],
        "faults_by_kind": {kind: sum(f.kind == kind for f in faults) for kind in dict.fromkeys(f.kind for f in faults)},
        "correctness": checked,
        "healthy_at_end": healthy,
        "peak_rss_bytes": resources.peak_rss,
        "peak_open_files": resources.peak_files,
        "resources": resources.samples,
        "minutes": minute_rows(outcomes, samples, max(1, round(steady.schedule.minutes * 60 / steady.bucket_s)),
                               steady.bucket_s),
        "requests": [asdict(o) for o in outcomes],
        "counters": [asdict(s) for s in samples],
    }
    (steady.out / "soak.json").write_text(json.dumps(report, indent=2))
    (steady.out / "soak.md").write_text(markdown(report))
    return report


def _serve_pid(url: str) -> int:
    """The pid of the `picrag serve` listening on `url` (the root of the tree to watch)."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
            return connection.pid
    raise BenchError(f"no process listens on port {port}")


def _check_answers(url: str, schedule, outcomes, layout, steady: SteadyOptions, default: str,
                   share: float) -> dict[str, Any]:
    """A seeded share of the answered requests, sent again one at a time: the same answer?"""
    answered = [o for o in outcomes if o.answered]
    rng = random.Random(steady.schedule.seed)
    picked = sorted(rng.sample(answered, max(1, round(share * len(answered)))), key=lambda o: o.index) if answered else []
    differing = []
    with httpx.Client(base_url=url, timeout=DEADLINE_S) as client:
        for outcome in picked:
            again = send(client, schedule[outcome.index], PICRAG, layout, steady.max_tokens, default,
                         time.perf_counter() - schedule[outcome.index].at_s)
            if not again.answered or again.text != outcome.text:
                differing.append({"index": outcome.index, "under_load": outcome.text, "idle": again.text,
                                  "idle_error": again.error})
    return {"checked": len(picked), "equal": len(picked) - len(differing), "differing": differing}


def markdown(report: dict[str, Any]) -> str:
    counted = report["accounting"]
    lines = ["| requests | answered | refused | lost | faults | same answer when idle | peak RSS | peak open files "
             "| healthy at end |", "|---|---|---|---|---|---|---|---|---|",
             f"| {counted['requests']} | {counted['answered']} | {sum(counted['refused'].values())} | {counted['lost']} "
             f"| {', '.join(f'{k} x{n}' for k, n in report['faults_by_kind'].items())} "
             f"| {report['correctness']['equal']} of {report['correctness']['checked']} "
             f"| {report['peak_rss_bytes'] / 2**30:.2f} GiB | {report['peak_open_files']} "
             f"| {'yes' if report['healthy_at_end'] else 'NO'} |", ""]
    if counted["refused"]:
        lines += ["Refused, by reason:", ""] + [f"- {n} x {reason}" for reason, n in counted["refused"].items()] + [""]
    lines += ["Faults:", ""] + [f"- {f['at_s']:.0f} s {f['kind']}: {'ok' if f['ok'] else 'FAILED'}"
                                f"{' ' + json.dumps(f['statuses']) if f['statuses'] else ''} {f['detail']}"
                                for f in report["faults"]]
    return "\n".join(lines) + "\n"


def register(commands) -> None:
    parser = commands.add_parser(
        "soak", help="the steady workload on two engines with faults injected: every request accounted for",
        description="Two engines behind SGLang's gateway with a Mooncake store that fills; the steady-state "
        "schedule open-loop while bad input, slow clients, a Mooncake master stop and restart and an engine kill "
        "are injected; every request accounted for, a sampled share checked against the idle server "
        "(soak.json, soak.md in --out).")
    parser.add_argument("--dataset", type=Path, action="append", default=None, metavar="FILE.jsonl")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/qa"), help="where the default files are")
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the soak (default 30)")
    parser.add_argument("--rate", type=float, default=0.3, help="arrivals per second (default 0.3)")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--novel", type=float, default=0.2)
    parser.add_argument("--pool", type=int, default=200)
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--policies", default=",".join(POLICY_MIX))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool of each engine")
    parser.add_argument("--segment", default="64M", help="the Mooncake segment (default 64M: it fills)")
    parser.add_argument("--check-share", type=float, default=0.1,
                        help="share of answered requests sent again on the idle server (default 0.1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, metavar="PRESET|PATH")
    parser.add_argument("--port", type=int, default=8035)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.set_defaults(func=_main)


@reporting_errors("soak")
def _main(args) -> int:
    datasets = tuple(args.dataset or (args.data / name for name in DEFAULT_DATASETS))
    schedule = ScheduleSettings(minutes=args.minutes, rate=args.rate, zipf=args.zipf, novel=args.novel, pool=args.pool,
                                passages=args.passages, routes=_csv(args.routes, "routes", ROUTES),
                                policies=_csv(args.policies, "policies"), seed=args.seed)
    steady = SteadyOptions(datasets=datasets, out=args.out, schedule=schedule, systems=(PICRAG,), clients=args.clients,
                           max_tokens=args.max_tokens, max_total_tokens=args.max_total_tokens, model=args.model,
                           port=args.port, command=command_line())
    run_soak(SoakOptions(steady, args.segment, args.check_share))
    print((args.out / "soak.md").read_text())
    print(f"-> {args.out}/soak.json, soak.md", file=sys.stderr)
    return 0
