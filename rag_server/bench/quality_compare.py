"""`picrag bench compare`: two sides of `picrag bench quality` runs on the same questions, paired
question by question. A side is one run per dev set; the two differ in one thing: the CacheRepair
checkpoint (`--repair-checkpoint`), the prompt form (`--prompt-form chat` against the annotated
layout), or the code before and after a change.

For each policy both sides ran, per set and over all sets pooled (question ids prefixed with
their set, as `picrag bench pool` does): each side's mean answer-span KL, first-token KL, F1 and
agreement with `full`, and the mean of B minus A per question with its bootstrap 95% interval
(paired.py). A question counts where both sides answered it under that policy, so two sides that
stopped at different questions still compare on the ones they share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rag_server.bench.common import BenchError, command_line, write_report
from rag_server.bench.paired import by_question, mean_of, paired_difference
from rag_server.bench.quality import PAIRED, QuestionResult
from rag_server.bench.quality_pool import POOLED, read_run


def _side(folders: list[Path], label: str) -> dict[str, list[QuestionResult]]:
    runs = [read_run(folder) for folder in folders]
    names = [run.name for run in runs]
    if len(set(names)) != len(names):
        raise BenchError(f"side {label} has two runs of one set: {names}")
    return {run.name: run.results for run in runs}


def _figures(a_rows: list[QuestionResult], b_rows: list[QuestionResult], policies: list[str]) -> dict[str, Any]:
    figures = {}
    for policy in policies:
        a = [r for r in a_rows if r.policy == policy]
        b = [r for r in b_rows if r.policy == policy]
        shared = {r.id for r in a} & {r.id for r in b}
        a, b = [r for r in a if r.id in shared], [r for r in b if r.id in shared]
        entry: dict[str, Any] = {"questions": len(shared)}
        for field, name, scale in PAIRED:
            a_values, b_values = by_question(a, field, scale), by_question(b, field, scale)
            difference = paired_difference(b_values, a_values)
            entry[name] = {"a": _json(mean_of(a_values)), "b": _json(mean_of(b_values)),
                           "b_minus_a": None if difference is None else difference.as_json()}
        figures[policy] = entry
    return figures


def _json(estimate) -> Any:
    return None if estimate is None else estimate.as_json()


def compare(a_folders: list[Path], b_folders: list[Path]) -> dict[str, Any]:
    a, b = _side(a_folders, "A"), _side(b_folders, "B")
    sets = [name for name in a if name in b]
    if not sets:
        raise BenchError(f"the two sides share no dev set (A: {sorted(a)}, B: {sorted(b)})")
    policies = [p for p in dict.fromkeys(r.policy for name in sets for r in a[name])
                if any(r.policy == p for name in sets for r in b[name])]
    if not policies:
        raise BenchError("the two sides ran no policy in common")
    return {
        "command": command_line(),
        "a": [str(folder) for folder in a_folders],
        "b": [str(folder) for folder in b_folders],
        "policies": policies,
        "method": "per policy, the questions both sides answered; B minus A per question, mean and bootstrap "
                  "95% interval (2000 resamples, seed 0); question ids prefixed with their set",
        "sets": {name: _figures(a[name], b[name], policies) for name in sets},
        POOLED: _figures([r for name in sets for r in a[name]], [r for name in sets for r in b[name]], policies),
    }


def _value(estimate: dict[str, Any] | None, digits: int) -> str:
    return "n/a" if estimate is None else f"{estimate['value']:.{digits}f}"


def _difference(difference: dict[str, Any] | None, digits: int) -> str:
    if difference is None:
        return "n/a"
    low, high = difference["ci95"]
    return f"{difference['mean']:+.{digits}f} ({low:+.{digits}f}..{high:+.{digits}f})"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"A: {', '.join(report['a'])}", f"B: {', '.join(report['b'])}", ""]
    for name, figures in [(POOLED, report[POOLED]), *report["sets"].items()]:
        lines += [f"### {name}", "",
                  "| policy | questions | answer-span KL A | B | B - A | 1st-token KL A | B | B - A | F1 B - A "
                  "| agreement % B - A |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for policy, entry in figures.items():
            span, first = entry["answer_span_kl"], entry["first_token_kl"]
            lines.append("| " + " | ".join([
                policy, str(entry["questions"]), _value(span["a"], 3), _value(span["b"], 3),
                _difference(span["b_minus_a"], 3), _value(first["a"], 3), _value(first["b"], 3),
                _difference(first["b_minus_a"], 3), _difference(entry["f1"]["b_minus_a"], 1),
                _difference(entry["agreement_with_full"]["b_minus_a"], 0)]) + " |")
        lines.append("")
    return "\n".join(lines)


def register(commands) -> None:
    parser = commands.add_parser(
        "compare", help="two sides of `bench quality` runs on the same questions (two checkpoints, two prompt "
                        "forms), paired question by question with intervals",
        description="Per policy both sides ran, per set and pooled: each side's answer-span KL, first-token "
                    "KL, F1 and agreement, and B minus A per question with a bootstrap 95% interval. Writes "
                    "compare.json and compare.md to --out.")
    parser.add_argument("--a", type=Path, nargs="+", required=True, metavar="RUN",
                        help="side A: `picrag bench quality --out` folders, one per dev set")
    parser.add_argument("--b", type=Path, nargs="+", required=True, metavar="RUN", help="side B: the same sets")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.set_defaults(func=_main)


def _main(args) -> int:
    report = compare(args.a, args.b)
    return write_report(args.out, "compare", report, markdown(report))
