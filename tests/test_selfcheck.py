"""The start-up self-check: the engine's re-rotation check on real rotary embeddings, the
frontend's forward checks against a fake runtime that answers as told, what a failed check does
to requests, and the shared server reporting its passed checks in /health."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx
import pytest
import torch

from rag_server.launch.selfcheck import NEW_TOKENS, TOLERANCES, difference, self_check
from rag_server.linking.policy_resolver import NamedPolicy, PolicyResolver
from rag_server.linking.reuse_gate import FAILED, PASSED, SKIPPED, Check, ReuseGate, SelfCheckReport
from picrag_core.link_hints import LinkRequest, parse_link_request
from picrag_core.policies import PolicyError
from picrag_core.rope_shift import KeyShifter
from sglang_patches.selfcheck import SERVER_INFO_KEY, check_rope_shift, rope_shifter


def rope(base: float = 100000, neox: bool = True, scaling: dict | None = None, max_position: int = 8192):
    from sglang.srt.layers.rotary_embedding import get_rope

    return get_rope(head_size=64, rotary_dim=64, max_position=max_position, base=base, is_neox_style=neox,
                    rope_scaling=scaling, dtype=torch.float32)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 2048}


# ---- the engine's re-rotation check -----------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_rope_check_passes_where_the_shifter_is_the_models_rotation(kv_dtype, scaling):
    embedding = rope(scaling=scaling)
    check = check_rope_shift(embedding, KeyShifter.from_rotary_embedding(embedding), kv_dtype)
    assert check.passed, check.detail
    assert "1, 37, 1000, 4000 positions" in check.detail
    assert check.dtype == str(kv_dtype).removeprefix("torch.")


@pytest.mark.parametrize("model_rope, shifter_rope", [
    (rope(), rope(base=10000)),  # another base
    (rope(), rope(neox=False)),  # pairs interleaved, not halves
    (rope(scaling=LLAMA3), rope()),  # a scaling the shifter does not apply
])
def test_rope_check_fails_on_a_rotation_the_shifter_does_not_describe(model_rope, shifter_rope):
    check = check_rope_shift(model_rope, KeyShifter.from_rotary_embedding(shifter_rope), torch.float32)
    assert not check.passed
    assert "re-rotated by 1 differ from keys computed at 1" in check.detail


def test_yarn_passes_and_an_embedding_whose_magnitude_varies_fails():
    # YaRN scales its whole table by one constant (mscale), which re-rotation divides out.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    shifter, check = rope_shifter(torch.nn.Sequential(rope(scaling=yarn)), torch.float32)
    assert shifter is not None and check.passed, check.detail
    varying = rope(base=12345)
    varying.cos_sin_cache = varying.cos_sin_cache * torch.linspace(1.0, 1.5, varying.cos_sin_cache.shape[0])[:, None]
    shifter, check = rope_shifter(torch.nn.Sequential(varying), torch.float32)
    assert shifter is None and not check.passed
    assert "cannot be re-rotated" in check.detail and "scales magnitudes" in check.detail


class PositionlessRope(torch.nn.Module):
    """A rotary embedding with a table, whose forward does not take one position per token."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.cos_sin_cache, self.is_neox_style = inner.cos_sin_cache, True
        self.head_size, self.rotary_dim = inner.head_size, inner.rotary_dim

    def forward(self, positions, query, key):
        if positions.ndim != 2:
            raise ValueError("positions must be [3, tokens]")
        return self.inner(positions[0], query, key)


def test_rope_check_fails_on_an_embedding_that_refuses_plain_positions():
    shifter, check = rope_shifter(torch.nn.Sequential(PositionlessRope(rope())), torch.float32)
    assert shifter is not None and not check.passed
    assert "PositionlessRope" in check.detail and "positions must be [3, tokens]" in check.detail


def test_the_check_reaches_server_info_through_the_internal_state_hook():
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController

    from sglang_patches.selfcheck import HOOK_TARGET, ROPE_CHECK_ATTR, RopeCheck, add_rope_check

    assert HOOK_TARGET.endswith(SchedulerInternalStateController.get_internal_state.__qualname__)
    check = RopeCheck(False, "why", "float32")
    controller = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=SimpleNamespace(**{ROPE_CHECK_ATTR: check})))
    result = SimpleNamespace(internal_state={"world_size": 1})
    assert add_rope_check(result, controller, None).internal_state == {
        "world_size": 1, SERVER_INFO_KEY: {"passed": False, "detail": "why", "dtype": "float32"}}


