"""`picrag bench calibrate`: `auto`'s calibration table from stored `bench quality` runs.

One run covers one dataset, so one prompt-size range; the table `auto` serves from wants every
size the model will see. This pools the per-question first-token KLs of several runs (one model,
KL measured the same way) into one table, without running anything again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rag_server.bench.common import reporting_errors
from rag_server.bench.quality import MIN_CELL_QUESTIONS, calibration_from_runs, read_run


def register(commands) -> None:
    """Add `bench calibrate` to the `bench` command group's subparsers."""
    calibrate = commands.add_parser(
        "calibrate", help="the `auto` policy's calibration table from stored `bench quality` runs",
        description="Pool the per-question first-token KLs of `bench quality` runs of one model into "
        "one calibration table (mean KL per policy and prompt-size bucket, policies cheapest first by "
        "speed-up over full with each run's prompt length taken out).",
    )
    calibrate.add_argument("runs", nargs="+", type=Path, metavar="RUN",
                           help="a run's results.json, or the folder holding it")
    calibrate.add_argument("--min-questions", type=int, default=MIN_CELL_QUESTIONS, metavar="N",
                           help="leave out a policy's mean over a prompt-size bucket with fewer questions "
                           "(`auto` then reads its nearest bucket; default %(default)s)")
    calibrate.add_argument("--out", type=Path, default=None, metavar="FILE",
                           help="where to write the table (default: standard output); "
                           "`picrag serve --calibration FILE` loads it")
    calibrate.set_defaults(func=_main)


@reporting_errors("calibrate")
def _main(args) -> int:
    table = calibration_from_runs([read_run(path) for path in args.runs], args.min_questions)
    text = json.dumps(table.as_json(), indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"{table.model}: {', '.join(table.cost_order)} -> {args.out}", file=sys.stderr)
    return 0
