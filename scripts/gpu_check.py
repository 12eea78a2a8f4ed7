"""The device check scripts/gpu_check.sh runs: picrag's CUDA path on models of real shapes, in
one call with a deadline.

Per model (Llama-3.1-8B and Qwen2.5-7B shapes on CUDA; a tiny Llama-3 on CPU, `--device cpu`,
the rehearsal tests/test_gpu_check_rehearsal.py runs):
1. Exactness, on the model's config cut to 2 layers with seeded random weights written to disk
   (so that a torch reference can load the same weights; exactness does not depend on depth),
   in bfloat16 like the speed runs (FlashInfer's JIT builds its kernels once per dtype):
   picrag's start-up self-check (reuse at offset 0 equals SGLang's prefix cache; a LegoLink
   covering every chunk equals `full`), then through picrag's frontend on the
   matrix prompt of tests/test_model_matrix.py: `full` and `naive` against transformers in fp32
   on the same weights, `legolink` covering every chunk, `cacheblend:1.0` and `select:1.0`
   against `full`, `cacherepair` with a zero network against `naive`.
2. Speed, on the whole config with SGLang's `--load-format dummy` (random weights; speed does
   not depend on their values): `picrag bench load`'s cells (rag_server/bench/load.py: closed
   loop, every pool question asked once off the clock, then the timed requests with passages
   reshuffled) for each policy and concurrency, then the same prompts on stock SGLang (no plugin).
Where the exactness model is the speed model (CPU), one runtime serves both.

Every step is written to OUT/gpu_check.json as it ends (a step cut short by the call's limit
leaves the others), and OUT/gpu_check.md holds the tables. A step starts only when the deadline
leaves it the time it needs.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

from picrag_core.link_hints import link_hints  # noqa: E402
from rag_server.bench.load import STOCK_ATTENTION, VANILLA, LoadOptions, markdown_table, run_cells  # noqa: E402
from rag_server.launch.model_check import served_model_traits  # noqa: E402
from rag_server.launch.runtime import (  # noqa: E402
    CPU_ATTENTION_BACKEND, CUDA_ATTENTION_BACKEND, RuntimeConfig, SGLangRuntime)
from rag_server.launch.selfcheck import TOLERANCES, run_self_check, self_check_layout  # noqa: E402
from rag_server.linking.policy_resolver import engine_refusals  # noqa: E402
from rag_server.linking.reuse_gate import PASSED  # noqa: E402
from retrieval.prompt_layout import CompiledPrompt  # noqa: E402
from tests.chunk_requests import first_token_top, picrag_meta  # noqa: E402
from tests.inprocess_frontend import frontend  # noqa: E402
from tests.test_model_matrix import full_reference, naive_reference, prompt  # noqa: E402
from tests.tiny_models import COMMON, FAMILIES, TOKENIZER_FILES  # noqa: E402

SPEED_POLICIES = ("full", "prefix", "naive", "legolink:32", "cacheblend:0.15", "cacherepair",
                  "cacherepair+select:0.15,16")
EXACT_TOKENS = 4
TOP = 5
# Real shapes, written as transformers configs (the tokenizer is the default model's, whose ids
# are all below these vocabularies).
LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192},
                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
                 sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class Plan:
    """One model's checks and the device settings they run with."""

    name: str
    config_class: str
    fields: dict[str, Any]
    exact_layers: int | None  # the exactness model's depth; None: the speed model has real weights
    exact_dtype: str
    speed_dtype: str
    initializer_range: float  # wide enough that the first-token distribution is peaked
    passages: int
    passage_tokens: int
    question_tokens: int
    pool: int
    requests: dict[int, int]  # concurrency -> timed requests
    max_tokens: int
    max_total_tokens: int
    runtime_args: tuple[str, ...] = ()
    start_s: float = 300.0  # the longest a runtime start may take
    cell_s: float = 60.0  # time a policy's cells need, to decide whether to start them


