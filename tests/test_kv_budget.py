"""Linked prompts admitted by the runtime's KV pool (rag_server/linking/kv_budget.py), and the
pipeline giving its share back in two steps."""

from __future__ import annotations

import asyncio
import time

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


def test_a_smaller_pool_admits_the_next_once_enough_is_back_and_a_larger_one_wakes_waiters():
    async def scenario():
        budget = KVBudget(1000)
        first = await budget.hold(600, [], [])
        budget.resize(500)  # an engine went: what runs keeps its share
        assert budget.used == 600
        waiting = asyncio.ensure_future(budget.hold(400, [], []))
        await asyncio.sleep(0)
        assert not waiting.done()
        budget.resize(1000)  # it is back
        second = await waiting
        budget.resize(500)
        first.release()  # 400 of 500 used: room for 100
        assert (await budget.hold(100, [], [])) and budget.used == 500
        with pytest.raises(ValueError, match="positive"):
            budget.resize(0)
        second.release()

    asyncio.run(scenario())


def test_behind_a_gateway_the_budget_follows_the_engines_it_routes_to(default_model_dir):
    """Engines die and come back behind SGLang's gateway: the frontend's health probe reads the
    gateway's count of engines it can route to, and linked prompts share only their pools (the
    soak that killed one of two engines ran the survivor with 7,968 of its 8,192 tokens locked)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from tests.fake_runtime import FakeRuntime
    from tests.inprocess_frontend import frontend, serving, wait_for

    class Gateway(FakeRuntime):
        live = 2

        async def _server_info(self, request: Request) -> Response:
            return JSONResponse({"context_length": 4096, "max_req_input_len": 4096, "max_total_num_tokens": 8192})

        async def _readiness(self, request: Request) -> Response:
            await self._count(request)
            return JSONResponse({"status": "ready" if self.live else "not ready", "healthy_workers": self.live,
                                 "total_workers": 2}, 200 if self.live else 503)

        def app(self):
            app = super().app()
            app.router.routes.append(Route("/readiness", self._readiness))
            return app

    gateway = Gateway(default_model_dir)
    with serving(gateway.app(), graceful_shutdown_s=1) as gateway_url:
        from rag_server.api.app import create_app

        app = create_app(gateway_url, health_interval_s=0.1, engine_urls=(gateway_url, gateway_url))
        with serving(app):
            budget = app.state.frontend.pipeline.budget
            assert budget.capacity == 2 * 8192
            gateway.live = 1
            wait_for(lambda: budget.capacity == 8192)
            gateway.live = 0  # none: one pool's worth stays, for the first engine back
            time.sleep(0.5)
            assert budget.capacity == 8192
            gateway.live = 2
            wait_for(lambda: budget.capacity == 2 * 8192)
    # One engine (no gateway): nothing reads /readiness.
    single = Gateway(default_model_dir)
    with serving(single.app(), graceful_shutdown_s=1) as url, frontend(url, health_interval_s=0.1):
        wait_for(lambda: single.calls["/health"] >= 3)
        assert single.calls["/readiness"] == 0
