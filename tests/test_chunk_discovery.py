"""Finding passages inside whole prompts (rag_server/linking/chunk_discovery.py), on the default
model's tokenizer: the rules every discovered link must keep, as properties over generated
prompts, and the cases LMCache's users reported (seams that tokenize differently, identical
windows, the system prompt)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rag_server.linking.chunk_discovery import (DiscoverySettings, TokenizedPrompt, content_regions, discover,
                                                special_ids, text_regions, tokenized)

WORDS = ("river", "city", "museum", "the", "of", "king", "built", "in", "1850", "north", "Paris", "war", "é", "🙂",
         "data,", "(see", "note)", "U.S.", "e.g.", "x=1;", "\"quoted\"", "it's")
SEPARATORS = ("\n\n", "\n\n\n", " \n\n", "\n \n", "\n\n---\n", "\n[1] ", "\nDocument 2: ", "\n")


def chat_prompt(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenized(tokenizer, text, regions=content_regions(text, [m["content"] for m in messages]))
    assert list(prompt.ids) == tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                             return_dict=False)
    return prompt


def encoder(tokenizer, dummy_prefix: bool = False):
    """The tokenizer alone on a text; `dummy_prefix`: as SentencePiece tokenizers (Llama 2,
    Mistral v0.1) encode it, with a space put before a text that starts without one, so that a
    passage's ids alone differ from its ids in context."""
    def encode(text: str) -> list[int]:
        if dummy_prefix and not text.startswith(" "):
            text = " " + text
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return encode


def document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + rng.choice(("", ".", "!", ":"))


def token_text(prompt: TokenizedPrompt, start: int, end: int) -> str:
    return prompt.text[prompt.offsets[start][0]:prompt.offsets[end - 1][1]] if end > start else ""


def body_end(prompt: TokenizedPrompt, start: int, end: int) -> int:
    """Where a chunk's passage ends: before the whitespace tokens it ends with."""
    while end > start and token_text(prompt, end - 1, end).isspace():
        end -= 1
    return end


def check_rules(prompt: TokenizedPrompt, found, encode, config: DiscoverySettings) -> None:
    """What every discovered link must keep."""
    previous_end = None
    for start, end in found.chunks:
        assert 0 <= start < end < len(prompt.ids), "inside the prompt, and never its last token"
        assert previous_end is None or start == previous_end, "back to back: the engine grafts one run"
        previous_end = end
        assert not set(prompt.ids[start:end]) & prompt.special, "no message boundary inside a passage"
        passage_end = body_end(prompt, start, end)
        assert passage_end > start and not token_text(prompt, start, start + 1).isspace(), \
            "a passage starts with text and ends with its separator"
        assert tuple(encode(token_text(prompt, start, passage_end))) == prompt.ids[start:passage_end], \
            "its ids are the ones its text gets alone"
        assert end - start >= config.min_chunk_tokens
    assert not found.chunks or found.chunk_tokens >= config.min_linked_tokens
    assert len(found.chunks) <= config.max_chunks
    if found.tail:
        (_, second_end), (last_start, last_end) = found.chunks[-2:]
        assert body_end(prompt, last_start, last_end) == last_end, "a tail only where the last passage has none"
        assert prompt.ids[second_end - len(found.tail):second_end] == found.tail, "the separator before it"
        assert body_end(prompt, found.chunks[-2][0], second_end) == second_end - len(found.tail)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), documents=st.integers(1, 6), min_chunk=st.sampled_from([4, 16, 32]),
       dummy_prefix=st.booleans())
def test_every_discovered_link_keeps_the_rules(tokenizer, seed, documents, min_chunk, dummy_prefix):
    rng = random.Random(seed)
    body = ""
    for index in range(documents):
        body += (rng.choice(SEPARATORS) if index else "") + document(rng, rng.randint(2, 60))
    # The question: none, a short one, or one as long as a passage, asked in the forms QUESTION
    # knows (never linked: it is computed with the documents before it, as `full` computes it).
    question = rng.choice(("", "Question: why?", "Question: " + document(rng, rng.randint(20, 60)),
                           document(rng, rng.randint(20, 60)) + "?", "Query: " + document(rng, rng.randint(20, 60))
                           + "\nAnswer:"))
    messages = [{"role": "system", "content": document(rng, rng.randint(0, 30))},
                {"role": "user", "content": body + (f"\n\n{question}" if question else "")}]
    config = DiscoverySettings(min_chunk_tokens=min_chunk, min_linked_tokens=min_chunk, max_chunks=4)
    encode = encoder(tokenizer, dummy_prefix)
    prompt = chat_prompt(tokenizer, messages)
    as_text = tokenized(tokenizer, prompt.text)  # the same chat sent as one text (/generate, completions)
    for form in (prompt, as_text):
        found = discover(form, encode, config)
        check_rules(form, found, encode, config)
        if question:
            asked = form.text.rindex(question)
            assert all(form.offsets[end - 1][1] <= asked for _, end in found.chunks), "the question is never linked"


