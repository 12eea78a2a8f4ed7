"""No client can corrupt the shared chunk cache or take the runtime down through what it sends.

The engine is the trust boundary (sglang_patches.guard.request_guard, the chunk cache's routing); the
frontend refuses the same fields with a 400 naming them (rag_server/api/client_fields.py). The
server tests run each attack through the frontend and straight at the runtime, then check that
linked requests answer exactly as they did before any attack: the same output ids and
bit-identical first-token log-probabilities.
"""

from __future__ import annotations

from array import array
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest

from rag_server.api.client_fields import client_link, refused_field
from rag_server.linking.chunk_compiler import compile_request, segments_to_compile
from retrieval.prompt_layout import passage_text, question_text
from picrag_core.attention_backends import NATIVE_BACKEND
from sglang_patches.tree.chunk_cache import CHUNK_NAMESPACE, ChunkRadixCache
from picrag_core.engine_report import EngineReport
from picrag_core.link_hints import (COMPILE_ACTION, LINK_ACTION, LinkHintError, LinkRequest, compile_hints,
                                       hints_of, parse_link_request, runtime_request)
from picrag_core.request_bounds import check_token_ids, client_namespace
from sglang_patches.guard.request_guard import EngineSettings, RequestShape, admitted_link, shape_of_req
from sglang_patches.plan.keys import GRAFTED, SEGMENT_START
from tests.chunk_requests import passages_of
from tests.engine_routing import BOS, routed

ENGINE = EngineSettings(BOS, NATIVE_BACKEND)


def envelope(payload: dict, action_type: str = LINK_ACTION) -> dict:
    return {"protocol_version": "1", "message_id": "m",
            "actions": [{"action_id": "a", "action_type": action_type, "action_version": "1", "payload": payload}]}


# The issue's attack: a passage computed at shifted positions (LegoLink's layout of a gapped
# span list) stored in the chunk namespace that every policy reads.
def issue_payload(n: int) -> dict:
    return {"policy": "prefix", "layout": "legolink", "chunks": [[0, 1], [9, n]]}


PLAIN = RequestShape(prompt_len=40, max_new_tokens=8, namespaced=False)


# ---- the engine's admission of picrag actions ----------------------------------------------

