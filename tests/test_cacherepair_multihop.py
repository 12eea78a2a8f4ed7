"""Serving-shaped CacheRepair groups from the multi-hop training files: each row its own group,
variants that shuffle and subset it, several files mixed with NQ groups, chunk files keyed by
passage identity (`cache_repair.row_groups`, `data_mix`, `serving_plan`, `serving_pairs`)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from cache_repair.cli import register
from cache_repair.data_mix import DataSpec, fractions, plan_mix, read_source
from cache_repair.row_groups import allocate
from cache_repair.groups import GroupsError, GroupShape
from cache_repair.pairs import Pair, PairMaker, chunk_name, shard_paths
from cache_repair.row_groups import RowVariants
from cache_repair.serving_pairs import generate_serving_pairs
from cache_repair.serving_plan import chunk_key
from tests.tiny_models import make_tiny_model

torch.set_num_threads(1)

MULTI_HOP = ("hotpotqa", "2wikimultihopqa", "musique")
NQ_SHAPE = GroupShape(min_passages=3, max_passages=5, max_tokens=40, min_tokens=12, reuse=2)


@pytest.fixture(scope="module")
def sources(shared_qa):
    return [read_source(DataSpec(shared_qa / f"{name}.train.jsonl")) for name in MULTI_HOP]


@pytest.fixture(scope="module")
def plan(sources):
    return plan_mix(sources, None, 32, GroupShape(), RowVariants(), seed=0, nq_groups=150)


def row_of(sources, group):
    return sources[group.data].rows[group.row]


def passages_of(sources, plan, group):
    return [plan.passage([s.rows for s in sources], key) for key in group.chunks]


# --- the plan ----------------------------------------------------------------------------

def test_groups_keep_their_rows_passages_and_subsets_keep_the_supporting_ones(sources, plan):
    by_row: dict[tuple[int, int], list[tuple]] = {}
    for group in plan.groups["train"]:
        row, passages = row_of(sources, group), passages_of(sources, plan, group)
        assert not Counter(passages) - Counter(row.passages)  # a 2Wiki row may hold a passage twice
        if len(passages) < len(row.passages):  # a subset: every supporting passage stays
            assert set(row.supporting_passages) <= set(passages) and row.supporting_passages
        by_row.setdefault((group.data, group.row), []).append(tuple(passages))
    # Variants: the row as given first, then orders no earlier variant of the row had.
    for (data, row), variants in by_row.items():
        assert variants[0] == sources[data].rows[row].passages
        assert len(set(variants)) == len(variants) == 3  # no --groups: every training row, every variant
    # Subsets happen, at many sizes; every file contributes in proportion to its rows.
    sizes = Counter(len(g.chunks) for g in plan.groups["train"])
    assert len(sizes) > 10 and sizes[10] > 0 and sizes[20] > 0
    per_file = Counter(g.data for g in plan.groups["train"])
    assert per_file[1] > per_file[2] > per_file[0] > 250
    # Validation: whole rows in the dataset's order, as the dev benchmarks serve them.
    for group in plan.groups["val"]:
        assert tuple(passages_of(sources, plan, group)) == row_of(sources, group).passages


def test_validation_shares_no_row_or_passage_with_training(sources, plan, shared_qa):
    rows = {split: {(g.data, g.row) for g in plan.groups[split]} for split in ("train", "val")}
    texts = {split: {p.text for g in plan.groups[split] for p in passages_of(sources, plan, g)}
             for split in ("train", "val")}
    assert len(plan.groups["val"]) == 32 and not rows["train"] & rows["val"] and not texts["train"] & texts["val"]
    # 2Wiki's rows share passages: validation rows are drawn where that costs the fewest training rows.
    assert len({r for d, r in rows["train"] if d == 1}) > 450
    dev = {json.loads(line)["question"] for path in shared_qa.glob("*.dev.jsonl") for line in path.open()}
    assert not {row_of(sources, g).question for split in plan.groups for g in plan.groups[split]} & dev


def test_validation_asks_each_sets_question_types_in_their_proportions(sources, plan):
    """Stratified by set and by the dataset's question type (within one validation group of each
    type's share of the set's rows), not drawn where passages are least shared alone (which made
    half of a 16-group validation yes/no comparisons)."""
    for d, source in enumerate(sources):
        held = Counter(row_of(sources, g).kind for g in plan.groups["val"] if g.data == d)
        kinds = Counter(row.kind for row in source.rows)
        assert "" not in kinds and len(kinds) >= 2, kinds  # every multi-hop row has a type
        for kind, rows in kinds.items():
            assert abs(held[kind] - sum(held.values()) * rows / len(source.rows)) < 1, (d, held, kinds)


def test_a_passage_that_recurs_is_one_chunk(sources, plan):
    holders = Counter(p for row in sources[1].rows for p in set(row.passages))
    recurring = next(p for p, count in holders.items() if count > 5)
    key = chunk_key(recurring, None)
    assert key in plan.chunks
    assert sum(key in g.chunks for g in plan.groups["train"]) > 5
    assert chunk_key(recurring, 40) != key  # another cap, other tokens: another chunk


def test_the_plan_is_seeded(sources, plan):
    assert plan_mix(sources, None, 32, GroupShape(), RowVariants(), 0, 150).to_dict() == plan.to_dict()
    assert plan_mix(sources, None, 32, GroupShape(), RowVariants(), 1, 150).to_dict() != plan.to_dict()


def test_shares_mix_nq_groups_in(sources, shared_qa):
    nq = read_source(DataSpec.parse(f"{shared_qa / 'nq_open_oracle.train.jsonl'}:0.25"))
    assert not nq.multi_hop and nq.spec.share == 0.25
    mix = plan_mix([sources[0], nq], None, 8, NQ_SHAPE, RowVariants(variants=2), 0, 150)
    per_file = Counter(g.data for g in mix.groups["train"])
    # HotpotQA's rows decide the size: all of them twice are 3/4 of the groups.
    assert per_file[0] == 2 * (99 - 6) and per_file[1] == round(per_file[0] / 3)
    assert Counter(g.data for g in mix.groups["val"]) == {0: 6, 1: 2}
    assert all(mix.chunks[key].cap is not None for g in mix.groups["train"] if g.data == 1 for key in g.chunks)


def test_shares_counts_and_their_refusals(sources, shared_qa):
    assert allocate(10, [0.5, 0.25, 0.25]) == [5, 3, 2] and sum(allocate(7, [1 / 3] * 3)) == 7
    assert fractions(sources[:2], [99, 500]) == pytest.approx([99 / 599, 500 / 599])
    halves = [read_source(DataSpec(s.spec.path, 0.5)) for s in sources[:2]]
    assert fractions(halves, [99, 500]) == [0.5, 0.5]
    with pytest.raises(GroupsError, match="sum to 1.5"):
        fractions(halves + [read_source(DataSpec(sources[2].spec.path, 0.5))], [1, 1, 1])
    with pytest.raises(GroupsError, match="hotpotqa.train.jsonl: .* at most"):
        plan_mix(sources[:1], 1000, 4, GroupShape(), RowVariants(variants=2), 0, 150)
    with pytest.raises(GroupsError, match=r"\(0, 1\]"):
        DataSpec.parse("rows.jsonl:1.5")
    assert DataSpec.parse("c:/rows.jsonl") == DataSpec(Path("c:/rows.jsonl"))
    with pytest.raises(GroupsError, match="evaluation split"):
        read_source(DataSpec(shared_qa / "musique.dev.jsonl"))


def test_the_command_refuses_dev_files_before_loading_a_model(shared_qa, default_model_dir, tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["repair", "pairs", "--out", str(tmp_path / "p"), "--model", str(default_model_dir),
                              "--data", str(shared_qa / "hotpotqa.train.jsonl"),
                              "--data", str(shared_qa / "hotpotqa.dev.jsonl")])
    assert args.func(args) == 1
    assert "evaluation split" in capsys.readouterr().err and not (tmp_path / "p").exists()


# --- pairs on a tiny model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model_dir(default_model_dir, tmp_path_factory):
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), default_model_dir)


@pytest.fixture(scope="module")
def maker(tiny_model_dir):
    return PairMaker(tiny_model_dir)


@pytest.fixture(scope="module")
def mini_file(shared_qa, tmp_path_factory):
    """Five HotpotQA training rows cut to 4 short passages (2 supporting); rows 0 and 1 share one."""
    rows = [json.loads(line) for line in (shared_qa / "hotpotqa.train.jsonl").open()][:5]
    for row in rows:
        passages = sorted(row["passages"], key=lambda p: not p["is_supporting"])[:4]
        row["passages"] = [{**p, "text": " ".join(p["text"].split()[:12])} for p in passages]
    rows[1]["passages"][3] = rows[0]["passages"][3]
    path = tmp_path_factory.mktemp("qa") / "mini.train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def pairs(maker, tiny_model_dir, mini_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("pairs") / "multihop"
    manifest = generate_serving_pairs(out, tiny_model_dir, groups=6, val_groups=1, seed=2, shape=GroupShape(),
                                      max_disk_gb=1.0, data=[DataSpec(mini_file)], maker=maker,
                                      variants=RowVariants(variants=2))
    return out, manifest


def test_a_shards_stale_kv_is_each_passage_prefilled_alone(pairs, maker, mini_file):
    out, manifest = pairs
    from retrieval.qa_rows import read_qa_rows

    rows = read_qa_rows(mini_file)
    passages = {p for row in rows for p in row.passages}
    # One chunk file per distinct passage: the shared one is stored once.
    assert len(list((out / "chunks").iterdir())) == len(manifest["chunks"]) == len(passages) == 19
    for split in ("train", "val"):
        for path, group in zip(shard_paths(out, split), manifest["groups"][split]):
            pair = Pair.load(path)
            start = 0
            for key in group["chunks"]:
                _, row, index, cap = manifest["chunks"][key]
                assert cap is None
                ids = maker.layout.passage_ids(rows[row].passages[index])
                keys, values, _ = maker.prefill(ids, 0, len(ids))
                end = start + len(ids)
                assert pair.token_ids[start:end].tolist() == ids
                assert torch.equal(pair.stale_k[start:end], keys.half().float())
                assert torch.equal(pair.stale_v[start:end], values.half().float())
                start = end
            assert start == pair.tokens
            assert pair.question_ids.tolist() == maker.layout.question_ids(rows[group["row"]].question)


def test_resume_computes_only_the_missing_shard(pairs, maker, tiny_model_dir, mini_file, monkeypatch):
    out, manifest = pairs
    shard = out / "train" / "00002.safetensors"
    before = Pair.load(shard)
    shard.unlink()
    prefills = []
    original = maker.prefill
    monkeypatch.setattr(maker, "prefill", lambda ids, *a, **k: prefills.append(len(ids)) or original(ids, *a, **k))
    again = generate_serving_pairs(out, tiny_model_dir, groups=6, val_groups=1, seed=2, shape=GroupShape(),
                                   max_disk_gb=1.0, data=[DataSpec(mini_file)], maker=maker,
                                   variants=RowVariants(variants=2))
    assert len(prefills) == 1 and again["groups"] == manifest["groups"]
    after = Pair.load(shard)
    for name in ("stale_k", "target_k", "target_v", "teacher_logits", "token_ids"):
        assert torch.equal(getattr(after, name), getattr(before, name)), name
    assert all((out / chunk_name(key)).is_file() for key in manifest["chunks"])


def test_pairs_in_both_forms_give_found_groups_the_found_tokens(maker, tiny_model_dir, mini_file, tmp_path):
    """`--passage-form both`: alternate groups hold their passages as the frontend finds them in
    a message, stale and joint prefills alike, and the manifest records the form."""
    from cache_repair.passage_forms import FOUND, found_ids, group_form
    from retrieval.qa_rows import read_qa_rows

    out = tmp_path / "both"
    manifest = generate_serving_pairs(out, tiny_model_dir, groups=4, val_groups=1, seed=2, shape=GroupShape(),
                                      max_disk_gb=1.0, data=[DataSpec(mini_file)], maker=maker,
                                      variants=RowVariants(variants=2), passage_form="both")
    rows = read_qa_rows(mini_file)
    assert manifest["passage_form"] == "both"
    for index, (path, group) in enumerate(zip(shard_paths(out, "train"), manifest["groups"]["train"])):
        pair = Pair.load(path)
        expected = []
        for key in group["chunks"]:
            _, row, passage, _, *form = manifest["chunks"][key]
            ids_of = maker.layout.passage_ids if not form else lambda p: found_ids(maker.layout, p)
            assert form == ([FOUND] if group_form("both", index) == FOUND else [])
            expected += ids_of(rows[row].passages[passage])
        assert pair.token_ids.tolist() == expected
