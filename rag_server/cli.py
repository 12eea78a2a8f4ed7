"""The `picrag` command line."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import import_module
from pathlib import Path

# Before anything imports torch: OpenMP spin-waiting makes torch several times slower on
# small shared CPUs.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

logger = logging.getLogger("picrag")

# `picrag serve`'s exit status when its SGLang runtime died: not restarted in place, since a
# restart costs what a fresh start costs (minutes of model load on CPU), and a supervisor
# (systemd, Kubernetes, a shell loop) restarts the whole server with back-off and counts failures.
RUNTIME_DIED_EXIT = 3
# How long in-flight requests may take to end once the server stops (SIGTERM, a dead runtime).
SHUTDOWN_GRACE_S = 20


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value




def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], not {text}")
    return value


def _byte_size(text: str) -> int:
    """Bytes, as a count with an optional K, M, G or T (binary) suffix: 500M, 20G."""
    from picrag_core.chunk_store_spec import byte_size

    try:
        return byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _byte_size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else _byte_size(text)


def _chunk_store(text: str):
    from picrag_core.chunk_store_spec import parse_chunk_store

    try:
        return parse_chunk_store(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _policy_name(text: str) -> str:
    from rag_server.linking.policy_resolver import NamedPolicy
    from picrag_core.policies import PolicyError

    try:
        NamedPolicy.parse(text)
    except PolicyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _serve(args: argparse.Namespace) -> int:
    """`picrag serve`, behind a Mooncake master of its own when it is asked to start one."""
    if not args.start_mooncake_master:
        return _serve_engines(args)
    from rag_server.launch.mooncake_master import MooncakeMaster, MooncakeMasterError
    from picrag_core.chunk_store_spec import MooncakeSpec

    if not isinstance(args.chunk_store, MooncakeSpec):
        print("picrag serve: error: --start-mooncake-master needs --chunk-store mooncake://HOST:PORT",
              file=sys.stderr)
        return 2
    log = None if args.runtime_log is None else args.runtime_log.with_name(
        f"{args.runtime_log.stem}.mooncake{args.runtime_log.suffix}")
    try:
        master = MooncakeMaster(args.chunk_store, log)
        master.start()
    except MooncakeMasterError as exc:
        print(f"picrag serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve_engines(args)
    finally:
        master.stop()


def _serve_engines(args: argparse.Namespace) -> int:
    import uvicorn

    from rag_server.api.app import create_app
    from rag_server.api.auth import ADMIN_API_KEY_ENV, API_KEY_ENV
    from rag_server.api.upstream import UpstreamTimeouts
    from picrag_core.model_store import resolve_model
    from rag_server.launch.replicas import EngineGroup, engines_for, run_engines
    from rag_server.launch.runtime import RuntimeConfig, SGLangRuntime

    from picrag_core.repair.checkpoint import RepairCheckpointError
    from rag_server.linking.policy_resolver import PolicyResolver, PolicyUnavailable, engine_refusals
    from rag_server.launch.model_check import ModelUnservable, served_model_traits
    from rag_server.launch.repair_checkpoint import choose_repair_checkpoint
    from rag_server.service.quality import QualitySettings
    from rag_server.linking.chunk_discovery import DiscoverySettings
    from rag_server.service.shadow import ShadowSettings
    from rag_server.launch.selfcheck import run_self_check, self_check_layout
    from rag_server.linking.reuse_gate import ReuseGate
    from retrieval.default_corpus import DefaultCorpusError, ensure_default_index

    model_path = resolve_model(args.model)
    try:
        repair_checkpoint, repair_unavailable = choose_repair_checkpoint(model_path, args.repair_checkpoint)
    except RepairCheckpointError as exc:
        print(f"picrag serve: error: {exc}", file=sys.stderr)
        return 2
    config = RuntimeConfig(
        model_path=model_path,
        port=args.runtime_port,
        host=args.runtime_host,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        radix_cache_backend=args.radix_cache_backend or None,
        max_total_tokens=args.max_total_tokens,
        context_length=args.context_length,
        log_level=args.runtime_log_level,
        extra_args=shlex.split(args.runtime_args),
        chunk_store=args.chunk_store,
        chunk_store_max_bytes=args.chunk_store_max_bytes,
        chunk_host_bytes=args.chunk_host_bytes,
        chunk_store_timeout_s=args.chunk_store_timeout,
        repair_checkpoint=repair_checkpoint,
    )
    try:
        runtime = engines_for(config, args.replicas, runtime_url=args.runtime_url, worker_urls=args.worker_url,
                              engines_only=args.engines_only, log_file=args.runtime_log)
    except ValueError as exc:
        print(f"picrag serve: error: {exc}", file=sys.stderr)
        return 2

    try:
        model = served_model_traits(model_path, runtime.config.attention_backend, runtime.config.context_length)
        policies = PolicyResolver.start(args.default_policy,
                                        engine_refusals(runtime.config.attention_backend, repair_unavailable, model))
    except (PolicyUnavailable, ModelUnservable) as exc:
        print(f"picrag serve: error: {exc}", file=sys.stderr)
        return 2

    def terminate(signum, _frame):
        raise SystemExit(128 + signum)

    # uvicorn installs its own handlers once it runs; these cover the minute of runtime start.
    signal.signal(signal.SIGTERM, terminate)
    if isinstance(runtime, EngineGroup):
        return RUNTIME_DIED_EXIT if run_engines(runtime, args.start_timeout) else 0
    index_dir = args.index
    if index_dir is None and not args.no_index:
        try:
            index_dir = ensure_default_index(args.default_corpus_passages)
        except (DefaultCorpusError, OSError) as exc:
            print(f"picrag serve: error: the default corpus: {exc}", file=sys.stderr)
            return 2
    died: list[str] = []
    preload: ThreadPoolExecutor | None = None
    try:
        # The runtime's processes start before this process starts a thread of its own: a process
        # forked while another thread holds a lock inherits the lock held, with no thread left to
        # release it (the test suite forks runtimes from picrag serve, tests/zygote.py, and a
        # replica forked while the other replica's start and the preload ran once never came up).
        runtime.launch()
        # The runtime's start keeps about one core busy: the frontend's own imports and loads run
        # beside it on another (about 3.5 s on 2 CPU cores, which otherwise came after it).
        preload = ThreadPoolExecutor(max_workers=1, thread_name_prefix="picrag-preload")
        layout = None if args.no_selfcheck else preload.submit(self_check_layout, model_path)
        if index_dir is not None:
            preload.submit(import_module, "sentence_transformers")
        runtime.wait_ready(timeout_s=args.start_timeout)
        gate = ReuseGate() if layout is None else ReuseGate(
            run_self_check(runtime.url, layout.result(), policies.unavailable), args.on_selfcheck_failure)
        if args.no_selfcheck:
            logger.info("start-up self-check skipped (--no-selfcheck): chunk reuse is served unchecked")
        checked = policies.gated(gate)
        if gate.refusal:
            logger.warning("chunk-reusing policies %s: %s", gate.as_json()["reuse"], gate.refusal)
            if checked.default != policies.default:
                logger.warning("requests that name no policy are served as %s, not %s",
                               checked.default.name, policies.default.name)
        policies = checked
        logger.info("picrag frontend listening on http://%s:%d (runtime %s)", args.host, args.port, runtime.url)
        # Only of a runtime it started itself: behind the gateway, replicas are watched per process.
        watched = isinstance(runtime, SGLangRuntime) and args.watchdog_timeout > 0
        watchdog_timeout = args.watchdog_timeout if watched else None
        app = create_app(runtime.url, model_path=model_path, index_dir=index_dir, policies=policies,
                         api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                         admin_api_key=args.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None,
                         cors_origins=args.cors_origin, max_inflight=args.max_inflight,
                         max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                         timeouts=UpstreamTimeouts(args.runtime_connect_timeout, args.runtime_first_byte_timeout,
                                                   args.runtime_total_timeout),
                         health_interval_s=args.health_interval,
                         quality=QualitySettings(args.quality_target, args.calibration, repair_checkpoint,
                                                 ShadowSettings(rate=args.shadow_rate)),
                         pass_unlisted_fields=args.pass_unlisted_fields,
                         discovery=DiscoverySettings(args.discover_chunks == "on", args.discover_min_chunk_tokens,
                                                     args.discover_min_linked_tokens),
                         client_idle_timeout_s=args.client_idle_timeout, watchdog_timeout_s=watchdog_timeout,
                         engine_urls=runtime.engine_urls,
                         # Off the event loop: stopping the runtime waits for its processes.
                         on_stall=lambda reason: threading.Thread(target=give_up, args=(reason,)).start())
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                               timeout_graceful_shutdown=SHUTDOWN_GRACE_S))

        def give_up(reason: str) -> None:
            """The runtime died, or its scheduler stalled: for a supervisor to restart picrag serve."""
            died.append(reason)
            logger.error("SGLang runtime %s: ending its in-flight requests with an error and exiting "
                         "with status %d for a supervisor to restart picrag serve", reason, RUNTIME_DIED_EXIT)
            app.state.health.mark_dead(reason)
            # What is left of the runtime goes, so that requests waiting on it fail now.
            runtime.stop(grace_s=2.0)
            server.should_exit = True

        runtime.watch(lambda reason: give_up(f"died ({reason})"))
        server.run()
    finally:
        if preload is not None:
            preload.shutdown(wait=False, cancel_futures=True)
        runtime.stop()
        logger.info("picrag stopped")
    return RUNTIME_DIED_EXIT if died else 0


def _ask(args: argparse.Namespace) -> int:
    from rag_server.bench.batch_qa import AskOptions, BatchError, run_batch

    options = AskOptions(
        url=args.url, policy=args.policy, max_tokens=args.max_tokens, top_k=args.top_k,
        max_passages=args.max_passages, supporting_only=args.supporting_only,
        server_index=args.server_index,
    )
    from retrieval.index import RetrievalIndexError

    try:
        summary = run_batch(args.questions, args.out, options, limit=args.limit, index_dir=args.index)
    except (BatchError, RetrievalIndexError, OSError) as exc:
        print(f"picrag ask: error: {exc}", file=sys.stderr)
        return 1
    return 1 if summary.failed else 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return value


def _model_prepare(args: argparse.Namespace) -> int:
    from picrag_core.model_store import ensure_model

    print(ensure_model(args.preset))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from picrag_core.model_store import DEFAULT_PRESET, PRESETS
    from rag_server.linking.policy_resolver import AUTO, AUTO_SUMMARY, DEFAULT_POLICY
    from picrag_core.policies import POLICY_FAMILIES

    parser = argparse.ArgumentParser(
        prog="picrag",
        description="RAG serving on SGLang with position-independent reuse of passage KV caches.",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from rag_server.api.admission import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_QUEUE
    from rag_server.api.auth import ADMIN_API_KEY_ENV, API_KEY_ENV
    from rag_server.api.body_limit import DEFAULT_MAX_BODY_BYTES
    from rag_server.api.client_timeouts import DEFAULT_CLIENT_IDLE_TIMEOUT_S
    from rag_server.api.progress_watchdog import DEFAULT_WATCHDOG_TIMEOUT_S
    from rag_server.api.rag_api import MAX_BODY_BYTES as MAX_RAG_BODY_BYTES
    from rag_server.api.health import DEFAULT_INTERVAL_S
    from rag_server.api import upstream
    from rag_server.service.quality import DEFAULT_QUALITY_TARGET
    from rag_server.linking.reuse_gate import DEFAULT_FAILURE_ACTION, FAILURE_ACTIONS
    from retrieval import default_corpus
    from rag_server.service.shadow import DEFAULT_SHADOW_RATE
    from rag_server.linking.chunk_discovery import DEFAULT_MIN_CHUNK_TOKENS, DEFAULT_MIN_LINKED_TOKENS

    serve = commands.add_parser(
        "serve", help="start the SGLang runtime and the picrag HTTP frontend",
        description="Start SGLang's runtime on a model and the picrag HTTP frontend in front of it. "
        "CPU: SGLang's CPU engine, torch_native attention, fp32. CUDA: FlashInfer attention.",
    )
    serve.add_argument("--model", default=None, metavar="PRESET|PATH",
                       help=f"a model preset ({', '.join(PRESETS)}; default {DEFAULT_PRESET}, "
                       "converted on first use) or an HF-format model folder (docs/models.md: the families "
                       "tested and the policies each allows)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="frontend port (default 8000)")
    serve.add_argument("--runtime-port", type=int, default=0,
                       help="loopback port of the SGLang runtime (default: a free one)")
    serve.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    serve.add_argument("--dtype", default="auto", help="default: float32 on CPU, the model's dtype on CUDA")
    serve.add_argument("--attention-backend", default="auto",
                       help="default: picrag_native (torch_native computing only query rows) "
                       "on CPU, picrag_flashinfer (FlashInfer with true-position masks) on CUDA")
    serve.add_argument("--radix-cache-backend", default="pic",
                       help="SGLang radix-cache backend: 'pic' (picrag's chunk cache, default) "
                       "or '' for SGLang's default")
    serve.add_argument("--max-total-tokens", type=int, default=16384,
                       help="KV pool size in tokens (default 16384)")
    serve.add_argument("--context-length", type=int, default=None)
    serve.add_argument("--runtime-log", type=Path, default=None,
                       help="write the runtime's output to this file instead of the terminal")
    serve.add_argument("--runtime-log-level", default="warning")
    serve.add_argument("--chunk-store", type=_chunk_store, default=None, metavar="URL",
                       help="keep compiled chunk KV in a store and reload it instead of recomputing: "
                       "file://DIR or DIR (files under DIR; a shared filesystem shares them between "
                       "servers) or mooncake://HOST:PORT[?metadata=URL&segment=SIZE&protocol=tcp|rdma&"
                       "device=DEV&local=HOST] (a Mooncake distributed store through SGLang's HiCache "
                       "storage backend; its master at HOST:PORT). Keyed by a model fingerprint; corrupt "
                       "or foreign values are ignored; a store that is down or slow costs recomputation "
                       "(docs/deployment.md)")
    serve.add_argument("--chunk-store-max-bytes", type=_byte_size, default=None, metavar="SIZE",
                       help="bound on the file:// store's files of this model (e.g. 20G; least recently "
                       "used evicted first; default: 10%% of the free space on DIR's filesystem at start, "
                       "counting the store's own files as free)")
    serve.add_argument("--chunk-host-bytes", type=_byte_size_or_zero, default=None, metavar="SIZE",
                       help="with --chunk-store: RAM per engine for the host-memory tier, which reloads "
                       "chunks evicted from the KV pool before the store (default 2G; 0: off)")
    serve.add_argument("--chunk-store-timeout", type=_positive_float, default=None, metavar="S",
                       help="bound on each call into a mooncake:// store; past it the chunk is computed "
                       "(default 2)")
    serve.add_argument("--start-mooncake-master", action="store_true",
                       help="start a Mooncake master for the mooncake:// --chunk-store on this machine "
                       "(a one-machine trial, e.g. with --replicas; give the URL metadata=http://HOST:PORT/metadata) "
                       "and stop it with the server")
    serve.add_argument("--repair-checkpoint", type=Path, default=None, metavar="DIR",
                       help="CacheRepair checkpoint for policy cacherepair (default: the one shipped "
                       "for the model in cache_repair/checkpoints, if it matches; a checkpoint "
                       "trained for another model is refused)")
    serve.add_argument("--runtime-args", default="",
                       help="extra arguments for SGLang's launch_server, e.g. \"--disable-overlap-schedule\"")
    serve.add_argument("--start-timeout", type=float, default=600.0)
    serve.add_argument("--replicas", type=_positive_int, default=1, metavar="N",
                       help="start N SGLang runtimes (one per GPU on CUDA) behind SGLang's model gateway "
                       "(smg), which routes each request to the replica of its passage set; give them one "
                       "--chunk-store to share compiled chunks (default 1: one runtime, no gateway; "
                       "docs/deployment.md)")
    serve.add_argument("--engines-only", action="store_true",
                       help="start the runtime(s) alone, no gateway and no frontend: engines on a GPU node "
                       "for a `picrag serve --worker-url` elsewhere (bind them with --runtime-host)")
    serve.add_argument("--runtime-host", default="127.0.0.1", metavar="HOST",
                       help="address the runtime(s) listen on (default %(default)s; the engines take no key: "
                       "open them to a private network only)")
    serve.add_argument("--worker-url", action="append", default=[], metavar="URL",
                       help="start no runtime: the model gateway in front of this engine, started elsewhere "
                       "with --engines-only and the same --model (repeatable)")
    serve.add_argument("--runtime-url", default=None, metavar="URL",
                       help="start no runtime and no gateway: the frontend talks to the gateway or runtime at URL")
    index = serve.add_mutually_exclusive_group()
    index.add_argument("--index", type=Path, default=None, metavar="DIR",
                       help="passage index (`picrag index build`) that /rag/query retrieves from (default: "
                       f"the default corpus, {default_corpus.describe()}, indexed under $PICRAG_HOME/indexes on "
                       "first use)")
    index.add_argument("--no-index", action="store_true",
                       help="serve no passage index: RAG requests must carry their documents")
    serve.add_argument("--default-corpus-passages", type=_positive_int, default=None, metavar="N",
                       help="index only the default corpus's first N passages (a faster first start)")
    serve.add_argument("--default-policy", default=None, type=_policy_name,
                       help="link policy of requests that name none (default "
                       f"{DEFAULT_POLICY}; without a CacheRepair checkpoint for the model legolink, and naive "
                       "where the attention backend cannot mask by position): "
                       + "; ".join(f"{f.syntax}: {f.summary}" for f in POLICY_FAMILIES.values())
                       + f"; {AUTO}: {AUTO_SUMMARY} (--quality-target), per request")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help=f"require `Authorization: Bearer KEY` (or `X-API-Key: KEY`) on every route "
                       f"but /health (default: ${API_KEY_ENV}, which keeps the key out of `ps`; "
                       "unset: no key)")
    serve.add_argument("--admin-api-key", default=None, metavar="KEY",
                       help="require this key (sent like the API key) on the admin routes /flush_cache and "
                       "/abort_request; it also opens every other route (default: "
                       f"${ADMIN_API_KEY_ENV}; unset: those routes answer loopback clients only)")
    serve.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="allow browser requests from ORIGIN (repeatable; '*' for any; default: no CORS)")
    serve.add_argument("--max-inflight", type=_positive_int, default=DEFAULT_MAX_INFLIGHT, metavar="N",
                       help=f"requests processed at once (default {DEFAULT_MAX_INFLIGHT})")
    serve.add_argument("--max-queue", type=_non_negative_int, default=DEFAULT_MAX_QUEUE, metavar="N",
                       help=f"requests waiting for a slot (default {DEFAULT_MAX_QUEUE}); "
                       "beyond them: 503 with Retry-After")
    serve.add_argument("--max-body-bytes", type=_byte_size, default=DEFAULT_MAX_BODY_BYTES, metavar="SIZE",
                       help=f"largest request body on any route (default {DEFAULT_MAX_BODY_BYTES >> 20}M; "
                       f"/rag/ routes: at most {MAX_RAG_BODY_BYTES >> 20}M); larger ones get 413 unread")
    serve.add_argument("--runtime-connect-timeout", type=_positive_float, metavar="S",
                       default=upstream.DEFAULT_CONNECT_TIMEOUT_S,
                       help=f"seconds to connect to the runtime (default {upstream.DEFAULT_CONNECT_TIMEOUT_S:g})")
    serve.add_argument("--runtime-first-byte-timeout", type=_positive_float, metavar="S",
                       default=upstream.DEFAULT_FIRST_BYTE_TIMEOUT_S,
                       help="seconds to wait for the runtime's first byte, and between two bytes of a "
                       f"stream (default {upstream.DEFAULT_FIRST_BYTE_TIMEOUT_S:g}: a long prompt's prefill "
                       "takes minutes on CPU); beyond: 504, or an error event in a stream")
    serve.add_argument("--runtime-total-timeout", type=_positive_float, metavar="S",
                       default=upstream.DEFAULT_TOTAL_TIMEOUT_S,
                       help=f"seconds any one call to the runtime may take, streams included (default "
                       f"{upstream.DEFAULT_TOTAL_TIMEOUT_S:g})")
    serve.add_argument("--health-interval", type=_positive_float, default=DEFAULT_INTERVAL_S, metavar="S",
                       help=f"seconds between the probes of the runtime that /health reports "
                       f"(default {DEFAULT_INTERVAL_S:g})")
    serve.add_argument("--watchdog-timeout", type=_non_negative_float, default=DEFAULT_WATCHDOG_TIMEOUT_S,
                       metavar="S", help="a scheduler that has work and makes no progress for S seconds (one "
                       "forward, or one step's stop checks, taking that long) turns /health 503, and picrag serve "
                       f"stops its runtime and exits with status {RUNTIME_DIED_EXIT} for its supervisor (default "
                       f"{DEFAULT_WATCHDOG_TIMEOUT_S:g}: above a long prefill on a slow CPU; 0: off)")
    serve.add_argument("--client-idle-timeout", type=_positive_float, default=DEFAULT_CLIENT_IDLE_TIMEOUT_S,
                       metavar="S", help="seconds a client may stall sending its request body (then 408) or "
                       "reading its answer (then its connection is closed); either way its admission slot is "
                       f"freed (default {DEFAULT_CLIENT_IDLE_TIMEOUT_S:g})")
    serve.add_argument("--pass-unlisted-fields", action="store_true",
                       help="forward request fields the typed allowlist does not list to the runtime, for "
                       "trusted clients (default: 400 naming the field; listed fields keep their bounds either "
                       "way, and the engine holds its own; docs/security.md)")
    serve.add_argument("--discover-chunks", choices=["on", "off"], default="on",
                       help="find the passages inside whole prompts (OpenAI chat and completions, /generate "
                       "without hints) and link them under the default policy; a body opts out with "
                       "\"picrag\": {\"discover\": false} (default on; docs/frontend.md)")
    serve.add_argument("--discover-min-chunk-tokens", type=_positive_int, default=DEFAULT_MIN_CHUNK_TOKENS,
                       metavar="N", help="a paragraph of fewer tokens is no passage of its own: it joins the "
                       f"next one, or stays ordinary prompt (default {DEFAULT_MIN_CHUNK_TOKENS})")
    serve.add_argument("--discover-min-linked-tokens", type=_positive_int, default=DEFAULT_MIN_LINKED_TOKENS,
                       metavar="N", help="a prompt with fewer passage tokens found is left to the prefix cache "
                       f"(default {DEFAULT_MIN_LINKED_TOKENS})")
    serve.add_argument("--quality-target", type=_non_negative_float, default=DEFAULT_QUALITY_TARGET, metavar="KL",
                       help="policy `auto` serves each request with the cheapest policy whose expected "
                       "first-token KL to full, for a prompt of its size, is at most KL (full when none is; "
                       f"default {DEFAULT_QUALITY_TARGET:g})")
    serve.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                       help="`auto`'s table of expected KL per policy and prompt size (default: the one "
                       "shipped for the model in rag_server/calibration; `picrag bench quality "
                       "--write-calibration` writes one)")
    serve.add_argument("--shadow-rate", type=_fraction, default=DEFAULT_SHADOW_RATE, metavar="R",
                       help="fraction of RAG requests (/rag/query, the chat extension; never a client's own "
                       "/generate links) served by a chunk-reusing policy that are also run as full "
                       "for one token in the background, to measure first-token KL and agreement "
                       f"(GET /picrag/quality, /picrag/metrics; default {DEFAULT_SHADOW_RATE:g}; 0: off)")
    serve.add_argument("--on-selfcheck-failure", choices=FAILURE_ACTIONS, default=DEFAULT_FAILURE_ACTION,
                       help="when the start-up self-check finds that chunk reuse does not answer like "
                       "computing the prompt: serve requests for chunk-reusing policies as prefix (default: "
                       "exact, and shared prefixes are still reused), as full, or refuse them (400); "
                       "/health and the log say why")
    serve.add_argument("--no-selfcheck", action="store_true",
                       help="skip the start-up self-check (a few seconds): chunk reuse is served unchecked")
    serve.set_defaults(func=_serve)

    ask = commands.add_parser(
        "ask", help="answer a JSONL file of questions through a running server (batch QA)",
        description="Answer the questions of a JSONL file (shared QA format: id, question, optional "
        "answers and passages) through a running picrag server's /rag/query. Resumable: ids already "
        "in --out are skipped. Prints EM/F1 when the rows carry gold answers.",
    )
    ask.add_argument("--questions", type=Path, required=True, metavar="FILE.jsonl")
    ask.add_argument("--out", type=Path, required=True, metavar="ANSWERS.jsonl",
                     help="answers, one JSON object a line (appended to)")
    ask.add_argument("--url", default="http://127.0.0.1:8000", help="picrag server (default %(default)s)")
    ask.add_argument("--policy", type=_policy_name, default=None, help="link policy, e.g. legolink:16 (default: the server's)")
    source = ask.add_mutually_exclusive_group()
    source.add_argument("--index", type=Path, default=None, metavar="DIR",
                        help="retrieve from this local index instead of using the rows' passages")
    source.add_argument("--server-index", action="store_true",
                        help="ignore the rows' passages: the server retrieves from its --index")
    ask.add_argument("--top-k", type=_positive_int, default=None, metavar="K",
                     help="passages to retrieve (default 5)")
    ask.add_argument("--max-passages", type=_positive_int, default=None, metavar="N",
                     help="rows' passages: use the first N only")
    ask.add_argument("--supporting-only", action="store_true",
                     help="rows' passages: only those marked is_supporting (oracle setting)")
    ask.add_argument("--max-tokens", type=_positive_int, default=32, metavar="N",
                     help="new tokens per answer (default 32)")
    ask.add_argument("--limit", type=_positive_int, default=None, metavar="N", help="the first N questions only")
    ask.set_defaults(func=_ask)

    model = commands.add_parser("model", help="manage model presets")
    model_commands = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    prepare = model_commands.add_parser("prepare", help="convert a preset once; print its folder")
    prepare.add_argument("preset", nargs="?", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    prepare.set_defaults(func=_model_prepare)

    from rag_server.bench import calibrate as bench_calibrate, discovery as bench_discovery, frontier as bench_frontier
    from rag_server.bench import load as bench_load, quality as bench_quality, quality_pool as bench_pool
    from rag_server.bench import quality_compare as bench_compare
    from rag_server.bench import soak as bench_soak, steady as bench_steady
    from rag_server.bench import transparency_cli as bench_transparency

    bench = commands.add_parser("bench", help="quality and load benchmarks of the link policies, auto's calibration, the KL-versus-speed-up plot, the cache-transparency fuzzer, and passages found in whole prompts")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="KIND")
    bench_quality.register(bench_commands)
    bench_pool.register(bench_commands)
    bench_compare.register(bench_commands)
    bench_load.register(bench_commands)
    bench_steady.register(bench_commands)
    bench_soak.register(bench_commands)
    bench_calibrate.register(bench_commands)
    bench_frontier.register(bench_commands)
    bench_transparency.register(bench_commands)
    bench_discovery.register(bench_commands)

    from retrieval.cli import register as register_index_commands

    register_index_commands(commands)

    from cache_repair.cli import register as register_repair_commands

    register_repair_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # httpx logs every health poll at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
