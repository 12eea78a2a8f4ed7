"""`picrag bench quality`: every policy on the same questions, side by side, in one run.

Per question, `full` runs first (the reference), then every other available policy on the very
same token ids. Right before a chunk policy is measured, the pieces it links (head and passages,
as the frontend compiles them for that policy) are compiled into the chunk store
(`picrag.compile`, common.warm_chunks), so chunk policies link warm chunks; the
measured prompt itself is never sent before, so SGLang's prefix matching cannot answer it from
an exact repeat. `prefix` reuses whatever its own radix tree holds (the head, from the previous
question, and any common passage prefix).

First-token KL to `full`: exact, over the whole vocabulary. Every request asks the engine for its
first answer token's log-probabilities (sglang_patches.steps.first_token_report), and the KL is
computed from the two distributions.

Answer-span KL to `full`: the same KL at each of the first `--answer-span` positions of `full`'s
greedy answer, every policy teacher-forced on it, averaged over the positions: one request per
policy sends the prompt, linked as the policy links it, then `full`'s answer but its last token,
and the engine reports the next token's distribution at each of those positions
(sglang_patches.steps.span_report). A first token that is mostly a style word ("The") is then one
position of sixteen.

Comparisons are paired by question: every policy against `naive` (the reuse it corrects), the
mean difference with its bootstrap 95% interval (rag_server/bench/paired.py).

A run resumes: each finished question is appended to `progress.jsonl` in `--out`, and a run
started again with the same settings measures only the questions not there yet (a larger
`--limit` adds questions to it).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from rag_server.bench.common import (
    BenchError,
    Measured,
    PolicyChoice,
    add_dataset_arguments,
    add_server_arguments,
    command_line,
    fmt,
    load_layout,
    machine_description,
    measure,
    model_path_of,
    span_logprobs,
    parse_policies,
    read_rows,
    render_table,
    reporting_errors,
    server,
    unavailable_entries,
    warm_chunks,
    with_first_sentences,
    with_unrelated_distractors,
)
from rag_server.bench.chat_prompts import ChatPromptLayout
from rag_server.bench.paired import by_question, paired_difference
from rag_server.bench.scoring import score_answer
from rag_server.launch.repair_checkpoint import SHIPPED_DIR, choose_repair_checkpoint
from rag_server.service.auto_policy import CalibrationTable
from rag_server.service.first_token_quality import BUCKET_BOUNDS, bucket_labels, size_bucket
from rag_server.service.percentile import percentile
from retrieval.qa_rows import QARow
from picrag_core.engine_report import exact_kl
from picrag_core.policies import parse_policy
from picrag_core.repair.checkpoint import RepairCheckpointError, checkpoint_identity

REFERENCE = "full"
NAIVE = "naive"  # the KL every other policy's is measured against: reuse with no correction
DEFAULT_ANSWER_SPAN = 16
PROGRESS_FILE = "progress.jsonl"
# Per-question values compared pairwise against naive: (field, report name, scale); F1 and
# agreement in percentage points, as the summary gives them.
PAIRED = (("first_token_kl", "first_token_kl", 1.0), ("answer_span_kl", "answer_span_kl", 1.0), ("f1", "f1", 100.0),
          ("agrees_with_full", "agreement_with_full", 100.0))


@dataclass(frozen=True)
class QualityOptions:
    dataset: Path
    policies: str
    out: Path
    limit: int | None = 10
    max_passages: int | None = None
    max_tokens: int = 32
    url: str | None = None
    model: str | None = None
    port: int = 8031
    command: str = ""
    write_calibration: Path | None = None  # also write `auto`'s calibration table here
    unrelated_distractors: bool = False  # replace non-supporting passages by other questions'
    passage_sentences: int | None = None  # every passage cut to its first N sentences
    passage_bos: bool = False  # every passage starts with BOS (EPIC's layout), in every policy's prompt
    repair_checkpoint: Path | None = None  # the server started here serves this one, not the shipped one
    prompt_form: str = "annotated"  # "chat": documents inside the user message, passages found (chat_prompts.py)
    answer_span: int = DEFAULT_ANSWER_SPAN  # positions of full's answer the answer-span KL averages (1: the first)


@dataclass
class QuestionResult:
    id: str
    policy: str
    answer: str
    em: float
    f1: float
    agrees_with_full: bool
    first_token_kl: float | None
    ttft_s: float
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    chunk_hits: int
    chunk_misses: int
    # Mean exact KL to full over the first answer_span_tokens positions of full's answer (None:
    # runs before it was measured).
    answer_span_kl: float | None = None
    answer_span_tokens: int = 0


def _question_result(row: QARow, policy: str, measured: Measured, reference: Measured,
                     span: tuple[Any, Any]) -> QuestionResult:
    """`span`: full's and the policy's next-token log-probabilities at each position of full's
    answer, the policy teacher-forced on it ([positions, vocabulary] each)."""
    score = score_answer(measured.text, row.answers)
    kl = 0.0 if policy == REFERENCE else exact_kl(reference.first_logprobs, measured.first_logprobs)
    full_rows, own_rows = span
    span_kls = [0.0 if policy == REFERENCE else exact_kl(full, own) for full, own in zip(full_rows, own_rows)]
    return QuestionResult(
        id=row.id, policy=policy, answer=measured.text, em=score.em, f1=score.f1,
        agrees_with_full=measured.text.strip() == reference.text.strip(), first_token_kl=kl,
        ttft_s=round(measured.ttft_s, 4), prompt_tokens=measured.report.prompt_tokens,
        reused_tokens=measured.report.reused_tokens, computed_tokens=measured.report.computed_tokens,
        chunk_hits=measured.report.chunk_hits, chunk_misses=measured.report.chunk_misses,
        answer_span_kl=statistics.fmean(span_kls), answer_span_tokens=len(span_kls),
    )


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarise(results: list[QuestionResult], policies: list[str]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for policy in policies:
        rows = [r for r in results if r.policy == policy]
        if not rows:
            continue
        kls = [r.first_token_kl for r in rows if r.first_token_kl is not None]
        span_kls = [r.answer_span_kl for r in rows if r.answer_span_kl is not None]
        hits, misses = sum(r.chunk_hits for r in rows), sum(r.chunk_misses for r in rows)
        ttfts = [r.ttft_s for r in rows]
        summary[policy] = {
            "questions": len(rows),
            "f1": 100 * statistics.fmean(r.f1 for r in rows),
            "em": 100 * statistics.fmean(r.em for r in rows),
            "agreement_with_full": 100 * statistics.fmean(float(r.agrees_with_full) for r in rows),
            "first_token_kl_mean": _mean(kls),
            "first_token_kl_questions": len(kls),
            "answer_span_kl_mean": _mean(span_kls),
            "answer_span_tokens_mean": _mean([r.answer_span_tokens for r in rows if r.answer_span_kl is not None]),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p90_s": percentile(ttfts, 90),
            "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in rows),
            "computed_tokens_mean": statistics.fmean(r.computed_tokens for r in rows),
            "reused_tokens_mean": statistics.fmean(r.reused_tokens for r in rows),
            # Chunks found in the store at link time / chunks linked; None where the policy
            # does not use the chunk store (full, prefix).
            "chunk_hit_rate": hits / (hits + misses) if hits + misses else None,
        }
    reference = summary.get(REFERENCE, {}).get("ttft_p50_s")
    naive_kl = summary.get(NAIVE, {}).get("first_token_kl_mean")
    for values in summary.values():
        values["ttft_speedup_vs_full"] = reference / values["ttft_p50_s"] if reference and values["ttft_p50_s"] else None
        # How much of reuse's KL the policy removes: 0% is naive's KL, 100% is full prefill's.
        kl = values["first_token_kl_mean"]
        values["naive_kl_closed"] = 100 * (1 - kl / naive_kl) if naive_kl and kl is not None else None
    naive_rows = [r for r in results if r.policy == NAIVE]
    for policy, values in summary.items():
        if policy in (NAIVE, REFERENCE) or not naive_rows:
            continue
        rows = [r for r in results if r.policy == policy]
        paired = {name: paired_difference(by_question(rows, field, scale), by_question(naive_rows, field, scale))
                  for field, name, scale in PAIRED}
        values["paired_vs_naive"] = {name: d.as_json() for name, d in paired.items() if d is not None}
    return summary


TABLE_COLUMNS = ("policy", "F1", "EM", "agree w/ full %", "1st-token KL", "answer-span KL", "naive's KL closed",
                 "TTFT p50 (s)",
                 "TTFT p90 (s)", "speed-up", "computed tok", "reused tok", "chunk hit rate")


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}%"


def markdown_table(summary: dict[str, dict[str, Any]], unavailable: list[dict[str, str]]) -> str:
    rows = [(policy, fmt(s["f1"], 1), fmt(s["em"], 1), fmt(s["agreement_with_full"], 0),
             fmt(s["first_token_kl_mean"], 3), fmt(s.get("answer_span_kl_mean"), 3), _percent(s["naive_kl_closed"]),
             fmt(s["ttft_p50_s"]), fmt(s["ttft_p90_s"]),
             f"{fmt(s['ttft_speedup_vs_full'], 1)}x", fmt(s["computed_tokens_mean"], 0),
             fmt(s["reused_tokens_mean"], 0), fmt(s["chunk_hit_rate"])) for policy, s in summary.items()]
    table = render_table(TABLE_COLUMNS, rows, unavailable)
    paired = [(policy, s["paired_vs_naive"]) for policy, s in summary.items() if s.get("paired_vs_naive")]
    if not paired:
        return table
    lines = ["", "Paired against naive, per question (policy minus naive; bootstrap 95% interval):", "",
             "| policy | questions | 1st-token KL | answer-span KL | F1 | agreement |", "|---|---|---|---|---|---|"]
    for policy, differences in paired:
        cells = [_difference(differences.get(name), digits)
                 for name, digits in (("first_token_kl", 3), ("answer_span_kl", 3), ("f1", 1),
                                      ("agreement_with_full", 0))]
        questions = max((d["questions"] for d in differences.values()), default=0)
        lines.append(f"| {policy} | {questions} | " + " | ".join(cells) + " |")
    return table + "\n".join(lines) + "\n"


def _difference(value: dict[str, Any] | None, digits: int) -> str:
    if value is None:
        return "n/a"
    low, high = value["ci95"]
    return f"{value['mean']:+.{digits}f} ({low:+.{digits}f}..{high:+.{digits}f})"


@dataclass(frozen=True)
class StoredRun:
    """A finished `bench quality` run, read back from its results.json."""
    path: Path
    model: str  # the model folder's name
    kl_method: str  # how the first-token KL was measured (the report's method field)
    results: list[QuestionResult]
    summary: dict[str, dict[str, Any]]
    passage_bos: bool = False  # the BOS-per-passage ablation, not the layout the frontend serves
    repair_checkpoint: dict[str, Any] | None = None  # _repair_record; runs before it have none
    prompts: str = ""  # which prompts its questions were (prompts_of)

    @property
    def label(self) -> str:
        questions = len({r.id for r in self.results})
        return f"{self.path.parent.name}: {questions} questions"


def prompts_of(report: dict[str, Any]) -> str:
    """Which prompts a run's questions were: the dataset file, then what the run changed in them."""
    settings = report.get("settings", {})
    changes = [] if settings.get("distractors") in ("dataset", None) else [f"{settings['distractors']} distractors"]
    if (sentences := settings.get("passage_sentences")) is not None:
        changes.append(f"passages cut to their first {sentences} sentence{'' if sentences == 1 else 's'}")
    return ", ".join([Path(report.get("dataset", "")).name, *changes])


