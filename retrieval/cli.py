"""`picrag index build|add|info|search`: the index command group.

`register(subparsers)` adds the group to an argparse subparsers object; every subcommand sets
`func`, a handler that takes the parsed namespace and returns the exit code.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from retrieval.chunking import DEFAULT_MAX_TOKENS, TokenCounter, chunk_documents, token_counter
from retrieval.index import (INDEX_KINDS, HnswSettings, PassageIndex, RetrievalIndexError, index_exists, index_lock,
                             read_manifest)
from retrieval.ingest import read_documents
from retrieval.model_info import EmbeddingModelInfo
from retrieval.passage import Passage

if TYPE_CHECKING:
    # Importing the embedder loads torch (seconds): handlers import it when they run.
    from retrieval.embedder import Embedder

logger = logging.getLogger(__name__)

DEFAULT_TOKENIZER_MODEL = "smollm2-135m"

Handler = Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A problem the user can fix, reported as one line on stderr."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("index", help="build, extend, inspect and search passage indexes",
                                   description="Build, extend, inspect and search passage indexes.")
    commands = parser.add_subparsers(dest="index_command", metavar="COMMAND", required=True)

    build = commands.add_parser("build", help="build an index from corpus files")
    _index_dir_option(build)
    _corpus_options(build)
    build.add_argument("--kind", choices=INDEX_KINDS, default="flat",
                       help="flat: exact search (default); hnsw: approximate, for large corpora")
    build.add_argument("--hnsw-m", type=int, default=HnswSettings.m, help="HNSW graph degree")
    build.add_argument("--hnsw-ef-search", type=int, default=HnswSettings.ef_search,
                       help="HNSW search breadth (higher: better recall, slower)")
    build.add_argument("--overwrite", action="store_true", help="replace an index already in the directory")
    build.set_defaults(func=build_command)

    add = commands.add_parser("add", help="add corpus files to an existing index (known passages are skipped)")
    _index_dir_option(add)
    _corpus_options(add)
    add.set_defaults(func=add_command)

    info = commands.add_parser("info", help="describe an index")
    _index_dir_option(info)
    info.add_argument("--verify", action="store_true",
                      help="also load the index and check its checksums")
    info.set_defaults(func=info_command)

    search = commands.add_parser("search", help="print the passages most similar to a question")
    _index_dir_option(search)
    search.add_argument("question")
    search.add_argument("-k", type=int, default=5, help="number of passages (default 5)")
    search.add_argument("--embedding-model", type=Path, metavar="PATH",
                        help="sentence-transformers folder (default: the one recorded in the index)")
    search.add_argument("--json", action="store_true", help="one JSON object per passage")
    search.set_defaults(func=search_command)
    return parser


def _index_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--index", "--out", dest="index_dir", type=Path, required=True, metavar="DIR",
                        help="index directory")


def _corpus_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", type=Path, action="append", required=True, metavar="PATH",
                        help="a .jsonl, .txt or .md file, or a folder of them (repeatable)")
    parser.add_argument("--embedding-model", type=Path, metavar="PATH",
                        help="sentence-transformers model folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                        help=f"most LLM tokens in a passage (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--tokenizer", type=Path, metavar="PATH",
                        help=f"tokenizer folder that counts passage tokens (default: the {DEFAULT_TOKENIZER_MODEL} LLM's)")


def _reporting_errors(handler: Handler) -> Handler:
    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except (CommandError, RetrievalIndexError, FileNotFoundError, ValueError) as error:
            print(f"picrag index {args.index_command}: error: {error}", file=sys.stderr)
            return 1
    return run


@_reporting_errors
def build_command(args: argparse.Namespace) -> int:
    from retrieval.retriever import Retriever

    # Held throughout, so that an index another writer saves meanwhile is not replaced unasked.
    with index_lock(args.index_dir):
        if index_exists(args.index_dir) and not args.overwrite:
            raise CommandError(f"an index already exists in {args.index_dir}: use `picrag index add` "
                               "to extend it or --overwrite to replace it")
        started = time.perf_counter()
        passages = _read_passages(args)
        hnsw = HnswSettings(m=args.hnsw_m, ef_search=args.hnsw_ef_search) if args.kind == "hnsw" else None
        retriever = Retriever.create(_embedder(args.embedding_model), args.kind, hnsw)
        retriever.add(passages, progress=True)
        retriever.save(args.index_dir)
    print(f"built {args.kind} index of {len(retriever)} passages in {args.index_dir} "
          f"({time.perf_counter() - started:.1f} s)")
    return 0


@_reporting_errors
def add_command(args: argparse.Namespace) -> int:
    from retrieval.retriever import Retriever

    embedder = _embedder(args.embedding_model) if args.embedding_model else None
    # From reading the index to saving it: a concurrent add waits, then extends this one's result.
    with index_lock(args.index_dir):
        retriever = Retriever.open(args.index_dir, embedder)
        passages = _read_passages(args)
        added = retriever.add(passages, progress=True)
        if added:
            retriever.save(args.index_dir)
    print(f"added {added} new passages to {args.index_dir} ({len(passages) - added} already present); "
          f"the index now holds {len(retriever)}")
    return 0


@_reporting_errors
def info_command(args: argparse.Namespace) -> int:
    manifest = read_manifest(args.index_dir)
    if args.verify:
        PassageIndex.load(args.index_dir, EmbeddingModelInfo.from_json(manifest["embedding_model"]))
    model = manifest["embedding_model"]
    lines = [
        f"index:           {args.index_dir}",
        f"kind:            {manifest['kind']}" + (f" {manifest['hnsw']}" if manifest["hnsw"] else ""),
        f"passages:        {manifest['count']}",
        f"embedding model: {model['name']} ({model['dimension']} dimensions) at {model.get('path') or '?'}",
        f"fingerprint:     {model['fingerprint']}",
        f"saved at:        {manifest.get('saved_at', '?')}",
    ] + [f"sha256 {name}: {digest}" for name, digest in manifest["sha256"].items()]
    if args.verify:
        lines.append("verified:        checksums and counts match")
    print("\n".join(lines))
    return 0


@_reporting_errors
def search_command(args: argparse.Namespace) -> int:
    from retrieval.retriever import Retriever

    embedder = _embedder(args.embedding_model) if args.embedding_model else None
    results = Retriever.open(args.index_dir, embedder).search(args.question, args.k)
    for rank, passage in enumerate(results, start=1):
        if args.json:
            print(json.dumps({"rank": rank, "score": passage.score, **passage.to_json()}, ensure_ascii=False))
        else:
            snippet = textwrap.shorten(passage.text, width=200, placeholder=" …")
            print(f"{rank:>3}. {passage.score:.4f}  {passage.id}  {passage.title}\n     {snippet}")
    return 0


def _read_passages(args: argparse.Namespace) -> list[Passage]:
    started = time.perf_counter()
    passages = chunk_documents(read_documents(args.corpus), resolve_token_counter(args.tokenizer), args.chunk_tokens)
    logger.info("read %d passages from %s in %.1f s", len(passages),
                ", ".join(map(str, args.corpus)), time.perf_counter() - started)
    if not passages:
        raise CommandError(f"no text found in {', '.join(map(str, args.corpus))}")
    return passages


def resolve_token_counter(tokenizer: Path | None) -> TokenCounter:
    """Counts tokens of the tokenizer folder given, else of the project's default LLM."""
    if tokenizer is not None:
        return token_counter(tokenizer)
    try:
        from picrag_core.model_store import ensure_model

        model_dir = ensure_model(DEFAULT_TOKENIZER_MODEL)
    except Exception as error:  # any failure of the optional default means: ask for --tokenizer
        raise CommandError(f"the default tokenizer ({DEFAULT_TOKENIZER_MODEL}) is unavailable ({error}); "
                           "pass --tokenizer PATH to a tokenizer folder") from error
    return token_counter(model_dir)


def _embedder(model_path: Path | None) -> Embedder:
    from retrieval.embedder import Embedder

    return Embedder(model_path)
