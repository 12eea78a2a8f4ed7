"""Embedding throughput and search latency of flat vs HNSW indexes, in one run.

The corpus pools every passage of the shared QA files (MuSiQue, HotpotQA, 2WikiMultihopQA
and NQ-open), chunked at the LLM tokenizer's token budget and deduplicated by content id; it
is embedded once and indexed both ways. Queries are the files' questions. "search" times the
FAISS search of a precomputed query vector; "question → passages" times `Retriever.search`
(one-thread query embedding, then search), which is what the frontend pays. Usage:

    python benchmarks/retrieval_bench.py [--limit N] [--queries N] [--tokenizer PATH]

Prints a Markdown table.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from retrieval.chunking import DEFAULT_MAX_TOKENS, chunk_documents
from retrieval.cli import resolve_token_counter
from retrieval.embedder import Embedder
from retrieval.index import INDEX_KINDS, PassageIndex
from retrieval.ingest import read_documents
from retrieval.retriever import Retriever

QA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "qa"
WARM_UP_QUERIES = 5


def questions(files: list[Path], limit: int) -> list[str]:
    found = []
    for file in files:
        with file.open() as rows:
            found.extend(json.loads(row)["question"] for row in rows)
    # Spread the sample over all files rather than taking the first file's questions.
    step = max(1, len(found) // limit)
    return found[::step][:limit]


def latencies_ms(run: Callable[[int], object], count: int) -> np.ndarray:
    for number in range(min(WARM_UP_QUERIES, count)):
        run(number)
    times = []
    for number in range(count):
        started = time.perf_counter()
        run(number)
        times.append(1e3 * (time.perf_counter() - started))
    return np.array(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qa-dir", type=Path, default=QA_DIR)
    parser.add_argument("--limit", type=int, help="use at most N passages of the pooled corpus")
    parser.add_argument("--queries", type=int, default=300, help="number of timed questions (default 300)")
    parser.add_argument("-k", type=int, default=10)
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: the default LLM's)")
    parser.add_argument("--embedding-model", type=Path, help="sentence-transformers folder (default: all-MiniLM-L6-v2)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    files = sorted(args.qa_dir.glob("*.jsonl"))
    if not files:
        raise SystemExit(f"no QA files in {args.qa_dir}")
    passages = chunk_documents(read_documents(files), resolve_token_counter(args.tokenizer), args.chunk_tokens)
    passages = passages[:args.limit] if args.limit else passages
    query_texts = questions(files, args.queries)

    embedder = Embedder(args.embedding_model)
    started = time.perf_counter()
    vectors = embedder.embed_documents([passage.embedding_text() for passage in passages], progress=True)
    throughput = len(passages) / (time.perf_counter() - started)
    query_vectors = embedder.embed_queries(query_texts)

    rows = []
    exact_hits: list[set[str]] = []
    for kind in sorted(INDEX_KINDS, key=lambda kind: kind != "flat"):
        index = PassageIndex(embedder.info, kind)
        started = time.perf_counter()
        index.add(passages, vectors)
        build_s = time.perf_counter() - started
        search = latencies_ms(lambda n: index.search(query_vectors[n], args.k), len(query_texts))
        retriever = Retriever(index, embedder)
        end_to_end = latencies_ms(lambda n: retriever.search(query_texts[n], args.k), len(query_texts))
        hits = [{passage.id for passage in result} for result in index.search(query_vectors, args.k)]
        if kind == "flat":
            exact_hits = hits
        overlap = np.mean([len(found & exact) / len(exact) for found, exact in zip(hits, exact_hits)])
        rows.append(f"| {kind} | {len(passages)} | {throughput:.0f} | {build_s:.2f} | "
                    f"{np.percentile(search, 50):.2f} | {np.percentile(search, 99):.2f} | "
                    f"{np.percentile(end_to_end, 50):.1f} | {np.percentile(end_to_end, 99):.1f} | {overlap:.3f} |")

    print(f"\nCorpus: {', '.join(file.name for file in files)}; {len(passages)} passages "
          f"(<= {args.chunk_tokens} tokens, unique by content id); {len(query_texts)} questions, k={args.k}; "
          f"embedding model {embedder.name}, batch embedding on {torch.get_num_threads()} threads, "
          f"queries on {embedder.query_threads}.\n")
    print(f"| index | passages | embedding (passages/s) | build (s) | search p50 (ms) | search p99 (ms) "
          f"| question → passages p50 (ms) | p99 (ms) | top-{args.k} overlap with flat |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