# ---- the frontend's forward checks, against a fake runtime -------------------------------------

@dataclass
class FakeRuntime:
    """Answers /generate by policy: every answer the same greedy tokens and first-token top
    logprobs, shifted by `skew[policy]`; reuse counts follow the link as the engine counts them,
    unless `reused` says otherwise."""

    rope: dict | None = field(default_factory=lambda: {"passed": True, "detail": "ok", "dtype": "float32"})
    skew: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    reused: int | None = None  # chunk hits reported for naive (None: what the link asks)
    flat: bool = False  # every answer's first-token top logprobs equal (a model computing zeros)
    calls: list[str] = field(default_factory=list)  # policy of each /generate: compile, vanilla, naive, ...

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"internal_states": [{SERVER_INFO_KEY: self.rope} if self.rope else {}]})
        if request.url.path == "/flush_cache":
            return httpx.Response(200, json={"success": True})
        body = json.loads(request.content)
        link = parse_link_request(body.get("kv_hints"))
        policy = "vanilla" if link is None else "compile" if link.compile else link.policy
        self.calls.append(policy)
        if policy == "compile":
            return httpx.Response(200, json=[{"text": "", "meta_info": {}}])
        ids = body["input_ids"]
        skew = self.skew.get(policy, 0.0)
        top = [[-0.1 + skew, 11, "a"], [-2.5, 12, "b"], [-3.0, 13, "c"]]
        if self.flat:
            top = [[-10.8, token, piece] for _, token, piece in top]
        details = {}
        if link is not None:
            head = link.chunks[0][0]
            computed = len(ids) - head if policy == "legolink" else len(ids) - link.chunks[-1][1]
            details = {"picrag_policy": policy, "picrag_chunk_misses": 0,
                       "picrag_chunk_hits": len(link.chunks) if self.reused is None else self.reused,
                       "picrag_reused_tokens": len(ids) - computed, "picrag_computed_tokens": computed}
        return httpx.Response(200, json={
            "output_ids": self.tokens.get(policy, [11, 5, 6, 7]),
            "meta_info": {"cached_tokens": len(ids) - 1, "cached_tokens_details": details,
                          "output_top_logprobs": [top] + [[]] * (NEW_TOKENS - 1)},
        })


def check_against(fake: FakeRuntime, layout, unavailable=None) -> SelfCheckReport:
    async def run():
        async with httpx.AsyncClient(base_url="http://runtime", transport=httpx.MockTransport(fake.handle)) as client:
            return await self_check(client, layout, unavailable or {})

    return asyncio.run(run())


def statuses(report: SelfCheckReport) -> dict[str, str]:
    return {check.name: check.status for check in report.checks}


def test_forward_checks_pass_when_reuse_answers_like_computation(layout):
    fake = FakeRuntime()
    report = check_against(fake, layout)
    assert statuses(report) == {"rope_shift": PASSED, "reuse_at_offset_0": PASSED, "legolink_covering_chunks": PASSED}
    assert report.passed
    # Compiled first, then linked: the path every request takes.
    assert fake.calls == ["compile", "naive", "vanilla", "vanilla", "compile", "legolink", "full"]


@pytest.mark.parametrize("fault, failed, says", [
    ({"skew": {"naive": 0.01}}, "reuse_at_offset_0", "first-token logprobs differ by 0.01"),
    ({"tokens": {"naive": [11, 5, 9, 9]}}, "reuse_at_offset_0", "greedy tokens [11, 5, 9, 9]"),
    ({"reused": 0}, "reuse_at_offset_0", "was not reused"),
    ({"skew": {"legolink": -0.5}}, "legolink_covering_chunks", "against full: first-token logprobs differ by 0.5"),
])
def test_forward_checks_fail_when_reuse_answers_differently_or_reuses_nothing(layout, fault, failed, says):
    report = check_against(FakeRuntime(**fault), layout)
    assert not report.passed
    assert [c.name for c in report.checks if c.status == FAILED] == [failed]
    assert says in report.failures()


def test_a_failed_or_missing_rope_check_skips_the_forwards(layout):
    fake = FakeRuntime(rope={"passed": False, "detail": "keys differ", "dtype": "bfloat16"})
    report = check_against(fake, layout)
    assert statuses(report) == {"rope_shift": FAILED, "reuse_at_offset_0": SKIPPED, "legolink_covering_chunks": SKIPPED}
    assert report.failures() == "rope_shift: keys differ" and fake.calls == []
    missing = check_against(FakeRuntime(rope=None), layout)
    assert "does not run picrag's chunk cache" in missing.failures()


