"""The chunk cache inside SGLang's real runtime: reuse at any position, counted and exact."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from picrag_core.link_hints import MISS_REFUSAL, MISS_REFUSAL_STATUS, link_hints
from rag_server.bench.transparency import TOLERANCE
from tests.chunk_requests import counters, generate, logprobs_of, passages_of, picrag_meta, question_tokens

pytestmark = pytest.mark.server


def test_naive_chunk_at_position_zero_equals_vanilla_prefix_caching(picrag_server, layout, musique):
    row = musique[0]
    chunk = layout.passage_ids(passages_of(row, [0])[0])
    question = layout.question_ids(row["question"])
    ids = chunk + question
    with picrag_server.client() as client:
        naive = generate(client, ids, "naive", [(0, len(chunk))], logprobs=True)
        # Vanilla SGLang: the passage alone first, then the prompt, which hits it as a prefix.
        generate(client, chunk, max_new_tokens=1)
        vanilla = generate(client, ids, logprobs=True)
    assert vanilla["meta_info"]["cached_tokens"] == len(chunk)
    meta = picrag_meta(naive)
    assert meta.chunk_hits == 1 and meta.reused_tokens == len(chunk)
    assert meta.computed_tokens == len(question)
    assert naive["output_ids"] == vanilla["output_ids"]
    assert logprobs_of(naive) == pytest.approx(logprobs_of(vanilla), abs=1e-6)


def test_a_passage_without_its_separator_is_served_from_the_chunk_stored_with_it(picrag_server, layout, musique):
    """A link's tail: the passage's tokens less the blank line it is compiled with, linked with
    that blank line as the tail, hit the chunk stored with it (nothing compiled again), and at
    position 0 answer as vanilla prefix caching of the bare passage (a causal prefix's KV)."""
    row = musique[5]
    stored = layout.passage_ids(passages_of(row, [0])[0])
    question = layout.question_ids(row["question"])
    assert layout.tokenizer.decode(stored[-1:]).isspace(), "a passage is compiled with its blank line"
    bare, tail = stored[:-1], tuple(stored[-1:])
    with picrag_server.client() as client:
        generate(client, stored + question, "naive", [(0, len(stored))])
        before = counters(client)
        linked = generate(client, bare + question, "naive", [(0, len(bare))], logprobs=True, tail=tail)
        after = counters(client)
        client.post("/flush_cache").raise_for_status()  # the reference computes its own KV
        generate(client, bare, max_new_tokens=1)
        vanilla = generate(client, bare + question, logprobs=True)
    meta = picrag_meta(linked)
    assert meta.chunk_hits == 1 and meta.reused_tokens == len(bare)
    assert after["compile_chunk_misses"] == before["compile_chunk_misses"]
    assert vanilla["meta_info"]["cached_tokens"] == len(bare)
    assert linked["output_ids"] == vanilla["output_ids"]
    assert logprobs_of(linked) == pytest.approx(logprobs_of(vanilla), abs=1e-6)


def test_passage_reused_behind_other_prefixes_is_computed_once(picrag_server, layout, musique):
    shared, others = musique[1], musique[2]
    shared_passage = passages_of(shared, [0])
    first = layout.build(shared["question"], passages_of(others, [0]) + shared_passage)
    second = layout.build(shared["question"], passages_of(others, [1, 2]) + shared_passage)
    assert first.chunks[-1][0] != second.chunks[-1][0]  # the passage lands at another offset
    warm_up = layout.build("warm-up", passages_of(musique[3], [0]))
    with picrag_server.client() as client:
        generate(client, warm_up.input_ids, "naive", warm_up.chunks)  # caches the head
        before = counters(client)
        out_first = generate(client, first.input_ids, "naive", first.chunks)
        after_first = counters(client)
        out_second = generate(client, second.input_ids, "naive", second.chunks, logprobs=True)
        after_second = counters(client)
        client.post("/flush_cache").raise_for_status()
        cold_second = generate(client, second.input_ids, "naive", second.chunks, logprobs=True)

    question_len = len(first.input_ids) - first.chunks[-1][1]
    # First prompt: its two passages are compiled (computed alone), head reused.
    assert after_first["compile_chunk_misses"] - before["compile_chunk_misses"] == 2
    assert picrag_meta(out_first).computed_tokens == question_len
    # Second prompt: only its two new passages are computed; the head and the shared one are
    # stored (the frontend knows them and compiles only the new ones, or, while a miss elsewhere
    # pauses its skipping, sends them too and they hit).
    assert after_second["compile_chunk_misses"] - after_first["compile_chunk_misses"] == 2
    assert after_second["compile_chunk_hits"] - after_first["compile_chunk_hits"] in (0, 2)
    meta = picrag_meta(out_second)
    assert meta.chunk_hits == 3 and meta.chunk_misses == 0
    assert meta.computed_tokens == len(second.input_ids) - second.chunks[-1][1]
    assert meta.reused_tokens == second.chunks[-1][1]
    # The head (and any leading tokens shared with the first prompt's path) were already in
    # the tree; the rest of the three passages was re-positioned from the chunk store.
    grafted = after_second["grafted_tokens"] - after_first["grafted_tokens"]
    assert second.chunks[-1][1] - len(layout.head_ids) - 16 <= grafted <= second.chunks[-1][1] - len(layout.head_ids)
    # Determinism: with an empty cache the same request recomputes the same answer.
    assert picrag_meta(cold_second).chunk_hits == 3
    assert cold_second["output_ids"] == out_second["output_ids"]
    assert logprobs_of(cold_second) == pytest.approx(logprobs_of(out_second), abs=1e-5)


def test_full_and_prefix_policies_do_not_reuse_chunks(picrag_server, layout, musique):
    prompt = layout.build(musique[4]["question"], passages_of(musique[4], [0, 1]))
    with picrag_server.client() as client:
        generate(client, prompt.input_ids, "naive", prompt.chunks)
        full = generate(client, prompt.input_ids, "full", prompt.chunks)
        full_again = generate(client, prompt.input_ids, "full", prompt.chunks)
        prefix = generate(client, prompt.input_ids, "prefix", prompt.chunks)
        vanilla = generate(client, prompt.input_ids)
    for out in (full, full_again):
        assert picrag_meta(out).reused_tokens == 0
        assert picrag_meta(out).computed_tokens == len(prompt.input_ids)
    # prefix is vanilla SGLang: the same output, and naive's KV never leaks into its namespace.
    assert prefix["output_ids"] == vanilla["output_ids"] == full["output_ids"]


def test_concurrent_requests_sharing_chunks_match_serial_runs(picrag_server, layout, musique):
    row_a, row_b = musique[5], musique[6]
    pool = passages_of(row_a, [0, 1, 2]) + passages_of(row_b, [0, 1])
    orders = [[0, 1, 2], [2, 1, 0], [3, 0, 4], [4, 3], [1, 3, 2], [0, 4], [2, 0, 3, 1], [4, 2]]
    prompts = [
        layout.build((row_a if i % 2 else row_b)["question"], [pool[j] for j in order])
        for i, order in enumerate(orders)
    ]
    with picrag_server.client() as client:
        serial = [generate(client, p.input_ids, "naive", p.chunks)["output_ids"] for p in prompts]
        with ThreadPoolExecutor(max_workers=8) as workers:
            concurrent = list(workers.map(
                lambda p: generate(client, p.input_ids, "naive", p.chunks)["output_ids"], prompts
            ))
    assert concurrent == serial


def test_chunks_lost_after_compile_are_compiled_and_linked_again(picrag_server, layout, musique):
    """The frontend skips compiling pieces it compiled before; when the runtime has lost them
    (here: its cache flushed behind the frontend's back), the link reports misses and the
    frontend compiles and links again, streamed or not, before the client sees anything."""
    import httpx

    from rag_server.linking import sse

    row = musique[59]
    prompt = layout.build(row["question"], passages_of(row, [0, 1, 2]))
    with picrag_server.client() as client:
        first = generate(client, prompt.input_ids, "naive", prompt.chunks, logprobs=True)
        info = client.get("/get_server_info").json()
        runtime = f"http://{info['host']}:{info['port']}"

        def relinks() -> int:
            return picrag_server.log.read_text().count("compiling again")

        httpx.post(f"{runtime}/flush_cache", timeout=60).raise_for_status()
        before, engine_before = relinks(), counters(client)
        again = generate(client, prompt.input_ids, "naive", prompt.chunks, logprobs=True)
        engine_after = counters(client)
        assert relinks() == before + 1
        # The first link was refused as it arrived, before any compute: the engine served one
        # linked request, which computed only what follows the chunks.
        assert engine_after["link_refusals"] - engine_before["link_refusals"] == 1
        assert engine_after["requests"] - engine_before["requests"] == 1
        assert engine_after["computed_tokens"] - engine_before["computed_tokens"] == question_tokens(prompt)
        assert "picrag_frontend_relinks_total" in client.get("/picrag/metrics").text

        # Straight at the runtime: a link that asks to be refused on a miss gets SGLang's abort.
        httpx.post(f"{runtime}/flush_cache", timeout=60).raise_for_status()
        hints = link_hints("naive", list(prompt.chunks))
        hints["actions"][0]["payload"]["on_miss"] = "refuse"
        refused = httpx.post(f"{runtime}/generate", timeout=60, json={
            "input_ids": prompt.input_ids, "sampling_params": {"max_new_tokens": 4}, "kv_hints": hints})
        assert refused.status_code == MISS_REFUSAL_STATUS and MISS_REFUSAL in refused.text, refused.text

        # A relink pauses compile skipping; a flush through the frontend resumes it.
        client.post("/flush_cache").raise_for_status()
        generate(client, prompt.input_ids, "naive", prompt.chunks)
        httpx.post(f"{runtime}/flush_cache", timeout=60).raise_for_status()
        body = {"input_ids": prompt.input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8},
                "stream": True, "kv_hints": link_hints("naive", list(prompt.chunks))}
        with client.stream("POST", "/generate", json=body) as response:
            events = list(sse.events(response.iter_lines()))
        assert relinks() == before + 2
    for out in (again, events[-1]):
        assert picrag_meta(out).chunk_hits == 3 and picrag_meta(out).chunk_misses == 0
    assert again["output_ids"] == first["output_ids"]
    # The relink compiles every piece again (the first link may have found the head stored): a
    # batch of another shape, and on some CPUs (AVX-512 here) a GEMM's rounding depends on it, so
    # the answers agree to the transparency fuzzer's tolerance, not bit for bit.
    assert logprobs_of(again) == pytest.approx(logprobs_of(first), abs=TOLERANCE)
    assert events[-1]["output_ids"] == first["output_ids"]


def test_a_request_is_counted_before_its_answer_arrives(picrag_server, layout, musique):
    """The engine counts a linked request as it builds its last output, not when it releases the
    request's KV afterwards: a client that reads the counters as soon as its answer (streamed or
    not) is in finds it counted, every time, with no waiting."""
    row = musique[58]
    prompt = layout.build(row["question"], passages_of(row, [0, 1]))
    with picrag_server.client() as client:
        generate(client, prompt.input_ids, "naive", prompt.chunks)  # compiles the passages
        for stream in [False, True] * 6:
            before = counters(client)
            response = client.post("/generate", json={
                "input_ids": prompt.input_ids, "kv_hints": link_hints("naive", list(prompt.chunks)),
                "sampling_params": {"temperature": 0, "max_new_tokens": 2}, "stream": stream})
            assert response.status_code == 200 and response.text, response.text  # the whole answer is in
            after = counters(client)
            assert after["requests"] - before["requests"] == 1, f"stream={stream}"
