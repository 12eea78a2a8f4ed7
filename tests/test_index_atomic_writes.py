"""Index writes under crashes and concurrency: a save killed at any rename leaves an index that
loads (the old one or the new one), and two `picrag index add` processes at once both land.

A stand-in embedding model (8-dimensional vectors derived from the text) keeps the processes
light; the index, the directory swap and the `picrag index add` handler are the real ones.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from retrieval.index import INDEX_FILE, MANIFEST_FILE, PASSAGES_FILE, PassageIndex, RetrievalIndexError
from retrieval.model_info import EmbeddingModelInfo
from retrieval.passage import Passage

REPO = Path(__file__).resolve().parents[1]
INFO = EmbeddingModelInfo(name="stand-in", dimension=8, fingerprint="stand-in-1")
CRASH_EXIT = 17


def vector(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(INFO.dimension).astype(np.float32)
    return v / np.linalg.norm(v)


class StandInEmbedder:
    info = INFO

    def embed_documents(self, texts, progress: bool = False) -> np.ndarray:
        return np.stack([vector(text) for text in texts])


def passages(prefix: str, count: int) -> list[Passage]:
    return [Passage.from_text(f"{prefix} passage number {i} about owls and lemmings.", title=prefix) for i in range(count)]


def index_of(items: list[Passage]) -> PassageIndex:
    index = PassageIndex(INFO)
    index.add(items, StandInEmbedder().embed_documents([p.embedding_text() for p in items]))
    return index


def ids(index: PassageIndex) -> list[str]:
    return [p.id for p in index.passages]


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


# ---- a crash between renames ------------------------------------------------------------------


def crashing_save(directory: str, when: str, nth: str) -> None:
    """Extend the index in `directory` and save it, dying (no cleanup, like a power cut) just
    `when` ("before" or "after") its `nth` rename: os.replace, os.rename or a directory exchange."""
    import retrieval.directory_swap as swap

    calls = 0

    def crashing(rename):
        def run(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == int(nth) and when == "before":
                os._exit(CRASH_EXIT)
            rename(*args, **kwargs)
            if calls == int(nth):
                os._exit(CRASH_EXIT)
        return run

    os.replace, os.rename = crashing(os.replace), crashing(os.rename)
    if hasattr(swap, "_exchange"):
        swap._exchange = crashing(swap._exchange)
    index = PassageIndex.load(directory, INFO)
    new = passages("new", 5)
    index.add(new, StandInEmbedder().embed_documents([p.embedding_text() for p in new]))
    index.save(directory)


CRASHING_SAVE = "import sys; from tests.test_index_atomic_writes import crashing_save; crashing_save(*sys.argv[1:])"


def test_a_save_killed_at_any_rename_leaves_the_old_or_the_new_index(tmp_path):
    directory = tmp_path / "index"
    old = index_of(passages("old", 20))
    old.save(directory)
    new_ids = ids(old) + [p.id for p in passages("new", 5)]
    seen = []
    for nth in range(1, 10):
        for when in ("before", "after"):
            run = run_python(CRASHING_SAVE, str(directory), when, str(nth))
            assert run.returncode in (0, CRASH_EXIT), run.stderr
            loaded = ids(PassageIndex.load(directory, INFO))  # never refused
            assert loaded in (ids(old), new_ids), (when, nth)
            seen.append(loaded == new_ids)
            old.save(directory)  # back to the old index for the next crash
        if run.returncode == 0:  # the save made fewer than `nth` renames: every point was tried
            break
    assert run.returncode == 0 and seen[-1] and not seen[0]
    # What interrupted saves left beside the index is gone after the next save: the index and
    # its lock file remain.
    assert sorted(path.name for path in tmp_path.iterdir()) == [".index.lock", "index"]
    assert sorted(path.name for path in directory.iterdir()) == [INDEX_FILE, MANIFEST_FILE, PASSAGES_FILE]


def test_a_directory_holding_other_files_is_not_replaced(tmp_path):
    directory = tmp_path / "notes"
    directory.mkdir()
    (directory / "todo.txt").write_text("not an index")
    with pytest.raises(RetrievalIndexError, match="holds todo.txt"):
        index_of(passages("old", 3)).save(directory)
    assert sorted(path.name for path in directory.iterdir()) == ["todo.txt"]


def test_a_filesystem_without_directory_exchange_refuses_the_save_and_keeps_the_index(tmp_path, monkeypatch):
    import retrieval.directory_swap as swap

    directory = tmp_path / "index"
    index_of(passages("old", 3)).save(directory)

    def unsupported(a, b):
        raise swap.DirectorySwapError(f"the filesystem of {b} cannot exchange two directories atomically")

    monkeypatch.setattr(swap, "_exchange", unsupported)
    with pytest.raises(RetrievalIndexError, match="cannot save the index: the filesystem of .* cannot exchange"):
        index_of(passages("new", 4)).save(directory)
    assert ids(PassageIndex.load(directory, INFO)) == [p.id for p in passages("old", 3)]
    assert sorted(path.name for path in tmp_path.iterdir()) == [".index.lock", "index"]


def test_a_save_through_a_symlink_replaces_the_target_and_keeps_the_link(tmp_path):
    real = tmp_path / "real-index"
    index_of(passages("old", 3)).save(real)
    link = tmp_path / "index"
    link.symlink_to(real)
    index_of(passages("new", 4)).save(link)
    assert link.is_symlink() and ids(PassageIndex.load(real, INFO)) == [p.id for p in passages("new", 4)]


# ---- concurrent `picrag index add` ------------------------------------------------------------


def add_with_stand_in(delay_s: str, *cli_args: str) -> None:
    """`picrag index add` with the stand-in embedder and a word counter for chunking; the
    embedding step first sleeps `delay_s`, so that two adds started together overlap."""
    import argparse

    import retrieval.cli as cli
    from retrieval.retriever import Retriever

    cli._embedder = lambda path: StandInEmbedder()
    cli.resolve_token_counter = lambda tokenizer: (lambda text: len(text.split()))
    real_add = Retriever.add

    def slow_add(self, items, **kwargs):
        time.sleep(float(delay_s))
        return real_add(self, items, **kwargs)

    Retriever.add = slow_add
    parser = argparse.ArgumentParser(prog="picrag")
    cli.register(parser.add_subparsers(dest="command", required=True))
    namespace = parser.parse_args(["index", "add", *cli_args])
    sys.exit(namespace.func(namespace))


ADD = "import sys; from tests.test_index_atomic_writes import add_with_stand_in; add_with_stand_in(*sys.argv[1:])"


def test_two_concurrent_adds_both_land(tmp_path):
    directory = tmp_path / "index"
    base = passages("base", 10)
    index_of(base).save(directory)
    corpora = {}
    for name in ("owls", "lemmings"):
        corpora[name] = tmp_path / f"{name}.txt"
        corpora[name].write_text("\n\n".join(f"The {name} fact number {i} is worth keeping because owls eat lemmings." for i in range(6)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    adds = [subprocess.Popen([sys.executable, "-c", ADD, "2", "--index", str(directory), "--corpus", str(path),
                              "--embedding-model", "stand-in", "--chunk-tokens", "16"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for path in corpora.values()]
    outputs = [process.communicate(timeout=300) for process in adds]
    assert [process.returncode for process in adds] == [0, 0], outputs
    final = PassageIndex.load(directory, INFO)
    titles = [p.title for p in final.passages]
    assert titles.count("base") == 10 and titles.count("owls") == 6 and titles.count("lemmings") == 6
    # The second add read the first one's result: it reports the index with both.
    assert any("the index now holds 22" in stdout for stdout, _ in outputs)