def test_legolink_check_is_skipped_where_legolink_is_unavailable(layout):
    fake = FakeRuntime()
    report = check_against(fake, layout, {"legolink": "no position masks"})
    assert report.passed and statuses(report)["legolink_covering_chunks"] == SKIPPED
    assert "legolink" not in fake.calls


def test_a_model_that_refuses_chunk_reuse_skips_the_forwards(layout):
    """A model whose every chunk-reusing family is refused (sliding windows: naive would be 400)
    has no reuse to check: the checks are skipped with the reason, not failed."""
    fake = FakeRuntime()
    window = "the model has sliding-window layers"
    report = check_against(fake, layout, {"naive": window, "legolink": window})
    assert report.passed
    assert statuses(report) == {"rope_shift": PASSED, "reuse_at_offset_0": SKIPPED, "legolink_covering_chunks": SKIPPED}
    assert window in report.checks[1].detail and fake.calls == []


def test_a_flat_first_token_distribution_passes_no_check(layout):
    report = check_against(FakeRuntime(flat=True), layout)
    assert [c.name for c in report.checks if c.status == FAILED] == ["reuse_at_offset_0", "legolink_covering_chunks"]
    assert "equally likely" in report.failures()


def test_half_precision_compares_the_first_token_and_allows_near_ties():
    def out(ids, top):
        return {"output_ids": ids, "meta_info": {"output_top_logprobs": [[[lp, t, ""] for t, lp in top.items()]]}}

    reference = out([1, 2, 3], {1: -0.70, 2: -0.72, 3: -4.0})
    half = TOLERANCES["float16"]
    assert difference(out([1, 9, 9], {1: -0.71, 2: -0.70, 3: -4.0}), reference, half) is None
    assert difference(out([2, 2, 3], {1: -0.73, 2: -0.70, 3: -4.0}), reference, half) is None  # a near tie
    assert "greedy tokens" in difference(out([1, 9, 9], {1: -0.70, 2: -0.72, 3: -4.0}), reference, TOLERANCES["float32"])
    clear = out([1, 2, 3], {1: -0.1, 2: -3.0, 3: -4.0})
    assert "greedy tokens [2]" in difference(out([2, 2, 3], {1: -0.1, 2: -3.0, 3: -4.0}), clear, half)


# ---- what a failed check does to requests -----------------------------------------------------

FAILED_REPORT = SelfCheckReport((Check("rope_shift", FAILED, "keys differ"),), 0.1)


def test_a_failed_check_serves_reuse_as_the_chosen_fallback():
    for action in ("prefix", "full"):
        gate = ReuseGate(FAILED_REPORT, action)
        resolver = PolicyResolver.start("legolink", gate=gate)
        served = resolver.resolve(NamedPolicy.parse("legolink:4"))
        assert served.policy.name == action and "served as" in served.warning
        assert resolver.resolve(NamedPolicy.parse("naive")).policy.name == action
        as_asked = resolver.resolve(NamedPolicy.parse("full"))  # reuses nothing: as asked
        assert as_asked.policy.name == "full" and as_asked.warning is None
        link = served.link(LinkRequest.of("legolink:4", [(3, 9)]))
        assert (link.policy, link.chunks, link.k) == (action, ((3, 9),), 0)
        full = LinkRequest.of("full", [(3, 9)])
        assert as_asked.link(full) is full
        assert resolver.unavailable == {} and resolver.default.name == "legolink"
        assert gate.as_json()["reuse"] == f"served as {action}"
    assert ReuseGate(FAILED_REPORT).on_failure == "prefix"


def test_refuse_makes_every_reusing_family_unavailable_with_the_reason():
    gate = ReuseGate(FAILED_REPORT, "refuse")
    resolver = PolicyResolver.start("legolink", gate=gate)
    unavailable = resolver.unavailable
    assert set(unavailable) == {"naive", "legolink", "legolink0", "cacheblend", "cacherepair", "cacherepair+legolink",
                                "select", "cacherepair+select"}
    assert unavailable["naive"] == "the start-up self-check failed (rope_shift: keys differ)"
    with pytest.raises(PolicyError, match="'naive' is unavailable on this server: the start-up self-check failed"):
        resolver.resolve(NamedPolicy.parse("naive"))  # refused, never rewritten
    assert resolver.default.name == "prefix" and PolicyResolver.start("full", gate=gate).default.name == "full"
    assert gate.as_json() == {"status": FAILED, "reuse": "refused", "seconds": 0.1,
                              "checks": [{"name": "rope_shift", "status": FAILED, "detail": "keys differ"}]}


