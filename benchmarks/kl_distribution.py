"""How each policy's first-token KL to `full` spreads over the questions of stored
`picrag bench quality` runs: mean, median, 90th percentile, the share of the mean that the worst
tenth of questions carries, and the share of questions below a KL threshold. A mean can miss a
target because of a few questions; this says whether it does.

    python benchmarks/kl_distribution.py RUN [RUN ...] [--policies naive,cacherepair] [--below 0.1]

RUN is a run's results.json or the folder holding it. Reads files only; runs no model.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from rag_server.service.percentile import percentile
from rag_server.bench.quality import read_run


def spread(kls: list[float], below: float) -> dict[str, float]:
    ordered = sorted(kls)
    worst = ordered[len(ordered) - max(1, math.ceil(len(ordered) / 10)):]
    total = sum(ordered)
    return {
        "mean": statistics.fmean(ordered),
        "median": percentile(ordered, 50),
        "p90": percentile(ordered, 90),  # as the bench tables' TTFT p90
        "worst_tenth_share": sum(worst) / total if total else 0.0,
        "below": sum(k < below for k in ordered) / len(ordered),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN")
    parser.add_argument("--policies", default="naive,cacherepair")
    parser.add_argument("--below", type=float, default=0.1, help="KL threshold for the last column (default 0.1)")
    args = parser.parse_args()
    print(f"| run | policy | questions | mean KL | median | p90 | worst tenth's share of the mean | below {args.below} |")
    print("|---|---|---|---|---|---|---|---|")
    for path in args.runs:
        run = read_run(path)
        for policy in args.policies.split(","):
            kls = [r.first_token_kl for r in run.results if r.policy == policy and r.first_token_kl is not None]
            if not kls:
                continue
            s = spread(kls, args.below)
            print(f"| {run.path.parent.name} | {policy} | {len(kls)} | {s['mean']:.3f} | {s['median']:.3f} | "
                  f"{s['p90']:.3f} | {s['worst_tenth_share']:.0%} | {s['below']:.0%} |")


if __name__ == "__main__":
    main()
