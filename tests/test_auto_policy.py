"""The `auto` policy: the cheapest policy whose expected first-token KL for the prompt's size is
within the target, from a calibration table that shadow samples overrule; `full` otherwise."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from rag_server.cli import build_parser
from rag_server.service.auto_policy import (CALIBRATION_DIR, AutoPolicy, CalibrationError, CalibrationTable,
                                            shipped_table)
from rag_server.service.context_window import ContextLimits
from rag_server.service.first_token_quality import QualityRecord, Sample
from rag_server.service.quality import QualityControl, QualitySettings
from rag_server.linking.policy_resolver import NamedPolicy, PolicyResolver
from rag_server.service.rag_service import RagRequest, RagService
from rag_server.launch.repair_checkpoint import SHIPPED_DIR
from retrieval.passage import Passage

TABLE = CalibrationTable(
    model="test",
    cost_order=("naive", "legolink:2", "cacherepair", "legolink:16"),
    kl={"naive": {"<512": 0.1, ">=2048": 0.6},
        "legolink:2": {"<512": 0.15, "1024-2048": 0.3, ">=2048": 0.5},
        "cacherepair": {"1024-2048": 0.2, ">=2048": 0.4},
        "legolink:16": {"1024-2048": 0.12, ">=2048": 0.25}},
)


def test_target_zero_serves_full():
    for tokens in (100, 700, 1500, 5000):
        choice = AutoPolicy(0.0, TABLE).choose(tokens)
        assert choice.policy.name == "full"
        assert choice.reason.startswith("auto: full (no policy within target 0 for ")


def test_an_unbounded_target_serves_the_fastest_available_policy():
    auto = AutoPolicy(math.inf, TABLE)
    assert {auto.choose(tokens).policy.name for tokens in (100, 700, 1500, 5000)} == {"naive"}
    assert auto.choose(1500, {"naive": "refused"}).policy.name == "legolink:2"
    assert auto.choose(1500, {"naive": "x", "legolink": "no position masks"}).policy.name == "cacherepair"
    for model in ("smollm2-135m", "qwen2.5-coder-0.5b"):
        shipped = shipped_table(Path("/models") / model, SHIPPED_DIR / model)
        assert AutoPolicy(math.inf, shipped).choose(1500).policy.name == shipped.cost_order[0] == "naive"


def test_a_given_table_picks_as_specified():
    auto = AutoPolicy(0.2, TABLE)
    # <512: naive 0.1 qualifies at once.
    assert auto.choose(300).reason == "auto: naive (expected KL 0.100 <= target 0.2 for <512 tokens; calibration table)"
    # 512-1024 was not measured: each policy takes its nearest measured bucket (ties: the smaller).
    # naive 0.1 (<512) qualifies.
    assert auto.choose(700).policy.name == "naive"
    assert "nearest measured size <512" in auto.choose(700).reason
    # 1024-2048: naive takes >=2048 (0.6) and fails, legolink:2 0.3 fails, cacherepair 0.2 qualifies.
    choice = auto.choose(1500)
    assert choice.policy.name == "cacherepair"
    assert choice.reason == "auto: cacherepair (expected KL 0.200 <= target 0.2 for 1024-2048 tokens; calibration table)"
    # >=2048: nothing within 0.2; the lowest expected is named.
    choice = auto.choose(4000)
    assert choice.policy.name == "full"
    assert choice.reason == "auto: full (no policy within target 0.2 for >=2048 tokens; lowest expected: legolink:16 0.250)"
    assert AutoPolicy(0.3, TABLE).choose(4000).policy.name == "legolink:16"
    # A refused family is never picked, even when it would qualify.
    assert AutoPolicy(0.2, TABLE).choose(1500, {"cacherepair": "no checkpoint"}).policy.name == "legolink:16"


def test_shadow_samples_that_contradict_the_table_move_the_choice():
    record = QualityRecord()
    auto = AutoPolicy(0.2, TABLE, record, min_samples=3)
    assert auto.choose(300).policy.name == "naive"
    # Live traffic shows naive far worse than calibrated on short prompts: after min_samples of
    # them, the next policy within target serves.
    for _ in range(2):
        record.add(Sample("naive", 300, 0.9, False))
    assert auto.choose(300).policy.name == "naive"  # fewer than min_samples: the table still rules
    record.add(Sample("naive", 400, 0.9, False))
    choice = auto.choose(300)
    assert choice.policy.name == "legolink:2"
    assert choice.reason == "auto: legolink:2 (expected KL 0.150 <= target 0.2 for <512 tokens; calibration table)"
    # Samples of another bucket leave this one alone.
    assert auto.choose(700).policy.name == "naive"
    # And samples better than the table let a cheaper policy in.
    for _ in range(3):
        record.add(Sample("naive", 3000, 0.05, True))
    choice = auto.choose(3000)
    assert choice.policy.name == "naive"
    assert choice.reason == "auto: naive (expected KL 0.050 <= target 0.2 for >=2048 tokens; mean of 3 shadow samples)"


def test_shipped_tables_read_and_drop_repair_rows_without_their_checkpoint():
    for path in sorted(CALIBRATION_DIR.glob("*.json")):
        table = CalibrationTable.read(path)
        assert table.model == path.stem and table.repair_checkpoint == path.stem
        assert (SHIPPED_DIR / table.repair_checkpoint / "config.json").is_file()
        assert "cacherepair" in shipped_table(Path("/m") / path.stem, SHIPPED_DIR / path.stem).cost_order
        for other in (None, Path("/elsewhere") / path.stem):
            assert "cacherepair" not in shipped_table(Path("/m") / path.stem, other).cost_order
    assert shipped_table(Path("/m/unknown-model"), None) is None
    assert {p.stem for p in CALIBRATION_DIR.glob("*.json")} == {"smollm2-135m", "qwen2.5-coder-0.5b"}


def test_bad_tables_are_refused(tmp_path):
    with pytest.raises(CalibrationError, match="not written canonically"):
        CalibrationTable("m", ("legolink",), {"legolink": {"<512": 0.1}})
    with pytest.raises(CalibrationError, match="unknown buckets"):
        CalibrationTable("m", ("naive",), {"naive": {"<100": 0.1}})
    with pytest.raises(CalibrationError, match="no KL row"):
        CalibrationTable("m", ("naive",), {})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"model": "m", "cost_order": ["bogus"], "kl": {"bogus": {}}}))
    with pytest.raises(CalibrationError, match="unknown policy"):
        CalibrationTable.read(path)
    path.write_text(json.dumps(TABLE.as_json()))
    assert CalibrationTable.read(path) == TABLE


def test_auto_is_a_policy_name_at_every_edge():
    from rag_server.api.openai_chat import PicragExtension
    from rag_server.api.rag_api import RagQuery

    auto = NamedPolicy.parse("auto")
    assert auto.auto and auto.name == "auto" and auto.policy.name == "full"
    assert not NamedPolicy.parse("naive").auto
    assert RagQuery(question="q?", policy="auto").policy.auto
    assert PicragExtension(policy="auto").policy.auto
    assert build_parser().parse_args(["serve", "--default-policy", "auto"]).default_policy == "auto"
    args = build_parser().parse_args(["serve", "--quality-target", "0.25", "--shadow-rate", "0"])
    assert (args.quality_target, args.shadow_rate) == (0.25, 0.0)
    for bad in (["--quality-target", "-1"], ["--shadow-rate", "1.5"], ["--default-policy", "autox"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])


PASSAGES = [Passage("a", "A", "Alpha is the first letter. " * 5), Passage("b", "B", "Beta comes next.")]


def test_rag_service_serves_auto_with_the_chosen_policy_and_says_why(tokenizer, tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(TABLE.as_json()))

    def plan(target: float, unavailable=None):
        quality = QualityControl.open(QualitySettings(target=target, calibration=path), None, None)
        service = RagService(tokenizer, pipeline=None, limits=ContextLimits(8192, 8186), quality=quality,
                             policies=PolicyResolver.start(refusals=unavailable))
        return asyncio.run(service.plan(RagRequest("Which letter?", NamedPolicy.parse("auto"), 8, documents=PASSAGES)))

    short = plan(math.inf)
    assert len(short.prompt.input_ids) < 512
    assert short.request.policy.name == "naive" and not short.request.policy.auto
    assert short.policy_reason.startswith("auto: naive (expected KL 0.100 <= target inf for <512 tokens")
    zero = plan(0.0)
    assert zero.request.policy.name == "full" and zero.request.policy.family.name == "full"
    assert zero.policy_reason.startswith("auto: full (no policy within target 0")
    assert plan(0.11, {"naive": "refused"}).request.policy.name == "full"
    assert plan(0.12, {"naive": "refused"}).request.policy.name == "legolink:16"
    named = asyncio.run(RagService(tokenizer, None, ContextLimits(8192, 8186)).plan(
        RagRequest("Which letter?", NamedPolicy.parse("legolink:4"), 8, documents=PASSAGES)))
    assert named.request.policy.name == "legolink:4" and named.policy_reason is None


def test_bench_quality_writes_a_calibration_table(tmp_path):
    from rag_server.bench.quality import QuestionResult, calibration_table, summarise

    def result(policy, prompt_tokens, kl, ttft):
        return QuestionResult(id=str(prompt_tokens), policy=policy, answer="", em=0.0, f1=0.0, agrees_with_full=False,
                              first_token_kl=kl, ttft_s=ttft, prompt_tokens=prompt_tokens, reused_tokens=0,
                              computed_tokens=0, chunk_hits=0, chunk_misses=0)

    results = []
    for tokens in (300, 1500, 1700):
        results += [result("full", tokens, 0.0, 4.0), result("prefix", tokens, 0.0, 3.0),
                    result("legolink", tokens, 0.2 if tokens < 512 else 0.4, 1.0),
                    result("naive", tokens, 0.5, 0.5), result("cacherepair", tokens, 0.3, 0.8)]
    summary = summarise(results, ["full", "prefix", "legolink", "naive", "cacherepair"])
    table = calibration_table([(results, summary)], "smollm2-135m", "a test run", min_questions=1)
    # Chunk-reusing policies only, fastest first, canonical names, KL per measured bucket.
    assert table.cost_order == ("naive", "cacherepair", "legolink:16")
    assert table.kl == {"naive": {"<512": 0.5, "1024-2048": 0.5}, "cacherepair": {"<512": 0.3, "1024-2048": 0.3},
                        "legolink:16": {"<512": 0.2, "1024-2048": 0.4}}
    assert table.repair_checkpoint == "smollm2-135m"
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table.as_json()))
    auto = AutoPolicy(0.35, CalibrationTable.read(path))
    assert auto.choose(1600).policy.name == "cacherepair" and auto.choose(200).policy.name == "cacherepair"
    assert AutoPolicy(0.25, CalibrationTable.read(path)).choose(200).policy.name == "legolink:16"
    assert calibration_table([(results, summary)], "unknown-model", "x", min_questions=1).repair_checkpoint is None
    # By default a bucket needs 5 questions: legolink's one short prompt says nothing of short
    # prompts, so auto reads its 1024-2048 mean there; with no bucket left, a policy is left out.
    results += [result("legolink", 1100 + tokens, 0.4, 1.0) for tokens in range(3)]
    results += [result("naive", 1100 + tokens, 0.5, 0.5) for tokens in range(3)]
    thin = calibration_table([(results, summarise(results, ["full", "naive", "legolink"]))], "x", "y")
    assert thin.kl == {"naive": {"1024-2048": 0.5}, "legolink:16": {"1024-2048": 0.4}}
    assert thin.table_kl("legolink:16", "<512") == (0.4, "1024-2048")
    assert calibration_table([(results[:15], summary)], "x", "y").cost_order == ()


def _stored_run(folder, model, kl_method, rows, dataset="hotpotqa.dev.jsonl", ids=None):
    """A results.json as `bench quality` writes it: rows are (policy, prompt tokens, KL, TTFT);
    a row's question id is its prompt size unless `ids` names them."""
    from dataclasses import asdict

    from rag_server.bench.quality import QuestionResult, summarise

    results = [QuestionResult(id=ids[i] if ids else str(tokens), policy=policy, answer="", em=0.0, f1=0.0,
                              agrees_with_full=False, first_token_kl=kl, ttft_s=ttft, prompt_tokens=tokens,
                              reused_tokens=0, computed_tokens=0, chunk_hits=0, chunk_misses=0)
               for i, (policy, tokens, kl, ttft) in enumerate(rows)]
    policies = list(dict.fromkeys(r.policy for r in results))
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({
        "model": f"/models/{model}", "dataset": f"../data/{dataset}", "settings": {"distractors": "dataset"},
        "method": {"first_token_kl": kl_method},
        "policies": summarise(results, policies), "per_question": [asdict(r) for r in results]}))
    return folder


