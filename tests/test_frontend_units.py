"""The frontend's pieces without a server: chunk markers, context fitting, planning, batch input."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
import json

import pytest

from rag_server.bench.batch_qa import AskOptions, Asker, BatchError, read_answers, read_questions
from rag_server.api.chunk_markers import (CHUNK_BEGIN, CHUNK_END, Segment, link_marked_payload, mark_chunk,
                                      split_marked, tokenize_marked)
from rag_server.cli import build_parser
from rag_server.service.context_window import ContextLimits, PromptTooLong, fit_passages
from retrieval.passage import Passage
from retrieval.prompt_layout import PromptLayout, PromptPassage, passage_text
from retrieval.qa_rows import QARow
from rag_server.linking.policy_resolver import NamedPolicy, PolicyResolver
from rag_server.service.rag_service import RagRequest, RagRequestError, RagService, keep_best
from picrag_core.link_hints import parse_link_request
from picrag_core.policies import parse_policy

PASSAGES = [
    Passage("a", "Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris, France.", score=0.9),
    Passage("b", "Big Ben", "Big Ben is the great bell of the clock at the Palace of Westminster.", score=0.2),
    Passage("c", "Colosseum", "The Colosseum is an elliptical amphitheatre in the centre of Rome.", score=0.5),
]
QUESTION = "Where is the Eiffel Tower?"


def sizes(layout: PromptLayout) -> tuple[int, list[int]]:
    fixed = len(layout.head_ids) + len(layout.question_ids(QUESTION))
    return fixed, [len(layout.passage_ids(p.prompt_passage())) for p in PASSAGES]


# --- chunk markers ---------------------------------------------------------------------------

def test_split_marked_text():
    text = f"head {mark_chunk('one')}mid {mark_chunk('two')} tail"
    assert split_marked(text) == [Segment("head ", False), Segment("one", True), Segment("mid ", False),
                                  Segment("two", True), Segment(" tail", False)]
    # A begin marker whose end never comes: that tail is plain text, markers removed.
    assert split_marked(f"a{CHUNK_BEGIN}b") == [Segment("ab", False)]
    with pytest.raises(ValueError):
        mark_chunk(f"x{CHUNK_END}")


def test_marked_chunks_tokenize_alone_and_span_their_tokens(layout):
    passage = passage_text(PromptPassage("Eiffel Tower", PASSAGES[0].text))
    text = f"<|im_start|>user\nDocuments:\n\n{mark_chunk(passage)}Question: {QUESTION}"
    ids, chunks = tokenize_marked(text, layout.encode, prefix_ids=[7])
    (start, end), = chunks
    assert ids[0] == 7  # the tokenizer's leading specials come first, outside every chunk
    assert ids[start:end] == layout.encode(passage)  # the same tokens wherever the passage lands
    assert ids[end:] == layout.encode(f"Question: {QUESTION}")


def test_marked_generate_payloads(layout):
    single = {"text": "x" + mark_chunk("some passage"), "sampling_params": {"max_new_tokens": 1}}
    rewritten = link_marked_payload(single, layout.encode, [], parse_policy("naive"))
    assert "text" not in rewritten and rewritten["sampling_params"] == {"max_new_tokens": 1}
    link = parse_link_request(rewritten["kv_hints"])
    assert link.policy == "naive" and link.chunks == ((1, 1 + len(layout.encode("some passage"))),)
    batch = {"text": [mark_chunk("p") + "q A", "plain"]}
    assert link_marked_payload(batch, layout.encode, [], parse_policy("naive")) == {"text": ["pq A", "plain"]}
    assert link_marked_payload({"text": "no markers"}, layout.encode, [], parse_policy("naive")) is None


# --- context window --------------------------------------------------------------------------

def test_fit_keeps_everything_that_fits(layout):
    fixed, each = sizes(layout)
    fitted = fit_passages(layout, QUESTION, PASSAGES, fixed + sum(each))
    assert fitted.kept == PASSAGES and fitted.dropped == []


def test_fit_drops_lowest_scored_whole_passages_and_keeps_order(layout):
    fixed, each = sizes(layout)
    # One token short of all three: the lowest-scored (Big Ben, 0.2) goes, nothing is cut.
    fitted = fit_passages(layout, QUESTION, PASSAGES, fixed + sum(each) - 1)
    assert [p.id for p in fitted.kept] == ["a", "c"] and [p.id for p in fitted.dropped] == ["b"]
    # Room for exactly the best one.
    fitted = fit_passages(layout, QUESTION, PASSAGES, fixed + each[0])
    assert [p.id for p in fitted.kept] == ["a"] and [p.id for p in fitted.dropped] == ["b", "c"]


def test_fit_without_scores_drops_the_last_given(layout):
    fixed, each = sizes(layout)
    unscored = [Passage(p.id, p.title, p.text) for p in PASSAGES]
    fitted = fit_passages(layout, QUESTION, unscored, fixed + each[0] + each[1])
    assert [p.id for p in fitted.kept] == ["a", "b"]


def test_fit_tokenizes_each_piece_once_and_builds_the_prompt_from_those_tokens(layout, monkeypatch):
    fixed, each = sizes(layout)
    expected = layout.build(QUESTION, [PASSAGES[0].prompt_passage(), PASSAGES[2].prompt_passage()])
    encoded: list[str] = []
    encode = layout.encode
    monkeypatch.setattr(layout, "encode", lambda text: encoded.append(text) or encode(text))
    fitted = fit_passages(layout, QUESTION, PASSAGES, fixed + each[0] + each[2])
    assert [p.id for p in fitted.kept] == ["a", "c"] and fitted.prompt == expected
    assert len(encoded) == len(PASSAGES) + 1  # every passage and the question, once each


def test_question_alone_too_long(layout):
    fixed, _ = sizes(layout)
    with pytest.raises(PromptTooLong, match=f"needs {fixed} prompt tokens"):
        fit_passages(layout, QUESTION, PASSAGES, fixed - 1)


def test_keep_best_by_score_then_given_order():
    assert [p.id for p in keep_best(PASSAGES, 2)] == ["a", "c"]
    unscored = [Passage(p.id, p.title, p.text) for p in PASSAGES]
    assert [p.id for p in keep_best(unscored, 2)] == ["a", "b"]


def test_context_limits_reserve_the_answer():
    limits = ContextLimits(context_length=8192, max_input_tokens=8186)
    assert limits.prompt_budget(16) == 8176
    assert limits.prompt_budget(2) == 8186


# --- planning --------------------------------------------------------------------------------

def test_plan_reports_dropped_passages_and_builds_the_prompt_from_the_rest(tokenizer, layout):
    fixed, each = sizes(layout)
    max_tokens = 16
    limits = ContextLimits(context_length=fixed + each[0] + each[2] + max_tokens, max_input_tokens=10_000)
    service = RagService(tokenizer, pipeline=None, limits=limits)
    plan = asyncio.run(service.plan(RagRequest(QUESTION, NamedPolicy.parse("naive"), max_tokens, documents=PASSAGES)))
    assert [p.id for p in plan.passages] == ["a", "c"] and [p.id for p in plan.dropped] == ["b"]
    assert plan.warnings and "dropped 1 of 3 passages" in plan.warnings[0]
    expected = layout.build(QUESTION, [PASSAGES[0].prompt_passage(), PASSAGES[2].prompt_passage()])
    assert plan.prompt.input_ids == expected.input_ids and plan.prompt.chunks == expected.chunks
    assert len(plan.prompt.input_ids) + max_tokens == limits.context_length


def test_plan_with_top_k_and_without_index(tokenizer):
    service = RagService(tokenizer, pipeline=None, limits=ContextLimits(8192, 8186))
    plan = asyncio.run(service.plan(RagRequest(QUESTION, NamedPolicy.parse("full"), 8, documents=PASSAGES, top_k=1)))
    assert [p.id for p in plan.passages] == ["a"]
    with pytest.raises(RagRequestError, match="no passage index is loaded"):
        asyncio.run(service.plan(RagRequest(QUESTION, NamedPolicy.parse("naive"), 8)))


def test_history_goes_into_the_head_and_leaves_chunks_alone(tokenizer, layout):
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    chat = PromptLayout(tokenizer, history=history)
    text = tokenizer.decode(chat.head_ids)
    assert "Hi<|im_end|>" in text and "Hello!<|im_end|>" in text and text.endswith("Documents:\n\n")
    passage = PASSAGES[0].prompt_passage()
    assert chat.passage_ids(passage) == layout.passage_ids(passage)


# --- batch QA input, CLI ---------------------------------------------------------------------

def test_read_questions_and_answers(tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"id": 1, "question": "A?", "answers": ["a"]}\n\n{"id": "2", "question": "B?"}\n')
    assert read_questions(questions) == [QARow("1", "A?", ("a",)), QARow("2", "B?")]
    assert [q.id for q in read_questions(questions, limit=1)] == ["1"]
    questions.write_text('{"id": 1, "question": "A?"}\n{"id": 1, "question": "B?"}\n')
    with pytest.raises(BatchError, match="appears twice"):
        read_questions(questions)
    questions.write_text('{"id": 1, "question": "A?"}\n{"id": 2}\n')
    with pytest.raises(BatchError, match="q.jsonl:2: a row needs `id` and `question`"):
        read_questions(questions)
    answers = tmp_path / "a.jsonl"
    answers.write_text(json.dumps({"id": "1", "answer": "x"}) + '\n{"id": "2", "ans')  # cut short
    assert list(read_answers(answers)) == ["1"]


def test_inline_passage_selection():
    question = QARow("1", "Q?", passages=tuple(PromptPassage(f"t{i}", f"p{i}") for i in range(5)),
                     supporting=tuple(i in (1, 3) for i in range(5)))
    asker = Asker(AskOptions(url="http://unused", max_passages=2))
    assert [d["text"] for d in asker.documents(question)] == ["p0", "p1"]
    asker = Asker(AskOptions(url="http://unused", supporting_only=True))
    assert [d["text"] for d in asker.documents(question)] == ["p1", "p3"]
    asker = Asker(AskOptions(url="http://unused", server_index=True))
    assert asker.documents(question) is None


def test_cli_serve_and_ask_options():
    args = build_parser().parse_args(["serve", "--index", "idx", "--default-policy", "full"])
    assert str(args.index) == "idx" and args.default_policy == "full"
    args = build_parser().parse_args(["ask", "--questions", "q.jsonl", "--out", "a.jsonl", "--limit", "5"])
    assert args.url == "http://127.0.0.1:8000" and args.limit == 5 and args.policy is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ask", "--questions", "q", "--out", "a", "--policy", "bogus"])


def test_a_policy_the_server_cannot_run_is_refused_with_the_reason(tokenizer):
    service = RagService(tokenizer, pipeline=None, limits=ContextLimits(8192, 8186), policies=PolicyResolver.start(
        "legolink", {"cacherepair": "no CacheRepair checkpoint for model x"}))
    with pytest.raises(RagRequestError, match="'cacherepair' is unavailable on this server: no CacheRepair checkpoint"):
        asyncio.run(service.plan(RagRequest(QUESTION, NamedPolicy.parse("cacherepair"), 8, documents=PASSAGES)))
    assert asyncio.run(service.plan(RagRequest(QUESTION, NamedPolicy.parse("legolink:4"), 8, documents=PASSAGES))).passages


def test_cli_policy_names_take_parameters():
    assert build_parser().parse_args(["serve", "--default-policy", "cacheblend:0.3"]).default_policy == "cacheblend:0.3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--default-policy", "legolink:x"])


def test_position_masked_policies_need_a_picrag_attention_backend():
    from rag_server.linking.policy_resolver import DEFAULT_POLICIES, PolicyUnavailable, engine_refusals

    assert engine_refusals("picrag_native", None) == {}
    assert engine_refusals("picrag_flashinfer", None) == {}
    on_gpu = engine_refusals("flashinfer", "no checkpoint")
    assert set(on_gpu) == {"legolink", "cacheblend", "cacherepair", "cacherepair+legolink", "select",
                           "cacherepair+select"}
    assert "'flashinfer'" in on_gpu["legolink"] and "no checkpoint" in on_gpu["cacherepair+legolink"]
    assert DEFAULT_POLICIES == ("cacherepair", "legolink", "naive", "prefix")
    assert PolicyResolver.start(None, on_gpu).default.name == "naive"
    assert PolicyResolver.start(None, engine_refusals("picrag_native", "no checkpoint")).default.name == "legolink"
    assert PolicyResolver.start(None, {}).default.name == "cacherepair"
    assert PolicyResolver.start("full", on_gpu).default.name == "full"
    with pytest.raises(PolicyUnavailable, match="default policy 'legolink:4' is unavailable: it needs attention"):
        PolicyResolver.start("legolink:4", on_gpu)
    menu = {entry["name"]: entry for entry in PolicyResolver.start(None, on_gpu).menu()}
    assert not menu["legolink"]["available"] and menu["legolink"]["reason"] == on_gpu["legolink"]
    assert menu["naive"]["available"] and menu["auto"]["available"]


def test_relink_reads_chunk_misses_from_the_first_event_and_from_whole_answers():
    from rag_server.linking.pipeline import first_event, response_misses
    from picrag_core.engine_report import EngineReport

    async def stream(parts):
        for part in parts:
            yield part

    first = b'data: {"text": "a", "meta_info": {"cached_tokens_details": {"picrag_chunk_misses": 2}}}\n\n'
    read, event = asyncio.run(first_event(stream([first[:20], first[20:], b'data: {"text": "ab"}\n\n'])))
    assert read.startswith(first) and EngineReport.of(event["meta_info"]).relinkable_misses == 2
    assert asyncio.run(first_event(stream([b": keep-alive\n\n", b"data: [DONE]\n\n"])))[1] is None
    assert response_misses(b'{"meta_info": {"cached_tokens_details": {"picrag_chunk_misses": 1}}}') == 1
    assert response_misses(b'[{"meta_info": {}}, {"meta_info": null}]') == 0
    assert response_misses(b"not json") == 0


def test_compiler_skips_pieces_it_compiled_and_forgets_them_on_flush():
    from rag_server.linking.chunk_compiler import ChunkCompiler, Pieces
    from picrag_core.link_hints import LinkRequest

    sent = []

    class Runtime:
        async def post(self, path, json, headers=None):
            sent.append(json["input_ids"])
            return SimpleNamespace(status_code=200)

    compiler = ChunkCompiler(Runtime())
    pieces = Pieces.of([1, 2, 10, 11, 20, 21, 22, 9], LinkRequest.of("naive", [(2, 4), (4, 7)]))
    asyncio.run(compiler.prepare(pieces, skip_known=True))
    assert sent == [[[1, 2], [10, 11], [20, 21, 22]]]  # the head and both chunks, in one request
    asyncio.run(compiler.prepare(pieces, skip_known=True))  # all compiled before: nothing sent
    assert len(sent) == 1
    moved = Pieces.of([1, 2, 30, 31, 10, 11, 9], LinkRequest.of("naive", [(2, 4), (4, 6)]))
    asyncio.run(compiler.prepare(moved, skip_known=True))  # a new passage before a known one: only it is sent
    assert sent.pop() == [[30, 31]]
    asyncio.run(compiler.prepare(pieces))  # without skip_known: always asks the engine
    compiler.forget()
    asyncio.run(compiler.prepare(pieces, skip_known=True))
    assert len(sent) == 3 and sent[0] == [[1, 2], [10, 11], [20, 21, 22]]
    compiler.note_eviction()  # a link missed a piece: no skipping for a while, even of known ones
    asyncio.run(compiler.prepare(pieces, skip_known=True))
    asyncio.run(compiler.prepare(pieces, skip_known=True))
    assert len(sent) == 5


def test_a_passage_keys_and_routes_alike_last_with_its_tail_or_inside_the_run():
    """The separator a passage is stored with is its own wherever it stands: after the next
    passage, or as the tail when it is last (6 is the separator here)."""
    from rag_server.linking.chunk_compiler import ChunkCompiler, Pieces
    from picrag_core.link_hints import LinkRequest

    sent = []

    class Runtime:
        async def post(self, path, json, headers=None):
            sent.append(json["input_ids"])
            return SimpleNamespace(status_code=200)

    compiler = ChunkCompiler(Runtime())
    last = Pieces.of([1, 2, 10, 11, 6, 20, 21, 9], LinkRequest.of("naive", [(2, 5), (5, 7)], tail=(6,)))
    asyncio.run(compiler.prepare(last, skip_known=True))
    assert sent == [[[1, 2], [10, 11, 6], [20, 21, 6]]]
    inside = Pieces.of([1, 2, 20, 21, 6, 10, 11, 6, 9], LinkRequest.of("naive", [(2, 5), (5, 8)]))
    assert set(inside.keys) == set(last.keys) and inside.route == last.route
    asyncio.run(compiler.prepare(inside, skip_known=True))
    assert len(sent) == 1  # both passages known as stored
    untailed = Pieces.of([1, 2, 10, 11, 6, 20, 21, 9], LinkRequest.of("naive", [(2, 5), (5, 7)]))
    assert untailed.route != last.route


# --- link pipeline (against a scripted runtime) -----------------------------------------------

def _event(text: str, misses: int) -> bytes:
    meta = {"cached_tokens_details": {"picrag_chunk_misses": misses}}
    return f"data: {json.dumps({'text': text, 'meta_info': meta})}\n\n".encode()


async def _pieces(content: bytes):
    # Small pieces, as a network delivers them: events arrive split.
    for start in range(0, len(content), 7):
        yield content[start:start + 7]


def _scripted_pipeline(link_answers):
    """A LinkPipeline on a runtime that answers each link with the next of `link_answers`
    (status, content type, body) and every compile with 200; returns it and the request log."""
    import httpx

    from rag_server.linking.chunk_compiler import ChunkCompiler
    from rag_server.linking.pipeline import LinkPipeline

    log: list[str] = []
    answers = iter(link_answers)

    def runtime(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        action = body["kv_hints"]["actions"][0]
        log.append(action["action_type"] + (":refuse" if action["payload"].get("on_miss") == "refuse" else ""))
        action = action["action_type"]
        if action == "picrag.compile":
            return httpx.Response(200, json=[{"meta_info": {}} for _ in body["input_ids"]])
        status, content_type, content = next(answers)
        return httpx.Response(status, headers={"content-type": content_type}, content=_pieces(content))

    client = httpx.AsyncClient(base_url="http://runtime", transport=httpx.MockTransport(runtime))
    return LinkPipeline(client, ChunkCompiler(client)), log


PROMPT = [1, 2, 10, 11, 20, 21, 22, 9]


def test_a_streamed_link_with_chunk_misses_is_dropped_compiled_again_and_relinked():
    from picrag_core.link_hints import LinkRequest

    missed = _event("A", 2) + _event("AB", 2) + b"data: [DONE]\n\n"
    hit = _event("X", 0) + _event("XY", 0) + b"data: [DONE]\n\n"
    pipeline, log = _scripted_pipeline([(200, "text/event-stream", missed), (200, "text/event-stream", hit)])
    link = LinkRequest.of("naive", [(2, 4), (4, 7)])

    async def relayed() -> bytes:
        linked = await pipeline.generate(PROMPT, link, {"stream": True})
        return b"".join([chunk async for chunk in linked.body()])

    assert asyncio.run(relayed()) == hit  # the client sees the relinked answer, byte for byte
    assert log == ["picrag.compile", "picrag.link:refuse", "picrag.compile", "picrag.link:refuse"]
    # The same prompt again: the compiler skips no longer (a miss means the pool is evicting).
    pipeline, log = _scripted_pipeline([(200, "text/event-stream", hit)] * 2)

    async def deltas() -> list[str]:
        await pipeline.generate(PROMPT, link, {"stream": True})  # compiles, then remembers
        linked = await pipeline.generate(PROMPT, link, {"stream": True})
        return [delta.text async for delta in linked.deltas()]

    assert asyncio.run(deltas()) == ["X", "Y"]
    assert log == ["picrag.compile", "picrag.link:refuse", "picrag.link:refuse"]


def test_a_linked_prompt_hashes_each_piece_once_however_often_it_is_compiled(monkeypatch):
    from rag_server.linking import chunk_compiler
    from rag_server.linking.chunk_compiler import Pieces, passage_set_key
    from picrag_core.chunk_key import chunk_key
    from picrag_core.link_hints import LinkRequest

    hashed: list[list[int]] = []
    monkeypatch.setattr(chunk_compiler, "chunk_key", lambda ids: hashed.append(list(ids)) or chunk_key(ids))
    for policy, sink, hashes in (("naive", None, 3), ("legolink0", 0, 2 + 3), ("full", None, 2)):
        hashed.clear()
        link = LinkRequest.of(policy, [(2, 4), (4, 7)], sink_token=sink)
        pieces = Pieces.of(PROMPT, link)
        # The keys name the pieces as stored (behind sinks for legolink0); the route, the passages.
        assert pieces.keys == tuple(chunk_key(s) for s in pieces.segments) and len(hashed) == hashes
        assert pieces.route == passage_set_key(PROMPT, LinkRequest.of("naive", [(2, 4), (4, 7)]))
    missed = _event("A", 2) + b"data: [DONE]\n\n"
    hit = _event("X", 0) + b"data: [DONE]\n\n"
    pipeline, log = _scripted_pipeline([(200, "text/event-stream", missed), (200, "text/event-stream", hit)])
    hashed.clear()
    asyncio.run(pipeline.generate(PROMPT, LinkRequest.of("naive", [(2, 4), (4, 7)]), {"stream": True}))
    assert log.count("picrag.compile") == 2 and sorted(map(tuple, hashed)) == [(1, 2), (10, 11), (20, 21, 22)]


def test_a_whole_link_answer_is_relinked_at_most_max_relinks_times_then_answered_as_it_is():
    from rag_server.linking.pipeline import MAX_RELINKS
    from picrag_core.link_hints import LinkRequest

    missed = json.dumps({"text": "A", "meta_info": {"cached_tokens_details": {"picrag_chunk_misses": 1}}}).encode()
    pipeline, log = _scripted_pipeline([(200, "application/json", missed)] * (MAX_RELINKS + 1))
    linked = asyncio.run(pipeline.generate(PROMPT, LinkRequest.of("naive", [(2, 4)]), {}))
    assert linked.rest is None and linked.head == missed and linked.misses == 1
    # Every attempt but the last asks the engine to refuse it on a miss; the last is computed.
    assert log.count("picrag.link:refuse") == MAX_RELINKS and log[-1] == "picrag.link"
    assert log.count("picrag.compile") == MAX_RELINKS + 1 and pipeline.relinks == MAX_RELINKS
    # A refusal is answered as it is, and never relinked.
    pipeline, log = _scripted_pipeline([(400, "application/json", b'{"error": "too long"}')])
    linked = asyncio.run(pipeline.generate(PROMPT, LinkRequest.of("naive", [(2, 4)]), {}))
    assert (linked.response.status_code, linked.head) == (400, b'{"error": "too long"}')
    assert log == ["picrag.compile", "picrag.link:refuse"]


def test_a_link_the_engine_refused_unrun_is_compiled_again_and_relinked():
    """The engine's refusal of an `on_miss: refuse` link (a chunk missing on arrival), streamed
    (an abort finish reason) or whole (its status), is never shown: compiled again, relinked."""
    from picrag_core.link_hints import MISS_REFUSAL, MISS_REFUSAL_STATUS, LinkRequest

    abort = {"type": "abort", "message": f"{MISS_REFUSAL}: 1 of 2 chunk(s) missing", "status_code": MISS_REFUSAL_STATUS}
    streamed = f"data: {json.dumps({'text': '', 'meta_info': {'finish_reason': abort}})}\n\ndata: [DONE]\n\n".encode()
    whole = json.dumps({"detail": abort["message"]}).encode()
    hit = _event("X", 0) + b"data: [DONE]\n\n"
    pipeline, log = _scripted_pipeline([(200, "text/event-stream", streamed),
                                        (MISS_REFUSAL_STATUS, "application/json", whole),
                                        (200, "text/event-stream", hit)])
    link = LinkRequest.of("naive", [(2, 4), (4, 7)])

    async def relayed() -> bytes:
        linked = await pipeline.generate(PROMPT, link, {"stream": True})
        return b"".join([chunk async for chunk in linked.body()])

    assert asyncio.run(relayed()) == hit
    assert log == ["picrag.compile", "picrag.link:refuse"] + ["picrag.compile", "picrag.link:refuse"] * 2
    assert pipeline.relinks == 2
    # Another abort (not the engine's refusal) is the answer.
    other = json.dumps({"detail": "prompt too long"}).encode()
    pipeline, log = _scripted_pipeline([(MISS_REFUSAL_STATUS, "application/json", other)])
    linked = asyncio.run(pipeline.generate(PROMPT, link, {}))
    assert linked.response.status_code == MISS_REFUSAL_STATUS and not linked.refused and pipeline.relinks == 0


def test_on_miss_travels_in_the_link_hints_and_is_parsed_strictly():
    import dataclasses

    from picrag_core.link_hints import LinkHintError, LinkRequest, hints_of

    link = LinkRequest.of("legolink:4", [(2, 4), (4, 7)])
    assert parse_link_request(hints_of(link)) == link and not link.refuse_on_miss
    refusing = dataclasses.replace(link, refuse_on_miss=True)
    assert parse_link_request(hints_of(refusing)) == refusing
    hints = hints_of(link)
    for bad in ("drop", True, None):
        hints["actions"][0]["payload"]["on_miss"] = bad
        with pytest.raises(LinkHintError, match="on_miss"):
            parse_link_request(hints)