def permutation_prompts(tokenizer, vocabulary: int, placement: str, documents: int = 4, words: int = 100):
    """LMCache's blend stress workload: a system prompt, then permutations of the same documents
    in one user message, joined by blank lines (`placement` "user"); or the documents as a
    stuff-documents chain places them, the system message, with the question in the user's
    ("system")."""
    rng = random.Random(vocabulary)
    pool = [f"{'bcdfg'[i % 5]}{'aeiou'[i % 3]}{i}" for i in range(vocabulary)]
    docs = [" ".join(rng.choice(pool) for _ in range(words)) for _ in range(documents)]
    system = " ".join(rng.choice(("the", "system", "will", "answer")) for _ in range(100))
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):
        stuffed = "\n\n".join(docs[i] for i in order)
        messages = ([{"role": "system", "content": system}, {"role": "user", "content": stuffed}] if placement == "user"
                    else [{"role": "system", "content": stuffed}, {"role": "user", "content": "Which?"}])
        yield order, docs, chat_prompt(tokenizer, messages)


@pytest.mark.parametrize("placement", ["user", "system"])
@pytest.mark.parametrize("vocabulary", [1000, 6])
def test_a_document_has_one_key_wherever_it_moves(tokenizer, vocabulary, placement):
    """Every document of every permutation is found and stored as the same tokens wherever it
    stands, the last one too, though it has no blank line after it (the link's tail gives it the
    others'); with a 6-word vocabulary (identical windows everywhere) documents still share only
    with themselves. In the user message after the system prompt (LMCache's workload) the
    system prompt stays on the prefix cache and the last document, which asks nothing, is a
    passage; in the system message (a stuff-documents chain) the user's question is not."""
    encode = encoder(tokenizer)
    seen: dict[tuple[int, ...], int] = {}
    for order, docs, prompt in permutation_prompts(tokenizer, vocabulary, placement):
        found = discover(prompt, encode)
        check_rules(prompt, found, encode, DiscoverySettings())
        assert len(found.chunks) == 4 and found.tail
        if placement == "user":
            assert "system" in prompt.text[:prompt.offsets[found.chunks[0][0]][0]], "the system prompt is the head"
        for position, (start, end) in enumerate(found.chunks):
            assert token_text(prompt, start, end).strip() == docs[order[position]]
            stored = prompt.ids[start:end] + (found.tail if position == 3 else ())
            assert seen.setdefault(stored, order[position]) == order[position], "a chunk is one document's"
    assert len(seen) == 4, "one stored chunk per document, wherever it stands"


def test_short_paragraphs_join_the_passage_after_them_or_stay_prompt(tokenizer):
    rng = random.Random(3)
    docs = [document(rng, 50) for _ in range(3)]
    user = "Context:\n\n" + "\n\n".join(f"Title {i}\n\n{doc}" for i, doc in enumerate(docs)) + "\n\nQuestion: who?"
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": user}])
    found = discover(prompt, encoder(tokenizer))
    texts = [prompt.text[prompt.offsets[s][0]:prompt.offsets[e - 1][1]] for s, e in found.chunks]
    assert len(texts) == 3
    assert texts[0].startswith("Context:") and texts[1].startswith("Title 1\n\n")
    assert all(doc in text for doc, text in zip(docs, texts))
    assert "Question" not in "".join(texts), "the question after the last passage is computed, not reused"


def test_a_long_system_prompt_stays_on_the_prefix_cache(tokenizer):
    """A system prompt longer than all the documents together is still the head: the prefix
    cache serves it exactly; the documents in the user message are linked. Documents in the
    system message, the question in the user's (a stuff-documents chain), are linked there."""
    rng = random.Random(4)
    system = document(rng, 400)
    docs = [document(rng, 40) for _ in range(3)]
    prompt = chat_prompt(tokenizer, [{"role": "system", "content": system},
                                     {"role": "user", "content": "\n\n".join(docs) + "\n\nQuestion: who?"}])
    found = discover(prompt, encoder(tokenizer))
    assert len(found.chunks) == 3 and prompt.offsets[found.chunks[0][0]][0] > prompt.text.index(system) + len(system)
    stuffed = chat_prompt(tokenizer, [{"role": "system", "content": "Use this context:\n\n" + "\n\n".join(docs)},
                                      {"role": "user", "content": "Who?"}])
    assert len(discover(stuffed, encoder(tokenizer)).chunks) == 3