def test_bench_calibrate_pools_stored_runs_of_one_model(tmp_path, capsys):
    from rag_server.cli import main

    short = _stored_run(tmp_path / "short", "smollm2-135m", "exact", [
        ("full", 1200, 0.0, 4.0), ("naive", 1200, 0.6, 0.5), ("legolink", 1200, 0.4, 1.0),
        ("full", 1300, 0.0, 4.0), ("naive", 1300, 0.8, 0.5), ("legolink", 1300, 0.2, 1.0)])
    long = _stored_run(tmp_path / "long", "smollm2-135m", "exact", [
        ("full", 1900, 0.0, 9.0), ("naive", 1900, 1.0, 0.5), ("legolink:16", 1900, 0.5, 1.5),
        ("full", 2500, 0.0, 9.0), ("naive", 2500, 0.4, 0.5), ("legolink:16", 2500, 0.3, 1.5)])
    out = tmp_path / "table.json"
    assert main(["bench", "calibrate", str(short), str(long / "results.json"), "--min-questions", "1",
                 "--out", str(out)]) == 0
    table = CalibrationTable.read(out)
    # Every question of both runs lands in its own size bucket; `legolink` and `legolink:16` pool.
    assert table.cost_order == ("naive", "legolink:16") and table.model == "smollm2-135m"
    assert table.kl == {"naive": {"1024-2048": 0.8, ">=2048": 0.4}, "legolink:16": {"1024-2048": 0.3667, ">=2048": 0.3}}
    assert "short: 2 questions; long: 2 questions" in table.source
    assert AutoPolicy(0.35, table).choose(2400).policy.name == "legolink:16"

    bound = _stored_run(tmp_path / "bound", "smollm2-135m", "top-20 bound", [("full", 1200, 0.0, 4.0),
                                                                            ("naive", 1200, 0.5, 0.5)])
    other = _stored_run(tmp_path / "other", "qwen2.5-coder-0.5b", "exact", [("full", 1200, 0.0, 4.0),
                                                                           ("naive", 1200, 0.5, 0.5)])
    capsys.readouterr()
    assert main(["bench", "calibrate", str(short), str(bound)]) == 1
    assert "measured the first-token KL differently" in capsys.readouterr().err
    assert main(["bench", "calibrate", str(short), str(other)]) == 1
    assert "different models (qwen2.5-coder-0.5b, smollm2-135m)" in capsys.readouterr().err
    assert main(["bench", "calibrate", str(tmp_path / "missing")]) == 1
    assert "is not a `picrag bench quality` results file" in capsys.readouterr().err
    report = json.loads((short / "results.json").read_text())
    (short / "results.json").write_text(json.dumps({**report, "settings": {"passage_bos": True}}))
    assert main(["bench", "calibrate", str(short), str(long)]) == 1
    assert "a --passage-bos run is not the layout the frontend serves" in capsys.readouterr().err


