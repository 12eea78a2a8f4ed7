"""`picrag bench pool`: quality runs of several dev sets read as one, per set and pooled.

Each `picrag bench quality` run measures one dataset. Choosing a default needs more questions
than one set holds (a 0.03 difference of per-question KL needs about 300 on Qwen), so this reads
the runs' `results.json`, keeps the questions every policy of a set answered, and reports per
set and over all sets pooled, every figure with its bootstrap 95% interval (paired.py):

* answer-span and first-token KL to `full`, agreement with `full`, F1 and EM (means);
* F1 as a share of `full`'s on the same questions, and the TTFT speed-up over `full` (full's mean
  TTFT over the policy's), both ratios of paired means;
* every policy against a baseline (`--baseline`, naive by default), question by question: the
  mean difference of answer-span KL, first-token KL, F1 and agreement.

Question ids are prefixed with their set, so two sets never pair each other's questions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_server.bench.common import BenchError, command_line, write_report
from rag_server.bench.paired import Estimate, by_question, mean_of, paired_difference, ratio_of_means
from rag_server.bench.quality import PAIRED, REFERENCE, QuestionResult

POOLED = "pooled"
# Per-question means reported with their interval: (field, report name, scale).
MEANS = (("answer_span_kl", "answer_span_kl", 1.0), ("first_token_kl", "first_token_kl", 1.0),
         ("agrees_with_full", "agreement_with_full", 100.0), ("f1", "f1", 100.0), ("em", "em", 100.0))


@dataclass(frozen=True)
class PooledRun:
    name: str  # the set (the dataset file's stem)
    results: list[QuestionResult]
    command: str


def read_run(folder: Path) -> PooledRun:
    path = folder / "results.json"
    if not path.is_file():
        raise BenchError(f"{folder} holds no results.json (a `picrag bench quality` run's --out)")
    report = json.loads(path.read_text())
    name = Path(report["dataset"]).name.split(".")[0]
    results = [QuestionResult(**{**row, "id": f"{name}/{row['id']}"}) for row in report["per_question"]]
    return PooledRun(name, results, report.get("command", ""))


def _complete(results: list[QuestionResult], policies: list[str]) -> list[QuestionResult]:
    """The rows of questions that every policy answered: figures of different question sets
    would not compare."""
    answered = [{r.id for r in results if r.policy == policy} for policy in policies]
    shared = set.intersection(*answered) if answered else set()
    return [r for r in results if r.id in shared]


def _json(estimate: Estimate | Any) -> Any:
    return None if estimate is None else estimate.as_json()


def pooled_figures(results: list[QuestionResult], policies: list[str], baseline: str) -> dict[str, dict[str, Any]]:
    """Per policy: its means, ratios to full and paired differences to `baseline`, with intervals."""
    rows = {policy: [r for r in results if r.policy == policy] for policy in policies}
    reference = rows.get(REFERENCE, [])
    figures: dict[str, dict[str, Any]] = {}
    for policy in policies:
        own = rows[policy]
        entry: dict[str, Any] = {"questions": len(own)}
        for field, name, scale in MEANS:
            entry[name] = _json(mean_of(by_question(own, field, scale)))
        entry["f1_share_of_full"] = _json(ratio_of_means(by_question(own, "f1"), by_question(reference, "f1")))
        entry["ttft_speedup_vs_full"] = _json(ratio_of_means(by_question(reference, "ttft_s"),
                                                             by_question(own, "ttft_s")))
        if policy not in (baseline, REFERENCE) and rows.get(baseline):
            entry[f"paired_vs_{baseline}"] = {
                name: _json(paired_difference(by_question(own, field, scale), by_question(rows[baseline], field, scale)))
                for field, name, scale in PAIRED}
        figures[policy] = entry
    return figures


def pool(folders: list[Path], baseline: str) -> dict[str, Any]:
    runs = [read_run(folder) for folder in folders]
    names = [run.name for run in runs]
    if len(set(names)) != len(names):
        raise BenchError(f"two runs of one set: {names}")
    policy_sets = [list(dict.fromkeys(r.policy for r in run.results)) for run in runs]
    policies = [p for p in policy_sets[0] if all(p in other for other in policy_sets[1:])]
    if REFERENCE not in policies or baseline not in policies:
        raise BenchError(f"every run needs {REFERENCE} and the baseline {baseline}; common policies: {policies}")
    sets = {run.name: _complete([r for r in run.results if r.policy in policies], policies) for run in runs}
    everything = [r for rows in sets.values() for r in rows]
    return {
        "command": command_line(),
        "runs": {run.name: {"folder": str(folder), "command": run.command} for run, folder in zip(runs, folders)},
        "baseline": baseline,
        "policies": policies,
        "method": "means and ratios of means over questions with a bootstrap 95% interval (2000 resamples, "
                  "seed 0); paired differences are policy minus baseline per question; a set keeps the "
                  "questions every policy answered",
        "sets": {name: pooled_figures(rows, policies, baseline) for name, rows in sets.items()},
        POOLED: pooled_figures(everything, policies, baseline),
    }


def _cell(value: dict[str, Any] | None, digits: int, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    number = value.get("value", value.get("mean"))
    low, high = value["ci95"]
    sign = "+" if signed else ""
    return f"{number:{sign}.{digits}f} ({low:{sign}.{digits}f}..{high:{sign}.{digits}f})"


def markdown(report: dict[str, Any]) -> str:
    baseline = report["baseline"]
    lines = []
    for name, figures in [(POOLED, report[POOLED]), *report["sets"].items()]:
        questions = figures[REFERENCE]["questions"]
        lines += [f"### {name} ({questions} questions)", "",
                  "| policy | answer-span KL | 1st-token KL | agree w/ full % | F1 | F1 / full's | TTFT speed-up "
                  f"| answer-span KL - {baseline}'s | F1 - {baseline}'s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for policy, entry in figures.items():
            paired = entry.get(f"paired_vs_{baseline}", {})
            lines.append("| " + " | ".join([
                policy, _cell(entry["answer_span_kl"], 3), _cell(entry["first_token_kl"], 3),
                _cell(entry["agreement_with_full"], 0), _cell(entry["f1"], 1), _cell(entry["f1_share_of_full"], 2),
                _cell(entry["ttft_speedup_vs_full"], 1), _cell(paired.get("answer_span_kl"), 3, signed=True),
                _cell(paired.get("f1"), 1, signed=True)]) + " |")
        lines.append("")
    return "\n".join(lines)


def register(commands) -> None:
    parser = commands.add_parser(
        "pool", help="read `bench quality` runs of several dev sets as one: per set and pooled, with intervals",
        description="Per set and pooled over the runs: answer-span and first-token KL, agreement, F1 and its "
                    "share of full's, TTFT speed-up, and paired differences to a baseline policy, each with a "
                    "bootstrap 95% interval. Writes pooled.json and pooled.md to --out.")
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN", help="a `picrag bench quality --out` folder")
    parser.add_argument("--baseline", default="naive", help="the policy every other is paired against (default naive)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.set_defaults(func=_main)


def _main(args) -> int:
    report = pool(args.runs, args.baseline)
    return write_report(args.out, "pooled", report, markdown(report))
