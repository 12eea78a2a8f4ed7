"""Ingestion and token-aware chunking of corpora into passages with stable content ids."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from retrieval.chunking import chunk_documents, chunk_text, token_counter
from retrieval.ingest import read_documents
from retrieval.passage import Passage, passage_id
from tests.conftest import SHARED_QA

QA_DIR = SHARED_QA


@pytest.fixture(scope="module")
def count_tokens(default_model_dir: Path):
    return token_counter(default_model_dir)


@pytest.fixture(scope="module")
def qa_passages() -> list[dict]:
    path = QA_DIR / "musique.dev.jsonl"
    if not path.is_file():
        pytest.skip(f"shared QA data not found at {path} (shared/ must sit beside the clone)")
    with path.open() as rows:
        return [passage for row in rows for passage in json.loads(row)["passages"]][:120]


def long_documents(qa_passages: list[dict]) -> dict[str, str]:
    texts = [passage["text"] for passage in qa_passages]
    return {
        "paragraphs": "\n\n".join(texts[:40]),
        "one paragraph": " ".join(texts[40:80]),
        "lines and blank runs": "\n".join(texts[80:100]) + "\n\n\n   \n" + "\n\n".join(texts[100:110]),
        "no punctuation": " ".join(re.sub(r"[^\w\s]", "", text) for text in texts[110:120]),
        "no spaces": "x" * 3000 + "".join(texts[:3]).replace(" ", ""),
        "leading and trailing whitespace": "\n\n  " + "\n\n".join(texts[:6]) + "\n\n\n",
    }


@pytest.mark.parametrize("max_tokens", [16, 64, 192])
def test_passages_fit_the_limit_and_concatenate_to_the_document(qa_passages, count_tokens, max_tokens):
    for name, document in long_documents(qa_passages).items():
        pieces = chunk_text(document, count_tokens, max_tokens)
        assert "".join(pieces) == document, name
        assert len(pieces) > 1, name
        over = [count_tokens(piece) for piece in pieces if count_tokens(piece) > max_tokens]
        assert not over, f"{name}: pieces of {over} tokens over the limit of {max_tokens}"


def test_breaks_fall_at_paragraph_ends_when_paragraphs_fit(qa_passages, count_tokens):
    paragraphs = [passage["text"] for passage in qa_passages[:30] if count_tokens(passage["text"]) <= 150]
    pieces = chunk_text("\n\n".join(paragraphs), count_tokens, 192)
    assert len(pieces) > 3
    assert all(piece.endswith("\n\n") for piece in pieces[:-1])
    # Greedy packing: no piece could have taken the next piece's first paragraph too.
    for piece, following in zip(pieces, pieces[1:]):
        first_paragraph = following.split("\n\n")[0] + "\n\n"
        assert count_tokens(piece + first_paragraph) > 192


def test_breaks_fall_at_sentence_ends_inside_a_long_paragraph(qa_passages, count_tokens):
    sentences = [sentence for passage in qa_passages[:30]
                 for sentence in re.split(r"(?<=\.) ", passage["text"].strip())
                 if sentence.endswith(".") and count_tokens(sentence) <= 40]
    pieces = chunk_text(" ".join(sentences), count_tokens, 64)
    assert len(pieces) > 3
    assert all(re.search(r"\.[\"”)]* $", piece) for piece in pieces[:-1])


def test_short_text_is_one_passage(count_tokens):
    assert chunk_text("A short passage.", count_tokens, 192) == ["A short passage."]
    assert chunk_text("", count_tokens, 192) == []


def test_a_limit_too_small_to_progress_is_refused(count_tokens):
    with pytest.raises(ValueError, match="at least 16"):
        chunk_text("text", count_tokens, 8)


def test_token_counter_accepts_a_folder_a_tokenizer_or_a_function(default_model_dir):
    from transformers import AutoTokenizer

    text = "Paris is the capital of France."
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    assert token_counter(default_model_dir)(text) == expected
    assert token_counter(str(default_model_dir))(text) == expected
    assert token_counter(tokenizer)(text) == expected
    assert token_counter(len)(text) == len(text)
    with pytest.raises(TypeError):
        token_counter(42)


def test_passage_ids_are_stable_content_hashes():
    # Pinned: ids key the chunk KV cache and persisted indexes, so they must never drift.
    assert passage_id("Paris is the capital of France.") == "557be7eca214f188"
    assert passage_id("  Paris is the\ncapital of France. ") == passage_id("Paris is the capital of France.")
    assert passage_id("Paris is the capital of France!") != passage_id("Paris is the capital of France.")
    assert Passage.from_text("some text", title="T").id == passage_id("some text")


def test_chunk_documents_keeps_each_text_once(count_tokens):
    shared = "A paragraph that two documents share, word for word."
    first, second = "First document, with its own opening words.", "Second document, with other words."
    documents = [
        Passage(id="a", title="A", text=f"{first}\n\n{shared}"),
        Passage(id="b", title="B", text=f"{second}\n\n{shared}"),
        Passage(id="a-copy", title="A again", text=f"{first}\n\n{shared}"),
    ]
    passages = chunk_documents(documents, count_tokens, 16)
    ids = [passage.id for passage in passages]
    assert len(ids) == len(set(ids)) == 3
    assert [passage.text.strip() for passage in passages] == [first, shared, second]
    assert passages[1].title == "A" and passages[1].metadata["doc_id"] == "a"
    assert passages[0].metadata == {"doc_id": "a", "chunk": 0, "chunks": 2}


def test_read_documents_from_jsonl_qa_text_and_markdown(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "notes").mkdir(parents=True)
    (corpus / "docs.jsonl").write_text(
        json.dumps({"id": "d1", "title": "Doc one", "text": "Text one.", "lang": "en", "metadata": {"year": 2020}}) + "\n"
        + "\n"
        + json.dumps({"text": "Text two, no title."}) + "\n"
        + json.dumps({"id": "q1", "question": "?", "passages": [{"title": "P", "text": "Passage one.", "is_supporting": True},
                                                                {"title": "Q", "text": "Passage two."}]}) + "\n")
    (corpus / "notes" / "guide.md").write_text("Intro line.\n\n# The guide\n\nBody text.\n")
    (corpus / "notes" / "plain.txt").write_text("Plain text file.\n")
    (corpus / "notes" / "ignored.csv").write_text("a,b\n")
    (corpus / "notes" / "empty.txt").write_text("  \n")

    documents = list(read_documents([corpus]))
    assert [(d.title, d.text) for d in documents] == [
        ("Doc one", "Text one."), ("", "Text two, no title."), ("P", "Passage one."), ("Q", "Passage two."),
        ("The guide", "Intro line.\n\n# The guide\n\nBody text.\n"), ("plain", "Plain text file.\n"),
    ]
    assert documents[0].id == "d1"
    assert documents[0].metadata == {"source": str(corpus / "docs.jsonl"), "lang": "en", "year": 2020}
    assert documents[1].id == passage_id("Text two, no title.")
    assert documents[2].metadata["qa_id"] == "q1"


def test_read_documents_reports_bad_input_with_its_place(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        list(read_documents([bad]))
    bad.write_text(json.dumps({"title": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a row needs a string 'text'"):
        list(read_documents([bad]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(read_documents([tmp_path / "missing"]))
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported corpus file"):
        list(read_documents([tmp_path / "table.csv"]))