def read_run(path: Path) -> StoredRun:
    """A run from its results.json or the folder holding it."""
    path = path / "results.json" if path.is_dir() else path
    try:
        report = json.loads(path.read_text())
        results = [QuestionResult(**row) for row in report["per_question"]]
        return StoredRun(path=path, model=Path(report["model"]).name,
                         kl_method=report["method"]["first_token_kl"], results=results,
                         summary=report["policies"], passage_bos=report.get("settings", {}).get("passage_bos", False),
                         repair_checkpoint=report.get("repair_checkpoint"),
                         prompts=prompts_of(report))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{path} is not a `picrag bench quality` results file: {exc}") from exc


def speed_order(speedups: list[dict[str, float]]) -> list[str]:
    """Policies fastest first from per-run speed-ups over full. Runs on longer prompts show larger
    speed-ups for every policy, so a policy measured only on them must not look faster than it
    is: log speed-up is fitted as a policy term plus a run term (least squares, by alternating
    means) and the policies are ordered by their terms. With one run this is its speed-up order."""
    logs = [{policy: math.log(value) for policy, value in run.items() if value > 0} for run in speedups]
    policies = sorted({policy for run in logs for policy in run})
    policy_term = dict.fromkeys(policies, 0.0)
    run_term = [0.0] * len(logs)
    for _ in range(50):
        run_term = [statistics.fmean(v - policy_term[p] for p, v in run.items()) if run else 0.0 for run in logs]
        policy_term = {p: statistics.fmean(run[p] - run_term[i] for i, run in enumerate(logs) if p in run)
                       for p in policies}
    return sorted(policies, key=lambda p: -policy_term[p])