def test_speed_order_takes_out_each_runs_prompt_length():
    from rag_server.bench.quality import speed_order

    # legolink:2 ran only on the long prompts, where every policy is faster: its 10x there is
    # slower than naive's 15x, though faster than naive's 8x on the short ones.
    short, long = {"naive": 8.0, "cacherepair": 4.0}, {"naive": 15.0, "legolink:2": 10.0, "cacherepair": 7.0}
    assert speed_order([short, long]) == ["naive", "legolink:2", "cacherepair"]
    assert speed_order([long]) == ["naive", "legolink:2", "cacherepair"]
    assert speed_order([{"cacherepair": 4.0, "naive": 8.0}]) == ["naive", "cacherepair"]


def test_auto_never_picks_a_policy_the_self_check_refuses(tokenizer, tmp_path):
    from rag_server.linking.reuse_gate import FAILED, Check, ReuseGate, SelfCheckReport

    gate = ReuseGate(SelfCheckReport((Check("rotation", FAILED, "keys differ"),), 0.1), "prefix")
    refused = PolicyResolver.start(refusals={"cacheblend": "no masks"}, gate=gate).auto_excluded
    assert refused["cacheblend"] == "no masks" and refused["naive"].startswith("the start-up self-check failed")
    assert "full" not in refused and "prefix" not in refused
    assert PolicyResolver.start(refusals={"cacheblend": "no masks"}).auto_excluded == {"cacheblend": "no masks"}
    assert AutoPolicy(math.inf, TABLE).choose(300, refused).policy.name == "full"

    path = tmp_path / "table.json"
    path.write_text(json.dumps(TABLE.as_json()))
    quality = QualityControl.open(QualitySettings(target=math.inf, calibration=path), None, None)
    service = RagService(tokenizer, pipeline=None, limits=ContextLimits(8192, 8186), quality=quality,
                         policies=PolicyResolver.start(gate=gate))
    plan = asyncio.run(service.plan(RagRequest("Which letter?", NamedPolicy.parse("auto"), 8, documents=PASSAGES)))
    # full, chosen by auto itself: not a reuse policy the gate then serves as something else.
    assert plan.request.policy.name == "full" and plan.warnings == []
    assert plan.policy_reason.startswith("auto: full (no policy within target inf")


