"""Repair training in the form the frontend finds passages (`cache_repair.passage_forms`): a
found passage's tokens are exactly what discovery finds in a chat, and a pairs plan in `both`
forms gives alternate groups chunks of their own."""

from __future__ import annotations

import pytest

from cache_repair.data_mix import DataSpec, plan_mix, read_source
from cache_repair.groups import GroupShape
from cache_repair.passage_forms import ALONE, FOUND, found_ids, group_form
from cache_repair.row_groups import RowVariants
from cache_repair.serving_plan import chunk_key
from retrieval.prompt_layout import PromptLayout


def test_a_found_passage_has_the_ids_discovery_finds_in_a_chat(tokenizer, shared_qa):
    """The training form and the serving form are one: for dev questions sent as a chat app
    sends them, every passage found whole has `found_ids`' tokens, none the annotated layout's
    (on SmolLM2 a blank line before a word is two "\\n", at the end of a text one "\\n\\n")."""
    from rag_server.bench.chat_prompts import ChatPromptLayout
    from rag_server.bench.common import read_rows

    layout, chats = PromptLayout(tokenizer), ChatPromptLayout(tokenizer)
    matched = whole = 0
    for row in read_rows(shared_qa / "hotpotqa.dev.jsonl", 5, None):
        prompt = chats.build(row.question, row.passages)
        found = {tuple(prompt.input_ids[start:end]) for start, end in prompt.chunks}
        for passage in row.passages:
            if "\n" in passage.text.strip():  # a paragraph break inside: found as two passages
                continue
            whole += 1
            matched += tuple(found_ids(layout, passage)) in found
            assert tuple(layout.passage_ids(passage)) not in found
    assert whole >= 40 and matched >= 0.9 * whole, (matched, whole)
    blank_line = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    assert len(blank_line) == 1 and found_ids(layout, row.passages[0])[-1] != blank_line[0]


def test_both_forms_alternate_groups_and_key_found_chunks_apart(shared_qa):
    source = read_source(DataSpec(shared_qa / "hotpotqa.train.jsonl"))
    plan = plan_mix([source], 12, 4, GroupShape(), RowVariants(variants=1), seed=0, nq_groups=150)
    both = plan.in_form("both")
    assert plan.in_form(ALONE).to_dict() == plan.to_dict()
    for split in ("train", "val"):
        for index, (group, formed) in enumerate(zip(plan.groups[split], both.groups[split])):
            assert (formed.data, formed.row) == (group.data, group.row)
            if group_form("both", index) == ALONE:
                assert formed.chunks == group.chunks
                continue
            for key, found in zip(group.chunks, formed.chunks):
                passage = plan.passage([source.rows], key)
                assert found == chunk_key(passage, None, FOUND) != key
                assert both.chunks[found].form == FOUND and both.passage([source.rows], found) == passage
    # Only the chunks some group reads are prefilled; the manifest names a found chunk's form.
    used = {key for split in both.groups for group in both.groups[split] for key in group.chunks}
    assert set(both.chunks) == used
    listed = both.to_dict()["chunks"]
    assert all((entry[-1] == FOUND) == key.endswith(f"-{FOUND}") for key, entry in listed.items())
    assert all(len(entry) == 4 for entry in plan.to_dict()["chunks"].values())  # earlier manifests unchanged
    with pytest.raises(ValueError, match="passage form"):
        plan.in_form("trailing")