# A (policy, bucket) mean over fewer questions is left out of a table, and `auto` reads the nearest
# bucket measured on enough instead: a HotpotQA run puts one or two of its 40 prompts in the
# ">=2048" bucket, whose mean would then stand for every long prompt.
MIN_CELL_QUESTIONS = 5


def calibration_table(runs: list[tuple[list[QuestionResult], dict[str, dict[str, Any]]]], model: str,
                      source: str, min_questions: int = MIN_CELL_QUESTIONS) -> CalibrationTable:
    """`auto`'s table from one run or several (each run's per-question results and summary): mean
    first-token KL per chunk-reusing policy and prompt-size bucket, pooled over every question of
    every run (buckets with at least `min_questions`), the policies ordered by TTFT speed-up over
    full (fastest, i.e. cheapest, first; `speed_order`). Repairing policies are taken to have run
    with the checkpoint shipped for the model (what a bench that starts its own server serves;
    check_shipped_repair refuses runs that record another)."""
    # Keyed by canonical name, so `legolink` in one run and `legolink:16` in another pool.
    kls: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    speedups: list[dict[str, float]] = []
    for results, summary in runs:
        for r in results:
            if r.first_token_kl is not None and parse_policy(r.policy).family.reuses_chunks:
                kls[parse_policy(r.policy).name][size_bucket(r.prompt_tokens)].append(r.first_token_kl)
        speedups.append({parse_policy(policy).name: values["ttft_speedup_vs_full"]
                         for policy, values in summary.items() if values["ttft_speedup_vs_full"] is not None})
    cells = {p: {bucket: round(statistics.fmean(kls[p][bucket]), 4) for bucket in bucket_labels(BUCKET_BOUNDS)
                 if len(kls[p].get(bucket, ())) >= min_questions} for p in kls}
    measured = [p for p in speed_order(speedups) if cells.get(p)]
    repairs = any(parse_policy(p).family.repairs for p in measured)
    return CalibrationTable(
        model=model, cost_order=tuple(measured),
        kl={p: cells[p] for p in measured},
        bounds=BUCKET_BOUNDS, repair_checkpoint=model if repairs and (SHIPPED_DIR / model).is_dir() else None,
        source=source,
    )