def test_bench_calibrate_refuses_runs_repaired_with_another_checkpoint(tmp_path, capsys):
    from rag_server.cli import main
    from picrag_core.file_digest import file_sha256

    rows = [("full", 1200, 0.0, 4.0), ("naive", 1200, 0.6, 0.5), ("cacherepair", 1200, 0.2, 0.7)]
    shipped_digest = file_sha256(SHIPPED_DIR / "smollm2-135m" / "weights.safetensors")
    for name, digest in (("shipped", shipped_digest), ("trial", "0" * 64)):
        run = _stored_run(tmp_path / name, "smollm2-135m", "exact", rows)
        report = json.loads((run / "results.json").read_text())
        record = {"path": f"/ckpt/{name}", "weights_sha256": digest, "width": 128, "blocks": 4, "training_steps": 9}
        (run / "results.json").write_text(json.dumps({**report, "repair_checkpoint": record}))
    capsys.readouterr()
    assert main(["bench", "calibrate", str(tmp_path / "shipped"), "--min-questions", "1",
                 "--out", str(tmp_path / "t.json")]) == 0
    assert main(["bench", "calibrate", str(tmp_path / "shipped"), str(tmp_path / "trial")]) == 1
    err = capsys.readouterr().err
    assert "trial" in err and "/ckpt/trial" in err and "other than the one shipped for smollm2-135m" in err
    assert "/ckpt/shipped" not in err


