"""What a selecting link costs, read from stored `picrag bench quality` runs.

A selecting policy (`select:R,K`, `cacherepair+select:R,K`) sends two requests: a prefill-only
link of its base policy that measures the question's attention, then the link that recomputes
the chosen tokens. Per run, this fits the median TTFT of the selecting policies of one base
(at least two recompute sizes) as a line in the mean computed tokens:

    TTFT ~ fixed + per_token * computed tokens

`fixed` is what the two passes cost before any token is recomputed, so `full`'s TTFT over it
bounds the speed-up of that base's selecting links at any R and K; `at 5x` is how many
computed tokens (question included) still fit in a fifth of `full`'s TTFT, and that share of
the prompt. Two or three points a line: an estimate, not a measurement.

    python benchmarks/selection_cost.py docs/benchmarks/*select*/
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from picrag_core.policies import parse_policy
from rag_server.bench.quality import read_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders or their results.json")
    args = parser.parse_args()
    print("| run | full TTFT (s) | naive TTFT (s) | base | fixed (s) | per token (ms) | bound (x) | at 5x: tokens (share of prompt) |")
    print("|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        stored = read_run(run)
        policies = stored.summary
        full = policies["full"]["ttft_p50_s"]
        naive = policies.get("naive", {}).get("ttft_p50_s")
        by_base: dict[str, list[tuple[float, float]]] = {}
        for name, row in policies.items():
            scored_as = parse_policy(name).family.scored_as
            if scored_as:
                by_base.setdefault(scored_as, []).append((row["computed_tokens_mean"], row["ttft_p50_s"]))
        prompt = policies["full"]["prompt_tokens_mean"]
        for base, points in sorted(by_base.items()):
            if len({x for x, _ in points}) < 2:
                continue
            per_token, fixed = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
            tokens = max(0.0, (full / 5 - fixed) / per_token)
            print(f"| {stored.path.parent.name} | {full:.2f} | {naive if naive is None else f'{naive:.2f}'} | {base} | "
                  f"{fixed:.2f} | {1000 * per_token:.1f} | {full / fixed:.1f} | {tokens:.0f} ({100 * tokens / prompt:.0f}%) |")


if __name__ == "__main__":
    main()