CUDA_ARGS = ("--sampling-backend", "pytorch", "--grammar-backend", "none", "--cuda-graph-max-bs", "16",
             "--mem-fraction-static", "0.85")
CUDA_PLANS = {
    name: Plan(name, config_class, fields, exact_layers=2, exact_dtype="bfloat16", speed_dtype="bfloat16",
               initializer_range=0.05, passages=10, passage_tokens=300, question_tokens=24, pool=8,
               requests={1: 8, 16: 32}, max_tokens=32, max_total_tokens=262144, runtime_args=CUDA_ARGS,
               start_s=420.0, cell_s=45.0)
    for name, config_class, fields in (("llama3.1-8b", "LlamaConfig", LLAMA_31_8B),
                                       ("qwen2.5-7b", "Qwen2Config", QWEN25_7B))
}
# The rehearsal: tests/tiny_models.py's Llama 3, few short passages, small concurrency.
CPU_PLANS = {
    "tiny-llama3": Plan("tiny-llama3", FAMILIES["llama3"].config_class, {**COMMON, **FAMILIES["llama3"].fields},
                        exact_layers=None, exact_dtype="float32", speed_dtype="float32",
                        initializer_range=COMMON["initializer_range"], passages=3, passage_tokens=24,
                        question_tokens=6, pool=2, requests={1: 2, 2: 2}, max_tokens=2, max_total_tokens=4096,
                        start_s=240.0, cell_s=10.0),
}


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


@dataclass
class Report:
    out: Path
    device: str
    started_utc: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    machine: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    exactness: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> check -> result
    speed: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # model -> load cells

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(asdict(self) | {"out": str(self.out)}, indent=2) + "\n")
        (self.out / "gpu_check.md").write_text(self.markdown())

    def markdown(self) -> str:
        lines = [f"# picrag device check, {self.device}, {self.started_utc}", "",
                 "| model | check | passed | max first-token logprob difference | detail |", "|---|---|---|---|---|"]
        for model, checks in self.exactness.items():
            lines += [f"| {model} | {name} | {result['passed']} | {result.get('max_logprob_diff', 'n/a')} | "
                      f"{result.get('detail', '')} |" for name, result in checks.items()]
        from rag_server.bench.load import Cell

        for model, cells in self.speed.items():
            lines += ["", f"## {model}", "", markdown_table([Cell(**cell) for cell in cells], [])]
        lines += ["", "| step | status | seconds | error |", "|---|---|---|---|"]
        lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {s.get('error', '')[:200]} |"
                  for s in self.steps]
        return "\n".join(lines) + "\n"


@contextmanager
def step(report: Report, name: str, deadline: Deadline, needs_s: float) -> Iterator[dict[str, Any]]:
    """Run a step if the deadline leaves it `needs_s`, record how it went, never raise."""
    record: dict[str, Any] = {"name": name, "status": "skipped", "seconds": 0.0}
    report.steps.append(record)
    if deadline.left() < needs_s:
        record["error"] = f"deadline: {deadline.left():.0f} s left, the step needs about {needs_s:.0f} s"
        report.write()
        yield record
        return
    started = time.monotonic()
    record["status"] = "running"  # what a call cut short at its limit leaves in the report
    report.write()
    try:
        yield record
        record["status"] = "ok"
    except Exception as exc:  # a failed step is a finding; the next steps still run
        record["status"] = "failed"
        record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        record["traceback"] = traceback.format_exc()[-4000:]
    record["seconds"] = time.monotonic() - started
    print(f"[gpu_check] {name}: {record['status']} in {record['seconds']:.1f} s {record.get('error', '')[:300]}",
          flush=True)
    report.write()