@pytest.mark.parametrize("payload, reason", [
    (issue_payload(40), "layout 'legolink' is for prompts of a family that reorders"),
    ({"policy": "naive", "layout": "legolink", "chunks": [[0, 5], [9, 40]]}, "not for naive"),
    ({"policy": "full", "layout": "legolink", "chunks": [[0, 5], [5, 40]]}, "not for full"),
    ({"policy": "legolink", "layout": "legolink", "chunks": []}, "with chunks"),
    ({"policy": "legolink", "layout": "sideways", "chunks": [[0, 5]]}, "layout must be"),
    ({"policy": "legolink:4", "chunks": [[0, 5], [5, 9]]}, "must arrive reordered"),
    ({"policy": "legolink0", "chunks": [[0, 5]], "sink_token": 7}, "sink_token is the model's BOS (1), got 7"),
    ({"policy": "naive", "chunks": [[0, 5]], "sink_token": BOS}, "naive takes no sink_token"),
    ({"policy": "naive", "chunks": [[0, 5]], "k": 4}, "naive takes no k"),
    ({"policy": "legolink:4", "chunks": [[0, 5]], "k": 8, "layout": "legolink"}, "disagree"),
    ({"policy": "naive", "chunks": [[0, 5]], "extra_key": "picrag:chunk"}, "payload field 'extra_key'"),
    ({"policy": "naive", "chunks": [[0, 5.0]]}, "whole number"),
    ({"policy": "naive", "chunks": [[0, float("inf")]]}, "whole number"),
    ({"policy": "naive", "chunks": [[True, 5]]}, "whole number"),
    ({"policy": "naive", "chunks": [[0, 2**70]]}, "outside the prompt"),
    ({"policy": "naive", "chunks": [[0, 5, 9]]}, "a span is [start, end]"),
    ({"policy": "naive", "chunks": "0-5"}, "list of [start, end] spans"),
    ({"policy": "legolink", "chunks": [[0, 5]], "k": 2**70, "layout": "legolink"}, "k needs"),
    ({"policy": "legolink", "chunks": [[0, 5]], "k": 1e400, "layout": "legolink"}, "whole number"),
    ({"policy": "cacheblend", "chunks": [[0, 5]], "ratio": float("nan")}, "ratio needs"),
    ({"policy": "cacheblend", "chunks": [[0, 5]], "ratio": "0.5"}, "must be a number"),
    ({"policy": 3, "chunks": [[0, 5]]}, "policy must be a string"),
    ({"policy": "naive", "chunks": [[0, 5]], "tail": "\n\n"}, "tail must be a list of token ids"),
    ({"policy": "naive", "chunks": [[0, 5]], "tail": [1.0]}, "tail must be a whole number"),
    ({"policy": "naive", "chunks": [[0, 5]], "tail": [2] * 9}, "a tail is at most 8 tokens"),
    ({"policy": "naive", "chunks": [[0, 5]], "tail": [2**70]}, "a tail holds token ids"),
    ({"policy": "naive", "chunks": [[0, 5]], "tail": [-1]}, "a tail holds token ids"),
    ({"policy": "naive", "chunks": [], "tail": [2]}, "with chunks; not for naive"),
    ({"policy": "full", "chunks": [[0, 5]], "tail": [2]}, "not for full"),
])
def test_the_engine_refuses_link_fields_a_client_may_not_set(payload, reason):
    with pytest.raises(LinkHintError, match=reason.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        admitted_link(envelope(payload), PLAIN, ENGINE)


def test_the_engine_admits_links_as_picrag_sends_them():
    prompt = list(range(100, 140))
    for policy, chunks in [("naive", [(2, 9), (12, 30)]), ("legolink:4", [(2, 9), (9, 30)]),
                           ("cacheblend:0.3", [(2, 9)]), ("prefix", [(0, 40)]), ("full", [])]:
        link = LinkRequest.of(policy, chunks)
        _, hints = runtime_request(prompt, link)
        assert admitted_link(hints, PLAIN, ENGINE).chunks == link.chunks
    # legolink0: the engine's own sink, whether or not the hint names it.
    for sink in (None, BOS):
        admitted = admitted_link(hints_of(LinkRequest.of("legolink0", [(2, 9)], sink)), PLAIN, ENGINE)
        assert admitted.sink_token == BOS
    with pytest.raises(LinkHintError, match="this model has none"):
        admitted_link(hints_of(LinkRequest.of("legolink0", [(2, 9)], BOS)), PLAIN, EngineSettings(None, NATIVE_BACKEND))


def test_a_tail_is_token_ids_of_the_model():
    engine = dataclasses.replace(ENGINE, vocab_size=100)
    hints = hints_of(LinkRequest.of("naive", [(2, 9)], tail=(99,)))
    assert admitted_link(hints, PLAIN, engine).tail == (99,)
    with pytest.raises(LinkHintError, match=r"tail: 100 is not a token id of this model \(0..99\)"):
        admitted_link(hints_of(LinkRequest.of("naive", [(2, 9)], tail=(100,))), PLAIN, engine)
    with pytest.raises(LinkHintError, match="kv_hints field 'tail': 100 is not a token id"):
        client_link(LinkRequest.of("naive", [(2, 9)], tail=(100,)), BOS, 100)
    # Stored with the last chunk only, and by every family that stores chunks.
    for policy, sinks in (("naive", ()), ("cacheblend:0.3", ()), ("legolink0", (BOS,) * 3)):
        link = LinkRequest.of(policy, [(0, 2), (2, 4)], BOS, tail=(7,))
        assert link.stored_chunks([10, 11, 12, 13]) == [(*sinks, 10, 11), (*sinks, 12, 13, 7)]
    assert LinkRequest.of("full", [(0, 2)], tail=(7,)).tail == ()


def test_the_engine_refuses_a_family_its_attention_backend_cannot_run():
    prompt = list(range(100, 140))
    for policy in ("legolink:4", "cacheblend:0.3", "cacherepair+legolink:2"):
        _, hints = runtime_request(prompt, LinkRequest.of(policy, [(2, 9), (9, 30)]))
        with pytest.raises(LinkHintError, match="masked by true position, which the 'torch_native'"):
            admitted_link(hints, PLAIN, EngineSettings(BOS, "torch_native"))
    for policy in ("naive", "legolink0", "cacherepair", "prefix"):
        _, hints = runtime_request(prompt, LinkRequest.of(policy, [(2, 9), (9, 30)], BOS))
        assert admitted_link(hints, PLAIN, EngineSettings(BOS, "torch_native")).policy == policy


def test_kv_hints_are_one_envelope_per_prompt_at_the_engine():
    hints = hints_of(LinkRequest.of("legolink:4", [(2, 9)]))
    for form in ([hints], "picrag.link", 7):
        with pytest.raises(LinkHintError, match="one envelope object"):
            parse_link_request(form)


@pytest.mark.parametrize("shape, reason", [
    (RequestShape(10, 8, False), "max_new_tokens 0 or 1"),
    (RequestShape(10, None, False), "max_new_tokens 0 or 1"),
    (RequestShape(10, 0, True), "no extra_key, cache_salt or LoRA adapter"),
    (RequestShape(10, 0, False, ("positional_embed_overrides",)), "positional_embed_overrides is set"),
])
def test_compiles_store_only_chunks_computed_alone(shape, reason):
    with pytest.raises(LinkHintError, match=reason):
        admitted_link(compile_hints(), shape, ENGINE)
    assert admitted_link(compile_hints(), RequestShape(10, 1, False), ENGINE).compile


def test_one_picrag_action_and_an_empty_compile_payload():
    both = envelope({"policy": "naive", "chunks": [[0, 5]]})
    both["actions"].append(envelope({}, COMPILE_ACTION)["actions"][0])
    with pytest.raises(LinkHintError, match="one picrag action, got 2"):
        parse_link_request(both)
    with pytest.raises(LinkHintError, match="takes no payload fields, got 'layout'"):
        parse_link_request(envelope({"layout": "legolink"}, COMPILE_ACTION))
    assert parse_link_request(envelope({"policy": "x"}, "someone.else")) is None


# ---- the chunk cache's routing: what reaches the scheduler ---------------------------------

def _routed(hints, extra_key=None, prompt_len=40, **req_fields):
    return routed(hints, list(range(100, 100 + prompt_len)), extra_key=extra_key, **req_fields)


@pytest.mark.parametrize("extra_key", ["picrag:chunk", "picrag:naive", "picrag:legolink:4:0123456789abcdef"])
def test_a_client_extra_key_never_names_a_picrag_namespace(extra_key):
    plan, req = _routed(None, extra_key)
    assert plan is None and req.extra_key == client_namespace(extra_key) == f"client:{extra_key}"
    plan, req = _routed(hints_of(LinkRequest.of("naive", [(2, 9)])), extra_key)
    assert req.extra_key == f"{plan.namespace}|client:{extra_key}"
    assert _routed(None, "tenant-7")[1].extra_key == "tenant-7"


def test_hints_the_engine_does_not_admit_are_served_as_vanilla():
    plan, req = _routed(envelope(issue_payload(40)), "picrag:chunk")
    assert plan is None and req.extra_key == "client:picrag:chunk"
    for fields in ({"max_new_tokens": 8}, {"extra_key": "tenant"}, {"cache_salt": "s"},
                   {"positional_embed_overrides": object(), "max_new_tokens": 0}):
        plan, req = _routed(compile_hints(), **fields)
        assert plan is None and req.extra_key != CHUNK_NAMESPACE
    plan, req = _routed(compile_hints(), max_new_tokens=0)
    assert plan.link.compile and req.extra_key == CHUNK_NAMESPACE
    fresh = SimpleNamespace(origin_input_ids=[1] * 5, extra_key="lora-id", sampling_params=SimpleNamespace(
        max_new_tokens=0), input_embeds=[[0.0]])
    assert shape_of_req(fresh) == RequestShape(5, 0, True, ("input_embeds",))


def test_a_linked_prompt_key_carries_its_chunk_spans():
    """Same tokens, other spans: other KV, so another tree path; the same spans share it."""
    tokens = list(range(100, 140))
    keys = {spans: _routed(hints_of(LinkRequest.of("naive", spans)))[0].tree_key for spans in
            [((2, 9), (12, 30)), ((2, 9), (12, 35)), ((2, 9), (12, 20), (20, 30)), ((2, 9),)]}
    assert len({key.tobytes() for key in keys.values()}) == len(keys)
    first, second = keys[((2, 9), (12, 30))], keys[((2, 9), (12, 35))]
    assert first[:30] == second[:30] and first[30:] != second[30:]
    assert list(first[:2]) == tokens[:2] and list(first[9:12]) == tokens[9:12]  # plain tokens stay as they are
    assert first[2] >= SEGMENT_START and all(first[i] == tokens[i] | GRAFTED for i in range(3, 9))
    plan, req = _routed(hints_of(LinkRequest.of("naive", [(2, 9), (12, 30)])))
    assert plan.tree_key == first
    # SGLang keys the prompt and what follows it (outputs stay plain), or a prefix of it.
    assert ChunkRadixCache._tree_tokens(req, array("q", tokens + [5, 6])) == first + array("q", [5, 6])
    assert ChunkRadixCache._tree_tokens(req, array("q", tokens[:20])) == first[:20]


# ---- the frontend's edge ------------------------------------------------------------------

def test_the_frontend_names_the_fields_it_refuses():
    assert refused_field({"extra_key": "picrag:chunk"}, 100).startswith("extra_key:")
    assert refused_field({"extra_key": ["ok", "picrag:naive"]}, 100).startswith("extra_key:")
    assert refused_field({"input_ids": [1, 2, 100]}, 100).startswith("input_ids: 100 ")
    assert refused_field({"input_ids": [[1], [2, -1]]}, 100).startswith("input_ids: -1 ")
    assert refused_field({"input_ids": [1, 2**70]}, 100).startswith("input_ids: ")
    assert refused_field({"input_ids": [1, True]}, 100).startswith("input_ids: True")
    assert refused_field({"input_ids": [1, 99], "extra_key": "tenant"}, 100) is None
    with pytest.raises(LinkHintError, match="field 'layout'"):
        client_link(LinkRequest(policy="legolink", chunks=((0, 5),), k=4, layout="legolink"), BOS, 100)
    with pytest.raises(LinkHintError, match="field 'sink_token'"):
        client_link(LinkRequest.of("legolink0", [(0, 5)], 7), BOS, 100)
    assert client_link(LinkRequest.of("legolink0", [(0, 5)], BOS), BOS, 100).sink_token == BOS


def test_token_ids_outside_the_vocabulary():
    check_token_ids([0, 5, 99], 100)
    for bad in ([100], [-1], [2**70], [1.0], [None]):
        with pytest.raises(ValueError, match="input_ids: .* is not a token id of this model"):
            check_token_ids(bad, 100)


# ---- attacks on a running server ------------------------------------------------------------

@dataclass(frozen=True)
class Victim:
    """A linked request whose answer no other client may change."""

    name: str
    link: LinkRequest

    def body(self, ids: list[int]) -> dict:
        return {"input_ids": ids, "kv_hints": hints_of(self.link), "return_logprob": True, "top_logprobs_num": 5,
                "sampling_params": {"temperature": 0, "max_new_tokens": 4}}


@dataclass(frozen=True)
class Scene:
    frontend: httpx.Client
    runtime: httpx.Client
    messages: list[dict]
    ids: list[int]  # the chat template's rendering of `messages`
    vocab_size: int
    chunks: list[tuple[int, int]]
    victims: tuple[Victim, ...]

    def victim(self, name: str) -> Victim:
        return next(v for v in self.victims if v.name == name)

    def answers(self) -> dict[str, tuple]:
        """Every victim's output ids and first-token log-probabilities, each on its own."""
        result = {}
        for victim in self.victims:
            response = self.frontend.post("/generate", json=victim.body(self.ids))
            assert response.status_code == 200, response.text
            meta = response.json()["meta_info"]
            result[victim.name] = (response.json()["output_ids"], meta["output_token_logprobs"][0],
                                   meta["output_top_logprobs"][0])
        return result

    def flush(self) -> None:
        self.frontend.post("/flush_cache").raise_for_status()


@pytest.fixture(scope="module")
def scene(picrag_server, tokenizer, musique):
    row = musique[11]
    documents = "".join(passage_text(p) for p in passages_of(row, [0, 1]))
    messages = [{"role": "user", "content": f"Documents:\n\n{documents}{question_text(row['question'])}"}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    n = len(ids)
    chunks = [(n // 4, n // 2), (n // 2, 3 * n // 4)]  # back to back, so legolink may link them too
    victims = (Victim("naive", LinkRequest.of("naive", chunks)), Victim("legolink", LinkRequest.of("legolink:4", chunks)),
               Victim("prefix", LinkRequest.of("prefix", chunks)))
    with picrag_server.client(timeout=300) as frontend, httpx.Client(base_url=picrag_server.runtime_url,
                                                                     timeout=300) as runtime:
        yield Scene(frontend, runtime, messages, ids, len(tokenizer), chunks, victims)


@pytest.fixture(scope="module")
def before(scene) -> dict[str, tuple]:
    scene.flush()
    return scene.answers()


def refused(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    assert field in response.text, response.text


def generate_body(ids, hints=None, max_new_tokens=1, **extra) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}, **extra}
    if hints is not None:
        body["kv_hints"] = hints
    return body


def attack_issue_payload_on_every_piece(scene: Scene) -> None:
    """The issue's request, on the head and each passage the victims compile."""
    for piece in segments_to_compile(scene.ids, scene.victim("naive").link):
        hints = envelope(issue_payload(len(piece)))
        refused(scene.frontend.post("/generate", json=generate_body(piece, hints, extra_key=CHUNK_NAMESPACE)),
                "extra_key")
        refused(scene.frontend.post("/generate", json=generate_body(piece, hints)), "layout")
        refused(scene.runtime.post("/generate", json=generate_body(piece, hints, extra_key=CHUNK_NAMESPACE)),
                "layout")


def attack_extra_key_names_a_linked_namespace(scene: Scene) -> None:
    """Plain requests (prefilled in full) filed under the victims' own linked namespaces."""
    for name in ("naive", "legolink"):
        link = scene.victim(name).link
        runtime_ids, hints = runtime_request(scene.ids, link)
        namespace = routed(hints, runtime_ids)[0].namespace
        refused(scene.frontend.post("/generate", json=generate_body(runtime_ids, extra_key=namespace)), "extra_key")
        response = scene.runtime.post("/generate", json=generate_body(runtime_ids, extra_key=namespace))
        assert response.status_code == 200, response.text
        completion = {"prompt": runtime_ids, "max_tokens": 1, "temperature": 0, "extra_key": namespace}
        refused(scene.frontend.post("/v1/completions", json=completion), "extra_key")
        response = scene.runtime.post("/v1/completions", json=completion)
        assert response.status_code == 200, response.text
        chat = {"messages": scene.messages, "max_tokens": 1, "temperature": 0, "extra_key": namespace}
        refused(scene.frontend.post("/v1/chat/completions", json=chat), "extra_key")
        response = scene.runtime.post("/v1/chat/completions", json=chat)
        assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == len(scene.ids)


def attack_reordered_layout_outside_legolink(scene: Scene) -> None:
    """A prefix (or naive) prompt run at LegoLink's positions of gapped spans, stored under the
    plain namespace (or naive's) for the next identical prompt."""
    n = len(scene.ids)
    for policy in ("prefix", "naive"):
        hints = envelope({"policy": policy, "layout": "legolink", "chunks": [[0, 1], [9, n]]})
        refused(scene.frontend.post("/generate", json=generate_body(scene.ids, hints)), "layout")
        refused(scene.runtime.post("/generate", json=generate_body(scene.ids, hints)), "layout")


def attack_client_sink_token(scene: Scene) -> None:
    for sink in (7, scene.vocab_size, 2**70):
        hints = hints_of(LinkRequest.of("legolink0", scene.chunks, sink))
        refused(scene.frontend.post("/generate", json=generate_body(scene.ids, hints)), "sink_token")
        refused(scene.runtime.post("/generate", json=generate_body(scene.ids, hints)), "sink_token")


def attack_compile_with_other_fields(scene: Scene) -> None:
    piece = segments_to_compile(scene.ids, scene.victim("naive").link)[1]
    both = envelope({"policy": "naive", "chunks": [[0, 2]]})
    both["actions"].append(compile_hints()["actions"][0])
    for body, reason in [
        ({**compile_request([piece]), "extra_key": "tenant"}, "extra_key"),
        ({**compile_request([piece]), "sampling_params": {"temperature": 0, "max_new_tokens": 8}}, "max_new_tokens"),
        ({"input_ids": piece, "kv_hints": compile_hints()}, "max_new_tokens"),
        ({**compile_request([piece]), "kv_hints": envelope({"layout": "legolink"}, COMPILE_ACTION)}, "layout"),
        ({**compile_request([piece]), "kv_hints": both}, "one picrag action"),
    ]:
        refused(scene.runtime.post("/generate", json=body), reason)
        refused(scene.frontend.post("/generate", json=body), reason)
    refused(scene.frontend.post("/generate", json={**compile_request([piece]), "extra_key": CHUNK_NAMESPACE}),
            "extra_key")


def attack_out_of_vocabulary_ids(scene: Scene) -> None:
    for ids in ([1, 2, 999_999], [1, 2, 2**70], [1, -5]):
        refused(scene.frontend.post("/generate", json=generate_body(ids)), "input_ids")
        refused(scene.runtime.post("/generate", json=generate_body(ids)), "input_ids")
        response = scene.frontend.post("/v1/completions", json={"prompt": ids, "max_tokens": 1})
        assert response.status_code == 400, response.text
    hints = hints_of(LinkRequest.of("naive", [(0, 2)]))
    refused(scene.frontend.post("/generate", json=generate_body([1, 999_999, 3], hints)), "input_ids")
    refused(scene.runtime.post("/generate", json=compile_request([[5, 6], [7, 999_999]])), "input_ids")
    assert scene.runtime.get("/health").status_code == 200


def attack_other_chunk_spans(scene: Scene) -> None:
    """An allowed request: the naive victim's prompt with its question linked as a chunk too
    (chunk-alone KV that saw no documents), every piece compiled exactly as the frontend would."""
    naive = scene.victim("naive").link
    n = len(scene.ids)
    other = LinkRequest.of("naive", [*scene.chunks, (3 * n // 4, n - 2)])
    pieces = segments_to_compile(scene.ids, naive)
    for batch in (pieces, segments_to_compile(scene.ids, other)[len(pieces):]):
        assert scene.runtime.post("/generate", json=compile_request(batch)).status_code == 200
    response = scene.runtime.post("/generate", json=generate_body(scene.ids, hints_of(other)))
    assert response.status_code == 200 and EngineReport.of(response.json()["meta_info"]).chunk_misses == 0


ATTACKS = [attack_issue_payload_on_every_piece, attack_extra_key_names_a_linked_namespace,
           attack_reordered_layout_outside_legolink, attack_client_sink_token, attack_compile_with_other_fields,
           attack_out_of_vocabulary_ids, attack_other_chunk_spans]


@pytest.mark.server
@pytest.mark.parametrize("attack", ATTACKS, ids=[a.__name__.removeprefix("attack_") for a in ATTACKS])
def test_linked_answers_are_bit_identical_after(attack, scene, before):
    scene.flush()
    attack(scene)
    assert scene.answers() == before