def test_a_passed_or_skipped_check_changes_nothing():
    passed = SelfCheckReport((Check("rope_shift", PASSED, "ok"), Check("legolink_covering_chunks", SKIPPED, "x")), 1.0)
    for gate in (ReuseGate(passed, "refuse"), ReuseGate(passed, "full"), ReuseGate()):
        link = LinkRequest.of("legolink:4", [(3, 9)])
        resolver = PolicyResolver.start(gate=gate)
        assert gate.refusal is None and resolver.unavailable == {}
        assert resolver.resolve(NamedPolicy.parse("legolink:4")).link(link) is link
    assert ReuseGate().as_json() == {"status": "not run", "reuse": "as asked, unchecked"}
    with pytest.raises(ValueError, match="on_failure"):
        ReuseGate(FAILED_REPORT, "naive")


# ---- a frontend after a failed check, in front of a fake runtime -------------------------------

def test_a_failed_check_serves_reuse_as_prefix_and_health_says_why(default_model_dir):
    from tests.fake_runtime import DOCUMENTS, fake_runtime, link_hints_naive, recording
    from tests.inprocess_frontend import frontend

    policies: list[str] = []
    with fake_runtime(default_model_dir, recording(policies)) as (_fake, runtime_url), \
            frontend(runtime_url, policies=PolicyResolver.start(gate=ReuseGate(FAILED_REPORT, "prefix"))) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        answer = client.post("/rag/query", json={"question": "Where is the Eiffel Tower?", "max_tokens": 2,
                                                 "policy": "legolink:4", "documents": DOCUMENTS})
        linked = client.post("/generate", json={"input_ids": [5, 6, 7, 8, 9], "kv_hints": link_hints_naive()})
        health = client.get("/health").json()
    assert answer.status_code == 200 and linked.status_code == 200, (answer.text, linked.text)
    assert answer.json()["policy"] == "prefix"
    assert any("legolink:4 served as prefix: the start-up self-check failed (rope_shift: keys differ)" in w
               for w in answer.json()["warnings"]), answer.json()
    # Nothing compiled, nothing linked as asked: both reached the runtime as prefix.
    assert policies == ["prefix", "prefix"]
    assert health["selfcheck"]["status"] == FAILED and health["selfcheck"]["reuse"] == "served as prefix"


def test_refuse_answers_400_with_the_reason_and_serves_the_default_as_prefix(default_model_dir):
    from tests.fake_runtime import DOCUMENTS, fake_runtime, link_hints_naive, recording
    from tests.inprocess_frontend import frontend

    policies: list[str] = []
    with fake_runtime(default_model_dir, recording(policies)) as (_fake, runtime_url), \
            frontend(runtime_url, policies=PolicyResolver.start(gate=ReuseGate(FAILED_REPORT, "refuse"))) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        refused = client.post("/rag/query", json={"question": "Where?", "max_tokens": 2, "policy": "naive",
                                                  "documents": DOCUMENTS})
        refused_link = client.post("/generate", json={"input_ids": [5, 6, 7, 8, 9], "kv_hints": link_hints_naive()})
        default = client.post("/rag/query", json={"question": "Where?", "max_tokens": 2, "documents": DOCUMENTS})
        health = client.get("/health").json()
    for response in (refused, refused_link):
        assert response.status_code == 400 and "the start-up self-check failed (rope_shift: keys differ)" in response.text
    assert default.status_code == 200 and default.json()["policy"] == "prefix"
    assert policies == ["prefix"]
    assert health["selfcheck"]["reuse"] == "refused"


# ---- the shared server ------------------------------------------------------------------------

@pytest.mark.server
def test_the_shared_server_passed_its_selfcheck_and_says_so(picrag_server):
    with picrag_server.client() as client:
        selfcheck = client.get("/health").json()["selfcheck"]
    assert selfcheck["status"] == PASSED and selfcheck["reuse"] == "as asked", selfcheck
    assert [(c["name"], c["status"]) for c in selfcheck["checks"]] == [
        ("rope_shift", PASSED), ("reuse_at_offset_0", PASSED), ("legolink_covering_chunks", PASSED)]
    log = picrag_server.log.read_text()
    assert "self-check legolink_covering_chunks: passed: legolink:" in log and "self-check passed in" in log