def test_bench_quality_refuses_a_repair_checkpoint_it_would_not_serve(tmp_path, capsys):
    from rag_server.bench.common import BenchError
    from rag_server.bench.quality import QualityOptions, run_quality
    from rag_server.cli import main

    with pytest.raises(BenchError, match="the one at --url serves its own"):
        run_quality(QualityOptions(dataset=tmp_path / "none.jsonl", policies="cacherepair", out=tmp_path / "out",
                                   url="http://127.0.0.1:9", repair_checkpoint=tmp_path / "ckpt"), progress=False)
    assert not (tmp_path / "out").exists()
    capsys.readouterr()
    assert main(["bench", "quality", "--dataset", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "out"),
                 "--repair-checkpoint", str(tmp_path / "ckpt"), "--write-calibration", str(tmp_path / "t.json")]) == 1
    assert "describes the shipped checkpoint" in capsys.readouterr().err


def test_bench_calibrate_counts_a_question_measured_twice_once(tmp_path):
    from rag_server.bench.quality import calibration_from_runs, read_run

    first = _stored_run(tmp_path / "first", "smollm2-135m", "exact",
                        [("full", 1200, 0.0, 4.0), ("naive", 1200, 0.2, 0.5)], ids=["q1", "q1"])
    other_set = _stored_run(tmp_path / "other", "smollm2-135m", "exact",
                            [("full", 1200, 0.0, 4.0), ("naive", 1200, 0.8, 0.5)], dataset="2wiki.dev.jsonl",
                            ids=["q1", "q1"])
    # The first run's question again, for a policy it did not have: naive's q1 must not count twice.
    again = _stored_run(tmp_path / "again", "smollm2-135m", "exact",
                        [("full", 1200, 0.0, 4.0), ("naive", 1200, 0.2, 0.5), ("cacherepair", 1200, 0.1, 0.7)],
                        ids=["q1", "q1", "q1"])
    table = calibration_from_runs([read_run(run) for run in (first, other_set, again)], min_questions=1)
    assert table.kl["naive"] == {"1024-2048": 0.5} and table.kl["cacherepair"] == {"1024-2048": 0.1}