def write_model(plan: Plan, directory: Path, tokenizer_dir: Path, layers: int | None, weights: bool, dtype: str) -> Path:
    """A model folder of `plan`'s config (cut to `layers`): with seeded weights, or with only
    its token embedding (what a CacheRepair checkpoint reads) where SGLang makes dummy weights."""
    import shutil

    import transformers
    from safetensors.torch import save_file

    fields = {**plan.fields, "initializer_range": plan.initializer_range}
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = getattr(transformers, plan.config_class)(**fields)
    config.dtype = dtype
    directory.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model.save_pretrained(directory)
    else:
        config.save_pretrained(directory)
        embedding = torch.zeros(config.vocab_size, config.hidden_size, dtype=getattr(torch, dtype))
        save_file({"model.embed_tokens.weight": embedding}, directory / "model.safetensors")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, directory)
    return directory


def write_zero_checkpoint(model_dir: Path, directory: Path, kv_dtype: torch.dtype) -> Path:
    """A CacheRepair checkpoint whose zero-initialised head repairs nothing (cacherepair then
    equals naive) but whose network has the shipped checkpoints' size, so it costs what one costs."""
    from picrag_core.model_fingerprint import model_fingerprint
    from picrag_core.repair.checkpoint import save_checkpoint
    from picrag_core.repair.config import RepairConfig, read_token_embedding
    from picrag_core.repair.network import RepairNetwork
    from picrag_core.repair.normalization import KVStats

    config = RepairConfig.for_model(model_dir, width=128, blocks=4)
    shape = (config.num_layers, config.num_kv_heads, 2, config.head_dim)
    save_checkpoint(directory, RepairNetwork(config, read_token_embedding(model_dir)), config,
                    KVStats(torch.ones(shape), torch.ones(shape)), model_fingerprint(model_dir, kv_dtype), {"steps": 0})
    return directory


def runtime(model_dir: Path, device: str, dtype: str, plan: Plan, log: Path, deadline: Deadline, plugins: bool = True,
            checkpoint: Path | None = None, dummy: bool = False) -> SGLangRuntime:
    extra = list(plan.runtime_args) + (["--load-format", "dummy"] if dummy else [])
    if plugins:
        config = RuntimeConfig(model_dir, device=device, dtype=dtype, max_total_tokens=plan.max_total_tokens,
                               repair_checkpoint=checkpoint, extra_args=extra)
    else:
        config = RuntimeConfig(model_dir, device=device, dtype=dtype, attention_backend=STOCK_ATTENTION[device],
                               radix_cache_backend=None, plugins=False, max_total_tokens=plan.max_total_tokens,
                               extra_args=extra)
    started = SGLangRuntime(config, log_file=log)
    try:
        started.start(timeout_s=max(30.0, min(plan.start_s, deadline.left() - 30)))
    except Exception as exc:
        tail = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
        raise RuntimeError(f"{exc}\n--- runtime log tail ---\n{tail}") from exc
    return started


def compared(got: dict[int, float], expected: dict[int, float], tolerance: float, detail: str = "") -> dict[str, Any]:
    """Two first-token top-k distributions: the same top token, log-probabilities within tolerance
    over the tokens both list."""
    shared = set(got) & set(expected)
    diff = max((abs(got[t] - expected[t]) for t in shared), default=float("inf"))
    same_top = max(got, key=got.get) == max(expected, key=expected.get)
    return {"passed": same_top and diff <= tolerance, "max_logprob_diff": round(diff, 6), "same_top_token": same_top,
            "tolerance": tolerance, "detail": detail}


def linked(client: httpx.Client, input_ids: list[int], policy: str, chunks) -> dict:
    response = client.post("/generate", json={
        "input_ids": input_ids, "kv_hints": link_hints(policy, list(chunks)),
        "sampling_params": {"temperature": 0, "max_new_tokens": EXACT_TOKENS},
        "return_logprob": True, "top_logprobs_num": TOP})
    response.raise_for_status()
    return response.json()


