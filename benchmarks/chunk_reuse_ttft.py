"""TTFT of full prefill vs SGLang's prefix cache vs picrag's naive chunk reuse, side by side.

On MuSiQue dev rows (20 passages each), per row and in one run:
  full    policy full: nothing reused (a cold prefill of the whole prompt);
  prefix  SGLang's radix cache, warm: the same prompt minus the question was sent just before;
  naive, legolink:K, legolink0 (--link-policies)
          chunks warm (compiled by an earlier request of the same policy that used them in
          another order), the measured prompt uses a new shuffled order, so SGLang's prefix
          cache alone would miss.
TTFT is the client's wall time of a 1-token request through the picrag frontend. The warm-up
request compiled every piece through the frontend, which remembers them, so the measured request
skips the compile round trip (the steady state of a server whose passages repeat); a piece
evicted meanwhile would be recompiled and relinked. Medians over rows, and ratios to full.

    python benchmarks/chunk_reuse_ttft.py [--url URL] [--rows 10]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from rag_server.bench.common import server
from retrieval.prompt_layout import PromptLayout, PromptPassage
from picrag_core.engine_report import EngineReport
from picrag_core.link_hints import link_hints

REPO = Path(__file__).resolve().parents[1]
QA = REPO.parent / "shared" / "data" / "qa" / "musique.dev.jsonl"


def timed(client: httpx.Client, input_ids: list[int], policy: str | None, chunks=()) -> tuple[float, dict]:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    if policy is not None:
        body["kv_hints"] = link_hints(policy, list(chunks))
    started = time.perf_counter()
    response = client.post("/generate", json=body)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response.json()["meta_info"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--port", type=int, default=8012)
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link-policies", default="naive,legolink:2,legolink:16,legolink0")
    args = parser.parse_args()
    link_policies = args.link_policies.split(",")

    from transformers import AutoTokenizer

    from picrag_core.model_store import ensure_model

    layout = PromptLayout(AutoTokenizer.from_pretrained(ensure_model()))
    rows = [json.loads(line) for line in QA.read_text().splitlines()][: args.rows]
    rng = random.Random(args.seed)

    times: dict[str, list[float]] = {name: [] for name in ["full", "prefix", *link_policies]}
    tokens: dict[str, list[int]] = {name: [] for name in times}
    prompt_lens = []
    with server(args.url, None, args.port, Path("/tmp/picrag-bench-ttft.log")) as url:
        with httpx.Client(base_url=url, timeout=1800) as client:
            for i, row in enumerate(rows):
                passages = [PromptPassage(p["title"], p["text"]) for p in row["passages"]]
                prompt = layout.build(row["question"], passages)
                prompt_lens.append(len(prompt.input_ids))

                t, meta = timed(client, prompt.input_ids, "full", prompt.chunks)
                times["full"].append(t)
                tokens["full"].append(meta["prompt_tokens"] - meta["cached_tokens"])

                timed(client, prompt.input_ids[: prompt.chunks[-1][1]], None)  # warm SGLang's prefix cache
                t, meta = timed(client, prompt.input_ids, "prefix", prompt.chunks)
                times["prefix"].append(t)
                tokens["prefix"].append(meta["prompt_tokens"] - meta["cached_tokens"])

                warm_order, measured_order = passages[:], passages[:]
                rng.shuffle(warm_order)
                rng.shuffle(measured_order)
                warm = layout.build(row["question"], warm_order)
                measured = layout.build(row["question"], measured_order)
                for policy in link_policies:
                    timed(client, warm.input_ids, policy, warm.chunks)  # compiles every chunk
                    t, meta = timed(client, measured.input_ids, policy, measured.chunks)
                    times[policy].append(t)
                    tokens[policy].append(EngineReport.of(meta).link.computed_tokens)
                print(f"row {i + 1}/{len(rows)}: {len(prompt.input_ids)} tokens, "
                      + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)

    full = statistics.median(times["full"])
    print(f"\nSmolLM2-135M fp32 on CPU, {len(rows)} MuSiQue dev rows, 20 passages, "
          f"prompt median {statistics.median(prompt_lens):.0f} tokens\n")
    print("| policy | TTFT median (s) | speed-up vs full | computed tokens (median) |")
    print("|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {full / median:.1f}x | {statistics.median(tokens[name]):.0f} |")


if __name__ == "__main__":
    main()