def test_a_prompt_with_too_little_to_reuse_is_left_alone(tokenizer):
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "Name a colour.\n\nAnd a fruit."}])
    assert discover(prompt, encoder(tokenizer)).chunks == ()


def test_a_rendered_chat_in_a_text_keeps_role_lines_and_specials_out(tokenizer):
    messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "a b c"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    regions = text_regions(text, encoded["input_ids"], encoded["offset_mapping"], special_ids(tokenizer))
    assert [text[s:e] for s, e in regions] == ["You help.", "a b c"], "the newlines between messages hold nothing"
    assert content_regions(text, ["You help.", "a b c"]) == regions


def test_a_break_folded_into_the_token_before_cuts_after_it():
    """Tokenizers such as Qwen's fold a blank line into the punctuation before it (".\\n\\n" one
    token): the passage after starts with the next token, and the check of each chunk's own
    tokenization decides what is kept."""
    text = "aa bb.\n\ncc dd.\n\nee ff"
    pieces = ["aa", " bb", ".\n\n", "cc", " dd", ".\n\n", "ee", " ff"]
    vocabulary = {piece: index for index, piece in enumerate(pieces)}
    offsets, cursor = [], 0
    for piece in pieces:
        offsets.append((cursor, cursor + len(piece)))
        cursor += len(piece)

    def encode(chunk: str) -> list[int]:  # greedy longest match over the pieces
        ids, at = [], 0
        while at < len(chunk):
            piece = max((p for p in vocabulary if chunk.startswith(p, at)), key=len)
            ids.append(vocabulary[piece])
            at += len(piece)
        return ids

    prompt = TokenizedPrompt(text, tuple(vocabulary[p] for p in pieces), tuple(offsets), frozenset(), ((0, len(text)),))
    found = discover(prompt, encode, DiscoverySettings(min_chunk_tokens=2, min_linked_tokens=2))
    assert found.chunks == ((0, 3), (3, 6)), "cut after each folded break; the last passage ends the prompt"


def test_the_quality_benchs_chat_prompts_find_the_dev_passages(tokenizer, shared_qa):
    """`picrag bench quality --prompt-form chat`: a dev question's documents as paragraphs of the
    user message are found as its passages, in order."""
    from rag_server.bench.chat_prompts import ChatPromptLayout
    from rag_server.bench.common import read_rows
    from retrieval.prompt_layout import passage_text

    row = read_rows(shared_qa / "hotpotqa.dev.jsonl", 1, None)[0]
    prompt = ChatPromptLayout(tokenizer).build(row.question, row.passages)
    text = tokenizer.decode(prompt.input_ids)
    found = [tokenizer.decode(prompt.input_ids[s:e]).strip() for s, e in prompt.chunks]
    documents = [passage_text(p).strip() for p in row.passages]
    assert len(found) >= 0.8 * len(documents)
    assert all(any(doc in chunk for doc in documents) for chunk in found)
    assert row.question in text and not any(row.question in chunk for chunk in found)


def test_the_question_is_the_last_paragraph_that_asks_or_stands_alone(tokenizer):
    """The prompt's last paragraph is its question when it asks or is its message's only one;
    a last paragraph that does neither (a document ending the message) is a passage."""
    rng = random.Random(5)
    docs = [document(rng, 60).rstrip(".!:?") + "." for _ in range(3)]
    closing = document(rng, 60).rstrip(".!:?")
    cases = {closing + ".": True,  # a fourth document: linked
             closing + "?": False, "Question: " + closing: False, "Query: " + closing + "\nAnswer:": False}
    for last, linked in cases.items():
        prompt = chat_prompt(tokenizer, [{"role": "user", "content": "\n\n".join([*docs, last])}])
        found = discover(prompt, encoder(tokenizer))
        assert len(found.chunks) == (4 if linked else 3), last
    # Documents in the system message, a long instruction alone in the user's: never linked.
    stuffed = chat_prompt(tokenizer, [{"role": "system", "content": "\n\n".join(docs)},
                                      {"role": "user", "content": closing + "."}])
    found = discover(stuffed, encoder(tokenizer))
    assert len(found.chunks) == 3 and all(stuffed.offsets[end - 1][1] < stuffed.text.index(closing)
                                          for _, end in found.chunks)