def test_bench_frontier_plots_each_policy_from_its_latest_run_per_set(tmp_path, capsys):
    from rag_server.cli import main

    old = _stored_run(tmp_path / "old", "smollm2-135m", "exact",
                      [("full", 1200, 0.0, 4.0), ("naive", 1200, 0.6, 0.5), ("legolink:16", 1200, 0.4, 1.0)])
    new = _stored_run(tmp_path / "new", "smollm2-135m", "exact",
                      [("full", 1200, 0.0, 4.0), ("legolink:16", 1200, 0.3, 2.0)])
    other_set = _stored_run(tmp_path / "wiki", "smollm2-135m", "exact",
                            [("full", 900, 0.0, 3.0), ("naive", 900, 0.9, 0.5)], dataset="2wiki.dev.jsonl")
    out = tmp_path / "plots" / "frontier.png"
    assert main(["bench", "frontier", str(old), str(new), str(other_set), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # One row per (set, policy): legolink:16 from the newer run, naive kept from the older one.
    assert lines == ["2wiki.dev\tnaive\t6.0x\tKL 0.900\twiki",
                     "hotpotqa.dev\tnaive\t8.0x\tKL 0.600\told",
                     "hotpotqa.dev\tlegolink:16\t2.0x\tKL 0.300\tnew"]
    assert out.read_bytes().startswith(b"\x89PNG")

    qwen = _stored_run(tmp_path / "qwen", "qwen2.5-coder-0.5b", "exact", [("full", 1200, 0.0, 4.0),
                                                                          ("naive", 1200, 0.5, 0.5)])
    assert main(["bench", "frontier", str(old), str(qwen), "--out", str(out)]) == 1
    assert "a plot is one reader's" in capsys.readouterr().err
