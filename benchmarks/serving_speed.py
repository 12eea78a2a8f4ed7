"""Decode and prefill tokens/s of `picrag serve` vs a plain transformers loop, side by side,
and the server's aggregate decode tokens/s with concurrent streams.

Same model folder, same prompt token ids, greedy decoding, medians over repeats; the two
engines take turns so machine noise hits both alike. Then `--streams` requests (each its own
prompt of the same length, so no prefix is shared) are sent at once: their aggregate decode
rate is the tokens they decoded after their first token over the time from the last first
token to the last finish, when every stream was decoding (tokens decoded before that window
are left out of both). Usage:

    python benchmarks/serving_speed.py [--url http://127.0.0.1:8000] [--prompt-tokens 512]

Without --url a server is started on the default model and stopped at the end.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import shlex
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from rag_server.bench.common import server

REPO = Path(__file__).resolve().parents[1]
QA = REPO.parent / "shared" / "data" / "qa" / "musique.dev.jsonl"


def prompt_ids(tokenizer, n_tokens: int, row_index: int = 0) -> list[int]:
    row = json.loads(QA.read_text().splitlines()[row_index])
    text = "\n\n".join(p["text"] for p in row["passages"])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise SystemExit(f"sample text has only {len(ids)} tokens")
    return ids[:n_tokens]


def served_run(client: httpx.Client, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one cold request."""
    client.post("/flush_cache").raise_for_status()
    out = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
        },
    ).json()
    meta = out["meta_info"]
    ttft = meta["first_token_latency"]
    decode_s = meta["e2e_latency"] - ttft
    return len(ids) / ttft, (new_tokens - 1) / decode_s


def token_times(url: str, ids: list[int], new_tokens: int) -> list[float]:
    """The arrival time (perf_counter) of every streamed token of one greedy request."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    times, seen = [], 0
    with httpx.Client(base_url=url, timeout=1800) as client, client.stream("POST", "/generate", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            produced = len(json.loads(line[len("data:"):])["output_ids"])
            times += [time.perf_counter()] * (produced - seen)
            seen = produced
    return times


def concurrent_decode(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Aggregate decode tokens/s while all of `prompts` decode at once (module docstring)."""
    with httpx.Client(base_url=url, timeout=600) as client:
        client.post("/flush_cache").raise_for_status()
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = list(pool.map(lambda ids: token_times(url, ids, new_tokens), prompts))
    window_start = max(times[0] for times in streams)
    window_end = max(times[-1] for times in streams)
    decoded = sum(sum(1 for t in times[1:] if t > window_start) for times in streams)
    return decoded / (window_end - window_start)


def transformers_run(model, ids: list[int], new_tokens: int) -> tuple[float, float]:
    with torch.inference_mode():
        started = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        ttft = time.perf_counter() - started
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        decode_s = time.perf_counter() - started
    return len(ids) / ttft, (new_tokens - 1) / decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16,
                        help="concurrent streams of the aggregate run (0: no aggregate run)")
    parser.add_argument("--serve-args", default="", help="extra `picrag serve` arguments")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from picrag_core.model_store import ensure_model

    model_dir = ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    stream_prompts = [prompt_ids(tokenizer, args.prompt_tokens, row) for row in range(args.streams)]

    results: dict[str, list[tuple[float, float]]] = {"picrag serve (SGLang)": [], "transformers": []}
    log = Path("/tmp/picrag-bench-serving.log")
    with server(args.url, None, args.port, log, shlex.split(args.serve_args)) as url:
        with httpx.Client(base_url=url, timeout=600) as client:
            served_run(client, ids, 4)  # warm-up
            transformers_run(model, ids, 4)
            for _ in range(args.repeats):
                results["picrag serve (SGLang)"].append(served_run(client, ids, args.new_tokens))
                results["transformers"].append(transformers_run(model, ids, args.new_tokens))
            aggregate = concurrent_decode(url, stream_prompts, args.new_tokens) if args.streams else None

    print(f"\nSmolLM2-135M fp32, CPU, {torch.get_num_threads()} threads, prompt {len(ids)} tokens, "
          f"{args.new_tokens} greedy tokens, median of {args.repeats}\n")
    print("| engine | prefill tokens/s | decode tokens/s |")
    print("|---|---|---|")
    medians = {}
    for name, runs in results.items():
        prefill = statistics.median(r[0] for r in runs)
        decode = statistics.median(r[1] for r in runs)
        medians[name] = (prefill, decode)
        print(f"| {name} | {prefill:.0f} | {decode:.1f} |")
    served, hf = medians["picrag serve (SGLang)"], medians["transformers"]
    print(f"\nratio served/transformers: prefill {served[0] / hf[0]:.2f}x, decode {served[1] / hf[1]:.2f}x")
    if aggregate is not None:
        print(f"{args.streams} concurrent streams: aggregate decode {aggregate:.1f} tokens/s, "
              f"{aggregate / served[1]:.2f}x one stream's")


if __name__ == "__main__":
    main()