def check_shipped_repair(model: str, records: list[tuple[str, dict[str, Any] | None]]) -> None:
    """`auto`'s table describes what `picrag serve` serves, the shipped checkpoint: refuse runs
    whose repairing policies ran with another one (`records`: (run, its repair record))."""
    try:
        digest = checkpoint_identity(SHIPPED_DIR / model)["weights_sha256"]
    except RepairCheckpointError:  # none shipped: every recorded checkpoint is another one
        digest = None
    foreign = [f"{run} ({record['path']})" for run, record in records
               if record and record.get("weights_sha256") and record["weights_sha256"] != digest]
    if foreign:
        raise BenchError(f"{', '.join(foreign)}: repaired with a checkpoint other than the one shipped for {model}; "
                         "a calibration table must describe the checkpoint `picrag serve` uses")


def check_comparable(runs: list[StoredRun], purpose: str) -> None:
    """Refuse runs that cannot share one table or plot: of different models (`purpose` says why
    that matters), or with the first-token KL measured differently."""
    models = {run.model for run in runs}
    if len(models) > 1:
        raise BenchError(f"the runs are of different models ({', '.join(sorted(models))}); {purpose}")
    if len({run.kl_method for run in runs}) > 1:
        raise BenchError("the runs measured the first-token KL differently and cannot be pooled: "
                         + "; ".join(f"{run.path}: {run.kl_method}" for run in runs))


