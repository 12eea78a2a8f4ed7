"""Linked prompts admitted by the runtime's KV pool (rag_server/linking/kv_budget.py), and the
pipeline giving its share back in two steps."""

from __future__ import annotations

import asyncio

import pytest

from rag_server.linking.kv_budget import KVBudget, pool_tokens


def test_a_prompt_waits_for_room_in_arrival_order_and_shared_pieces_count_once():
    async def scenario():
        budget = KVBudget(1000)
        first = await budget.hold(300, ["a", "b"], [200, 200])  # 700 used
        # The same pieces again cost only a row: 300 more fits.
        second = await budget.hold(300, ["a", "b"], [200, 200])
        assert budget.used == 1000
        waiting = asyncio.ensure_future(budget.hold(100, ["c"], [50]))
        later = asyncio.ensure_future(budget.hold(10, [], []))  # small, but after `waiting`: no overtaking
        await asyncio.sleep(0)
        assert not waiting.done() and not later.done() and budget.waiting == 2
        first.grafted()  # pieces still held by `second`: nothing freed
        await asyncio.sleep(0)
        assert not waiting.done() and budget.used == 1000
        first.release()  # its row: 300 freed, 150 needed
        third = await waiting
        assert (await later) and budget.used == 700 + 150 + 10
        for hold in (second, third, await later):
            hold.release()
            hold.release()  # once only
        assert budget.used == 0 and budget.waiting == 0

    asyncio.run(scenario())


def test_a_prompt_larger_than_the_pool_runs_alone_and_a_cancelled_waiter_leaves_no_trace():
    async def scenario():
        budget = KVBudget(100)
        big = await budget.hold(500, ["x"], [400])  # alone: admitted
        small = asyncio.ensure_future(budget.hold(10, [], []))
        await asyncio.sleep(0)
        assert not small.done()
        small.cancel()
        with pytest.raises(asyncio.CancelledError):
            await small
        assert budget.waiting == 0
        big.release()
        assert budget.used == 0
        assert (await budget.hold(10, [], [])).row == 10

    asyncio.run(scenario())


def test_the_pool_comes_from_every_data_parallel_rank():
    assert pool_tokens({"max_total_num_tokens": 8192, "dp_size": 2}) == 16384
    assert pool_tokens({"max_total_num_tokens": 8192}) == 8192
    assert pool_tokens({}) is None
    with pytest.raises(ValueError):
        KVBudget(0)


def test_the_pipeline_holds_a_prompts_share_until_its_stream_ends():
    """Two linked prompts whose pieces and rows fit the pool one at a time: the second is not
    compiled before the first's answer is closed; the first's pieces go back at its first event."""
    import json

    import httpx

    from picrag_core.link_hints import LinkRequest
    from rag_server.linking.chunk_compiler import ChunkCompiler
    from rag_server.linking.pipeline import LinkPipeline

    sent: list[tuple[str, int]] = []

    def runtime(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        action = body["kv_hints"]["actions"][0]["action_type"]
        ids = body["input_ids"]
        sent.append((action, ids[-1][0] if action == "picrag.compile" else ids[2]))
        if action == "picrag.compile":
            return httpx.Response(200, json=[{"meta_info": {}} for _ in ids])
        async def events():
            yield b'data: {"text": "a", "meta_info": {}}\n\n'
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    first_prompt, second_prompt = [1, 2, 10, 11, 12, 9], [1, 2, 20, 21, 22, 9]
    link = LinkRequest.of("naive", [(2, 5)])
    fields = {"sampling_params": {"max_new_tokens": 4}, "stream": True}
    row, pieces = len(first_prompt) + 4, 2 + 3  # head and passage

    async def scenario():
        budget = KVBudget(row + pieces)
        async with httpx.AsyncClient(base_url="http://runtime", transport=httpx.MockTransport(runtime)) as client:
            pipeline = LinkPipeline(client, ChunkCompiler(client), budget=budget)
            first = await pipeline.generate(first_prompt, link, fields)
            assert budget.used == row  # the pieces went back with the first event
            second = asyncio.ensure_future(pipeline.generate(second_prompt, link, fields))
            await asyncio.sleep(0.05)
            assert not second.done() and [passage for _, passage in sent] == [10, 10]
            await first.aclose()
            linked = await second
            assert [passage for _, passage in sent] == [10, 10, 20, 20]
            await linked.aclose()
            assert budget.used == 0

    asyncio.run(scenario())


@pytest.mark.server
def test_the_frontend_admits_links_by_the_runtimes_pool(picrag_server):
    import httpx

    with httpx.Client(base_url=picrag_server.runtime_url, timeout=30) as runtime:
        assert pool_tokens(runtime.get("/get_server_info").json()) == 16384  # the test server's --max-total-tokens
    assert "reports no KV pool size" not in picrag_server.log.read_text()
