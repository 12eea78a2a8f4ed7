"""`picrag bench frontier`: one reader's KL-versus-speed-up plot from stored `bench quality` runs.

A `bench quality` run plots its own policies on one dev set; choosing a policy for a reader means
seeing every policy measured on every set at once. This draws one panel per dev set, each policy
at its TTFT speed-up over the `full` of its own run and its mean exact first-token KL, taken from
the last run given that measured it on that set, so a newer run of a policy replaces an older one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from rag_server.bench.common import reporting_errors
from rag_server.bench.quality import StoredRun, check_comparable, read_run


@dataclass(frozen=True)
class FrontierPoint:
    policy: str
    speedup: float
    kl: float
    run: str  # the run folder's name


def latest_points(runs: list[StoredRun]) -> dict[str, dict[str, FrontierPoint]]:
    """Points by dev set (the dataset file's name, and what the run changed in its prompts) and
    policy; later runs replace earlier ones.
    `full` itself (speed-up 1, KL 0) is left out: every panel's origin."""
    check_comparable(runs, "a plot is one reader's")
    points: dict[str, dict[str, FrontierPoint]] = {}
    for run in runs:
        # A run with other prompts (unrelated distractors, cut passages) asks another question of
        # the reader: its own panel.
        dataset = run.prompts.replace(".jsonl", "", 1)
        for policy, values in run.summary.items():
            speedup, kl = values.get("ttft_speedup_vs_full"), values.get("first_token_kl_mean")
            if policy == "full" or speedup is None or kl is None:
                continue
            points.setdefault(dataset, {})[policy] = FrontierPoint(policy, speedup, kl, run.path.parent.name)
    return points


def frontier_plot(points: dict[str, dict[str, FrontierPoint]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    sets = sorted(points)
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 4.6), squeeze=False)
    for axis, dataset in zip(axes[0], sets):
        ranked = sorted(points[dataset].values(), key=lambda p: p.speedup)
        for index, point in enumerate(ranked):
            axis.scatter(point.speedup, point.kl, color="tab:red" if "select" in point.policy else "tab:blue")
            # Alternate label offsets: neighbouring policies often sit close together.
            axis.annotate(point.policy, (point.speedup, point.kl), textcoords="offset points", fontsize=7,
                          xytext=(4, 3 if index % 2 == 0 else -9))
        axis.set_xscale("log")
        speedups = FuncFormatter(lambda value, _: f"{value:g}x")
        axis.xaxis.set_major_formatter(speedups)
        axis.xaxis.set_minor_formatter(speedups)
        axis.tick_params(axis="x", which="minor", labelsize=7)
        axis.set_title(dataset, fontsize=9)
        axis.set_xlabel("TTFT speed-up over full (p50, log scale)")
        axis.set_ylabel("exact first-token KL to full (lower is better)")
        axis.grid(alpha=0.3, which="both")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(commands) -> None:
    """Add `bench frontier` to the `bench` command group's subparsers."""
    frontier = commands.add_parser(
        "frontier", help="one reader's KL-versus-speed-up plot from stored `bench quality` runs",
        description="Plot every policy of stored `bench quality` runs of one model: one panel per dev set, "
        "TTFT speed-up over full against exact first-token KL, each policy from the last run given "
        "that measured it on that set.",
    )
    frontier.add_argument("runs", nargs="+", type=Path, metavar="RUN",
                          help="a run's results.json, or the folder holding it (later runs replace earlier ones)")
    frontier.add_argument("--out", type=Path, required=True, metavar="FILE", help="the PNG to write")
    frontier.set_defaults(func=_main)


@reporting_errors("frontier")
def _main(args) -> int:
    runs = [read_run(path) for path in args.runs]
    points = latest_points(runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    questions = sorted({len({r.id for r in run.results}) for run in runs})
    counts = str(questions[0]) if len(questions) == 1 else f"{questions[0]}-{questions[-1]}"
    frontier_plot(points, f"{runs[0].model}: {counts} dev questions per run; red: query-aware selection", args.out)
    for dataset in sorted(points):
        for point in sorted(points[dataset].values(), key=lambda p: -p.speedup):
            print(f"{dataset}\t{point.policy}\t{point.speedup:.1f}x\tKL {point.kl:.3f}\t{point.run}")
    print(f"-> {args.out}", file=sys.stderr)
    return 0