def calibration_from_runs(runs: list[StoredRun], min_questions: int = MIN_CELL_QUESTIONS) -> CalibrationTable:
    """One table from stored runs of one model whose KLs were measured the same way."""
    if not runs:
        raise BenchError("no runs given")
    check_comparable(runs, "one table is one model's")
    models = {run.model for run in runs}
    ablations = [str(run.path) for run in runs if run.passage_bos]
    if ablations:
        raise BenchError(f"{', '.join(ablations)}: a --passage-bos run is not the layout the frontend serves")
    check_shipped_repair(next(iter(models)), [(str(run.path), run.repair_checkpoint) for run in runs])
    source = ("picrag bench calibrate over " + "; ".join(run.label for run in runs)
              + f". First-token KL: {runs[0].kl_method}.")
    # A question that two runs measured with the same policy counts once, or adding a run with
    # new policies on old questions would weigh those questions twice in the old policies' means.
    seen: set[tuple[str, str, str]] = set()
    pooled = []
    for run in runs:
        kept = []
        for r in run.results:
            key = (run.prompts, r.id, parse_policy(r.policy).name)
            if key not in seen:
                seen.add(key)
                kept.append(r)
        pooled.append((kept, run.summary))
    return calibration_table(pooled, models.pop(), source, min_questions)


