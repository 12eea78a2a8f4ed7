"""SGLang's DSL through `sgl.RuntimeEndpoint` on picrag's port: chunk markers become chunk
spans, `concate_and_append` joins work, and unmarked programs behave as on SGLang."""

from __future__ import annotations

import pytest

from rag_server.api.chunk_markers import strip_markers, tokenize_marked
from rag_server.dsl import chunk
from rag_server.linking.policy_resolver import DEFAULT_POLICY
from picrag_core.engine_report import EngineReport
from picrag_core.link_hints import link_hints
from picrag_core.policies import POLICY_FAMILIES

pytestmark = pytest.mark.server

PASSAGES = [
    ("Danube", "The Danube flows through Vienna, Budapest and Belgrade into the Black Sea."),
    ("Rhine", "The Rhine rises in the Swiss Alps and flows through Germany to the North Sea."),
]


@pytest.fixture(scope="module")
def sgl(picrag_server):
    import sglang as sgl
    from sglang.lang.global_config import global_config

    backend = sgl.RuntimeEndpoint(picrag_server.url)
    previous = global_config.default_backend, global_config.enable_parallel_encoding
    sgl.set_default_backend(backend)
    yield sgl
    global_config.default_backend, global_config.enable_parallel_encoding = previous


def test_marked_text_is_sent_as_linked_input_ids(picrag_server, layout):
    text = ("<|im_start|>user\nDocuments:\n\n" + "".join(chunk(body, title) for title, body in PASSAGES)
            + "Question: Which river reaches the Black Sea?<|im_end|>\n<|im_start|>assistant\n")
    input_ids, chunks = tokenize_marked(text, layout.encode)
    assert len(chunks) == 2
    sampling = {"temperature": 0, "max_new_tokens": 8}
    with picrag_server.client() as client:
        marked = client.post("/generate", json={"text": text, "sampling_params": sampling}).json()
        linked = client.post("/generate", json={"input_ids": input_ids, "sampling_params": sampling,
                                                "kv_hints": link_hints(DEFAULT_POLICY, chunks)}).json()
    assert marked["output_ids"] == linked["output_ids"]
    assert marked["meta_info"]["prompt_tokens"] == len(input_ids)
    counts = EngineReport.of(marked["meta_info"]).link
    assert counts.policy == DEFAULT_POLICY
    assert counts.chunk_hits + counts.chunk_misses == 2
    # legolink recomputes the first k (its default) tokens of each chunk and reuses the rest.
    k = POLICY_FAMILIES["legolink"].default_param
    assert counts.reused_tokens >= sum(max(0, end - start - k) for start, end in chunks)


def test_concate_and_append_route(picrag_server):
    with picrag_server.client() as client:
        ok = client.post("/concate_and_append_request", json={"src_rids": ["a", "b"], "dst_rid": "c"})
        bad = client.post("/concate_and_append_request", json={"src_rids": "a"})
    assert ok.status_code == 200 and ok.json() == {"success": True}
    assert bad.status_code == 400 and "src_rids" in bad.json()["error"]["message"]


def test_unmodified_fork_join_program_matches_text_concatenation(sgl):
    from sglang.lang.global_config import global_config

    @sgl.function
    def notes(s):
        s += "Rivers of Europe.\n"
        forks = s.fork(2)
        for fork, (title, body) in zip(forks, PASSAGES):
            fork += f"{title}: {body}\n"
        forks.join(mode="concate_and_append")
        s += "The river that reaches the Black Sea is the" + sgl.gen("river", max_tokens=3, temperature=0)

    global_config.enable_parallel_encoding = True  # DSL default: calls /concate_and_append_request
    kv_join = notes.run()
    global_config.enable_parallel_encoding = False  # the DSL appends the fork texts itself
    text_join = notes.run()
    assert kv_join.error() is None and text_join.error() is None
    assert kv_join.text() == text_join.text()
    assert kv_join["river"]


def test_dsl_program_with_chunks_reuses_them(sgl):
    @sgl.function
    def answer(s, question):
        with s.user():
            s += "Documents:\n\n"
            for title, body in PASSAGES:
                s += chunk(body, title)
            s += "Question: " + question
        s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))

    first = answer.run(question="Which river reaches the North Sea?")
    second = answer.run(question="Where does the Danube end?")
    for state in (first, second):
        counts = EngineReport.of(state.get_meta_info("answer")).link
        # The frontend compiled both passages before linking: both are found in the store.
        assert counts.policy == DEFAULT_POLICY and counts.chunk_hits == 2
        assert counts.reused_tokens > 0
    assert first["answer"] and second["answer"]
    assert strip_markers(first.text()).count("Document (Title: ") == 2