def exactness(url: str, runtime_url: str, model_dir: Path, dtype: str, backend: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    tolerance = TOLERANCES[dtype].logprob
    results: dict[str, Any] = {}
    selfcheck = run_self_check(runtime_url, self_check_layout(model_dir),
                               engine_refusals(backend, None, served_model_traits(model_dir, backend)))
    for check in selfcheck.checks:
        results[f"selfcheck {check.name}"] = {"passed": check.status == PASSED, "detail": check.detail[:300]}
    # The reference: transformers in fp32 on the CPU, on the very weights the runtime loaded.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids, chunks = prompt()
    with httpx.Client(base_url=url, timeout=600) as client:
        full = first_token_top(linked(client, input_ids, "full", chunks))
        results["full = transformers"] = compared(full, full_reference(model, input_ids), tolerance)
        naive_out = linked(client, input_ids, "naive", chunks)
        naive = first_token_top(naive_out)
        results["naive = transformers (chunks alone)"] = compared(
            naive, naive_reference(model, input_ids, chunks), tolerance,
            f"reused {picrag_meta(naive_out).reused_tokens} tokens")
        covering = max(end - start for start, end in chunks)
        for policy, reference, name in ((f"legolink:{covering}", full, "full"), ("cacheblend:1.0", full, "full"),
                                        ("select:1.0", full, "full"), ("cacherepair", naive, "naive (zero network)")):
            results[f"{policy} = {name}"] = compared(first_token_top(linked(client, input_ids, policy, chunks)),
                                                     reference, tolerance)
    return results


def synthetic_requests(plan: Plan, seed: int = 0) -> tuple[list[CompiledPrompt], list[CompiledPrompt]]:
    """`bench load`'s request lists on random token ids: `pool` questions of `passages` passages
    of `passage_tokens`, asked equally often with the passages reshuffled (the timed list), and
    each once in its own order (the warm-up)."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731 - ordinary words of the tokenizer
    head = [1, *ids(20)]
    rows = [([ids(plan.passage_tokens) for _ in range(plan.passages)], ids(plan.question_tokens))
            for _ in range(plan.pool)]

    def build(passages: list[list[int]], question: list[int]) -> CompiledPrompt:
        input_ids, chunks = list(head), []
        for passage in passages:
            chunks.append((len(input_ids), len(input_ids) + len(passage)))
            input_ids += passage
        return CompiledPrompt(input_ids + question, chunks)

    warm_up = [build(passages, question) for passages, question in rows]
    timed = []
    for index in range(max(plan.requests.values())):
        passages, question = rows[index % len(rows)]
        timed.append(build(rng.sample(passages, len(passages)), question))
    return timed, warm_up


def speed(url: str, policy: str, plan: Plan, prompts, warm_up, out: Path) -> list[dict[str, Any]]:
    cells = []
    for concurrency, requests in plan.requests.items():
        options = LoadOptions(dataset=Path("synthetic"), policies=policy, concurrency=(concurrency,),
                              requests=requests, out=out, max_tokens=plan.max_tokens)
        cells += [asdict(c) for c in run_cells(url, prompts[:requests], warm_up, policy, options, progress=True)]
    return cells


def check_model(plan: Plan, device: str, tokenizer_dir: Path, work: Path, report: Report, deadline: Deadline) -> None:
    backend = CUDA_ATTENTION_BACKEND if device == "cuda" else CPU_ATTENTION_BACKEND
    report.exactness[plan.name] = {}
    report.speed[plan.name] = []
    same_model = plan.exact_layers is None
    exact_dir = work / f"{plan.name}-exact"
    speed_dir = exact_dir if same_model else work / f"{plan.name}-dummy"

    def serve_and(run: Callable[[str, str], None], model_dir: Path, dtype: str, dummy: bool, name: str) -> None:
        with step(report, f"{plan.name}: start picrag runtime ({name})", deadline, 60) as record:
            if record["status"] == "skipped":
                return
            checkpoint = write_zero_checkpoint(model_dir, work / f"{model_dir.name}-zero-repair", getattr(torch, dtype))
            started = runtime(model_dir, device, dtype, plan, work / f"{model_dir.name}.log", deadline,
                              checkpoint=checkpoint, dummy=dummy)
        if record["status"] != "ok":
            return
        try:
            with frontend(started.url, model_path=model_dir) as url:
                run(url, started.url)
        finally:
            started.stop()

    prompts, warm_up = synthetic_requests(plan)

    def run_speed(url: str) -> None:
        for policy in SPEED_POLICIES:
            with step(report, f"{plan.name}: speed {policy}", deadline, plan.cell_s * len(plan.requests)) as record:
                if record["status"] == "skipped":
                    continue
                report.speed[plan.name] += speed(url, policy, plan, prompts, warm_up, work)

    def run_exact(url: str, runtime_url: str) -> None:
        with step(report, f"{plan.name}: exactness", deadline, 30) as record:
            if record["status"] != "skipped":
                report.exactness[plan.name] = exactness(url, runtime_url, exact_dir, plan.exact_dtype, backend)
        if same_model:
            run_speed(url)

    with step(report, f"{plan.name}: write model folders", deadline, 30) as record:
        if record["status"] != "skipped":
            write_model(plan, exact_dir, tokenizer_dir, plan.exact_layers, weights=True, dtype=plan.exact_dtype)
            if not same_model:
                write_model(plan, speed_dir, tokenizer_dir, None, weights=False, dtype=plan.speed_dtype)
    if record["status"] != "ok":
        return
    serve_and(run_exact, exact_dir, plan.exact_dtype, False, "exactness")
    if not same_model:
        serve_and(lambda url, _runtime_url: run_speed(url), speed_dir, plan.speed_dtype, True, "speed")

    with step(report, f"{plan.name}: start stock SGLang", deadline, 60) as record:
        if record["status"] == "skipped":
            return
        stock = runtime(speed_dir, device, plan.speed_dtype, plan, work / f"{plan.name}-stock.log", deadline,
                        plugins=False, dummy=not same_model)
    if record["status"] != "ok":
        return
    try:
        with step(report, f"{plan.name}: speed stock SGLang", deadline, plan.cell_s * len(plan.requests)) as record:
            if record["status"] != "skipped":
                report.speed[plan.name] += speed(stock.url, VANILLA, plan, prompts, warm_up, work)
    finally:
        stock.stop()


def machine(device: str) -> dict[str, Any]:
    from rag_server.bench.common import machine_description

    described = machine_description() | {"torch": torch.__version__}
    if device == "cuda" and torch.cuda.is_available():
        described["gpu"] = torch.cuda.get_device_name(0)
    for name in ("sglang", "flashinfer", "transformers", "triton"):
        try:
            described[name] = __import__(name).__version__
        except Exception as exc:  # a missing package is what this report is for
            described[name] = f"unavailable: {exc}"[:200]
    return described


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True, help="a folder with the default model's tokenizer")
    parser.add_argument("--deadline-s", type=float, default=450.0, help="no step starts that would end past this")
    parser.add_argument("--models", default=None, help="comma-separated plan names (default: all of the device's)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/picrag-gpu-check-work"))
    args = parser.parse_args(argv)
    deadline = Deadline(args.deadline_s)
    plans = CUDA_PLANS if args.device == "cuda" else CPU_PLANS
    chosen = args.models.split(",") if args.models else list(plans)
    report = Report(args.out, args.device, machine=machine(args.device))
    report.write()
    args.work.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        check_model(plans[name], args.device, args.tokenizer, args.work, report, deadline)
    report.write()
    failed = [s["name"] for s in report.steps if s["status"] == "failed"]
    inexact = [f"{m}: {c}" for m, checks in report.exactness.items() for c, r in checks.items() if not r["passed"]]
    print(f"[gpu_check] {len(report.steps)} steps, failed: {failed or 'none'}; inexact: {inexact or 'none'}; "
          f"{deadline.left():.0f} s of the deadline left", flush=True)
    return 1 if failed or inexact else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