def pareto_plot(summary: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    # F1 is the papers' measure; first-token KL to full is the meaningful one for a weak reader.
    panels = ((axes[0], "f1", "F1 (%)"), (axes[1], "first_token_kl_mean", "first-token KL to full (lower is better)"))
    for axis, key, label in panels:
        points = [(p, s) for p, s in summary.items() if s["ttft_speedup_vs_full"] is not None and s[key] is not None]
        for index, (policy, s) in enumerate(points):
            axis.scatter(s["ttft_speedup_vs_full"], s[key])
            # Alternate label offsets: full and prefix often sit on the same spot.
            axis.annotate(policy, (s["ttft_speedup_vs_full"], s[key]), textcoords="offset points",
                          xytext=(5, 4 if index % 2 == 0 else -11))
        axis.set_xlabel("TTFT speed-up over full (p50)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_quality(options: QualityOptions, progress: bool = True) -> dict[str, Any]:
    if options.repair_checkpoint is not None and options.url is not None:
        raise BenchError("--repair-checkpoint is for the server the bench starts; the one at --url serves its own")
    choices = parse_policies(options.policies)
    if not any(c.name == REFERENCE for c in choices):
        # Agreement, KL and speed-up are measured against full: it always runs.
        choices.insert(0, PolicyChoice(REFERENCE))
    runnable = [REFERENCE] + [c.name for c in choices if c.available and c.name != REFERENCE]
    unavailable = unavailable_entries(choices)
    rows = read_rows(options.dataset, options.limit, options.max_passages)
    if options.unrelated_distractors:
        rows = with_unrelated_distractors(rows)
    if options.passage_sentences is not None:
        rows = with_first_sentences(rows, options.passage_sentences)
    options.out.mkdir(parents=True, exist_ok=True)

    serve_args = [] if options.repair_checkpoint is None else ["--repair-checkpoint", str(options.repair_checkpoint)]
    with server(options.url, options.model, options.port, options.out / "server.log", serve_args) as url:
        model_dir = model_path_of(url, options.model)
        layout = load_layout(model_dir, options.passage_bos)
        prompts = ChatPromptLayout(layout.tokenizer) if options.prompt_form == "chat" else layout
        run = RunProgress.open(options.out / PROGRESS_FILE, _run_settings(options, runnable, model_dir))
        results, failed = run.results, run.failed
        todo = [row for row in rows if row.id not in run.done]
        if run.done:
            print(f"picrag bench quality: resuming {options.out}: {len(rows) - len(todo)} of {len(rows)} questions "
                  f"measured before", file=sys.stderr)
        with httpx.Client(base_url=url, timeout=1800) as client:
            for row in tqdm(todo, desc="picrag bench quality", unit="q", disable=not progress, file=sys.stderr):
                prompt = prompts.build(row.question, row.passages)
                reference = measure(client, prompt, REFERENCE, options.max_tokens, first_token_distribution=True)
                answer_ids = reference.output_ids[:options.answer_span]
                full_span = span_logprobs(client, prompt, REFERENCE, answer_ids)
                measured_rows = [_question_result(row, REFERENCE, reference, reference, (full_span, full_span))]
                for policy in [p for p in runnable[1:] if p not in failed]:
                    try:
                        warm_chunks(client, layout, prompt, policy)
                        measured = measure(client, prompt, policy, options.max_tokens,
                                           first_token_distribution=True)
                        # After the measured request, so its TTFT never profits from these.
                        span = (full_span, span_logprobs(client, prompt, policy, answer_ids))
                    except BenchError as exc:
                        # One broken policy must not cost the others' run: report it instead.
                        run.fail(policy, f"failed on question {row.id}: {exc}")
                        continue
                    measured_rows.append(_question_result(row, policy, measured, reference, span))
                run.finish(row.id, measured_rows)
        # The report is of this run's questions: a resumed run asked for fewer holds more.
        rows = [row for row in rows if row.id in run.done]
        ids = {row.id for row in rows}
        results = [r for r in results if r.id in ids]

    # A policy that failed midway is reported as such; its partial rows would not compare.
    results = [r for r in results if r.policy not in failed]
    unavailable += [{"policy": name, "reason": reason} for name, reason in failed.items()]
    summary = summarise(results, [p for p in runnable if p not in failed])
    report = {
        "command": options.command,
        "dataset": str(options.dataset),
        "questions": len(rows),
        "passages_per_question": statistics.fmean(len(r.passages) for r in rows),
        "model": str(model_dir),
        "machine": machine_description(),
        "settings": {"max_tokens": options.max_tokens, "greedy": True, "max_passages": options.max_passages,
                     "distractors": "unrelated" if options.unrelated_distractors else "dataset",
                     "passage_bos": options.passage_bos, "prompt_form": options.prompt_form,
                     "answer_span": options.answer_span, "passage_sentences": options.passage_sentences},
        "method": {
            "ttft": "client wall time to the first streamed token through the frontend's /generate "
                    "(chunk compile round trips included)",
            "warm": "the head and passages a chunk policy links compiled (picrag.compile) right before "
                    "that policy is measured on the question",
            "first_token_kl": "KL(full || policy) of the first answer token, exact over the whole vocabulary",
            "answer_span_kl": f"KL(full || policy), exact, at each of the first {options.answer_span} positions of "
                              "full's greedy answer, every policy teacher-forced on it, averaged over the positions",
            "paired": "policy minus naive per question, mean and bootstrap 95% interval (2000 resamples, seed 0)",
            "agreement": "greedy answer text identical to full's (whitespace-stripped)",
            "scores": "SQuAD EM/F1 of the first answer line, max over gold aliases, in percent",
        },
        "repair_checkpoint": _repair_record(options, model_dir, runnable),
        "policies": summary,
        "unavailable": unavailable,
        "per_question": [asdict(r) for r in results],
    }
    (options.out / "results.json").write_text(json.dumps(report, indent=2))
    if options.write_calibration is not None:
        table = calibration_table([(results, summary)], model_dir.name,
                                  f"{options.command} ({len(rows)} questions of {options.dataset.name})")
        options.write_calibration.parent.mkdir(parents=True, exist_ok=True)
        options.write_calibration.write_text(json.dumps(table.as_json(), indent=2) + "\n")
    (options.out / "results.md").write_text(markdown_table(summary, unavailable))
    pareto_plot(summary, options.out / "pareto.png",
                f"{model_dir.name}, {options.dataset.name}, {len(rows)} questions")
    return report


def _run_settings(options: QualityOptions, policies: list[str], model_dir: Path) -> dict[str, Any]:
    """What the questions of one run share: a run resumes only where these are the same."""
    return {"dataset": str(options.dataset), "policies": policies, "model": str(model_dir),
            "max_passages": options.max_passages, "max_tokens": options.max_tokens,
            "unrelated_distractors": options.unrelated_distractors, "passage_bos": options.passage_bos,
            "prompt_form": options.prompt_form, "answer_span": options.answer_span,
            "passage_sentences": options.passage_sentences,
            "repair_checkpoint": None if options.repair_checkpoint is None else str(options.repair_checkpoint)}


@dataclass
class RunProgress:
    """The questions a run has measured, appended to `path` as each finishes (module docstring)."""

    path: Path
    results: list[QuestionResult]
    failed: dict[str, str]  # policy -> why it stopped being measured
    done: set[str]

    @classmethod
    def open(cls, path: Path, settings: dict[str, Any]) -> RunProgress:
        run = cls(path, [], {}, set())
        if not path.is_file():
            path.write_text(json.dumps({"settings": settings}) + "\n")
            return run
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not lines or lines[0].get("settings") != settings:
            raise BenchError(f"{path} holds a run with other settings ({lines[0].get('settings') if lines else 'none'}): "
                             "choose another --out, or remove it to start again")
        for line in lines[1:]:
            if "failed" in line:
                run.failed[line["failed"]] = line["reason"]
            else:
                run.done.add(line["id"])
                run.results.extend(QuestionResult(**r) for r in line["results"])
        # A policy that failed midway is measured on no further question, and reported as failed.
        run.results = [r for r in run.results if r.policy not in run.failed]
        return run

    def _append(self, line: dict[str, Any]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(line) + "\n")

    def fail(self, policy: str, reason: str) -> None:
        self.failed[policy] = reason
        self._append({"failed": policy, "reason": reason})

    def finish(self, question: str, rows: list[QuestionResult]) -> None:
        self.done.add(question)
        self.results.extend(rows)
        self._append({"id": question, "results": [asdict(r) for r in rows]})


def _repair_record(options: QualityOptions, model_dir: Path, policies: list[str]) -> dict[str, Any] | None:
    """Which CacheRepair checkpoint the repairing policies ran with (None: none of them ran). Two
    trainings into one folder differ only in their weights, so the record carries their digest."""
    if not any(parse_policy(p).family.repairs for p in policies):
        return None
    if options.url is not None:
        return {"path": None, "why": f"not known: the server at {options.url} chose its own"}
    checkpoint, why = choose_repair_checkpoint(model_dir, options.repair_checkpoint)
    return {"path": None, "why": why} if checkpoint is None else checkpoint_identity(checkpoint)


def register(commands) -> None:
    """Add `bench quality` to the `bench` command group's subparsers."""
    quality = commands.add_parser(
        "quality", help="F1/EM, agreement, first-token and answer-span KL vs full, TTFT, reuse: every policy, one run",
        description="Run every policy on the same questions (warm chunk cache) and write "
        "results.json, results.md and pareto.png to --out.",
    )
    add_dataset_arguments(quality)
    quality.add_argument("--policies", default="full,prefix,naive",
                         help="comma-separated; unknown ones, and ones the server refuses, are reported as unavailable")
    quality.add_argument("--limit", type=int, default=10, help="first N questions (default 10)")
    quality.add_argument("--max-tokens", type=int, default=32, help="new tokens per answer (default 32)")
    quality.add_argument("--distractors", choices=("dataset", "unrelated"), default="dataset",
                         help="'unrelated': replace every passage the dataset does not mark supporting by a "
                         "passage of another question (seeded), to see what on-topic distractors cost a "
                         "policy (default: the dataset's own)")
    quality.add_argument("--passage-sentences", type=int, default=None, metavar="N",
                         help="every passage cut to its first N sentences: the short passages of chat snippets "
                         "(default: whole passages)")
    quality.add_argument("--passage-bos", action="store_true",
                         help="an ablation: every passage starts with the tokenizer's BOS token (EPIC's "
                         "released layout), in full prefill and compiled chunk alike")
    quality.add_argument("--prompt-form", choices=("annotated", "chat"), default="annotated",
                         help="'chat': each question as a chat app sends it, the documents as paragraphs of the "
                         "user message and the passages the ones the frontend finds there (default: picrag's "
                         "annotated layout)")
    quality.add_argument("--answer-span", type=int, default=DEFAULT_ANSWER_SPAN, metavar="N",
                         help="positions of full's greedy answer the answer-span KL averages, every policy "
                         f"teacher-forced on it in one request per policy and question (default "
                         f"{DEFAULT_ANSWER_SPAN}; 1: the first token only)")
    quality.add_argument("--write-calibration", type=Path, default=None, metavar="FILE",
                         help="also write the `auto` policy's calibration table (mean KL per policy and "
                         "prompt size, policies by speed-up) for `picrag serve --calibration FILE`")
    quality.add_argument("--repair-checkpoint", type=Path, default=None, metavar="DIR",
                         help="a CacheRepair checkpoint for the server started here to serve instead of the "
                         "shipped one (results.json records which one ran, with its weights' digest)")
    add_server_arguments(quality, default_port=8031)
    quality.set_defaults(func=_main)


@reporting_errors("quality")
def _main(args) -> int:
    if args.prompt_form != "annotated" and args.write_calibration is not None:
        raise BenchError("--write-calibration with --prompt-form chat: `auto`'s table is calibrated on the annotated layout")
    if args.passage_sentences is not None and args.passage_sentences < 1:
        raise BenchError("--passage-sentences keeps the first N sentences of each passage: 1 or more")
    if args.passage_sentences is not None and args.write_calibration is not None:
        raise BenchError("--write-calibration with --passage-sentences: `auto`'s table describes whole passages")
    if args.passage_bos and args.write_calibration is not None:
        raise BenchError("--write-calibration with --passage-bos: the ablation is not the layout the frontend serves")
    if args.repair_checkpoint is not None and args.write_calibration is not None:
        raise BenchError("--write-calibration with --repair-checkpoint: `auto`'s table describes the shipped "
                         "checkpoint, the one `picrag serve` uses")
    options = QualityOptions(
        dataset=args.dataset, policies=args.policies, out=args.out, limit=args.limit,
        max_passages=args.max_passages, max_tokens=args.max_tokens,
        url=args.url, model=args.model, port=args.port, command=command_line(),
        write_calibration=args.write_calibration, unrelated_distractors=args.distractors == "unrelated",
        passage_bos=args.passage_bos, repair_checkpoint=args.repair_checkpoint, prompt_form=args.prompt_form,
        answer_span=args.answer_span, passage_sentences=args.passage_sentences,
    )
    if options.answer_span < 1:
        raise BenchError("--answer-span counts positions of full's answer: 1 or more")
    report = run_quality(options)
    print((options.out / "results.md").read_text())
    print(f"-> {options.out}/results.json, results.md, pareto.png")
    return 0 if report["policies"] else 1
