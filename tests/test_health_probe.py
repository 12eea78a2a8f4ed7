"""`/health` answers from the frontend's own view: the last background probe of the runtime. A
flood of `/health` reaches the runtime not at all, and cannot take the connections a real
request needs. The runtime is a fake (tests/fake_runtime.py) that counts its calls."""

from __future__ import annotations

import asyncio

import httpx

from rag_server.api.app import create_app
from rag_server.api.health import HealthMonitor
from rag_server.api.upstream import MAX_CONNECTIONS
from tests.fake_runtime import fake_runtime
from tests.inprocess_frontend import frontend, serving, wait_for

FLOOD = MAX_CONNECTIONS + 50  # more than the frontend's connections to the runtime


def test_health_calls_never_reach_the_runtime(default_model_dir):
    # An interval longer than the test: the probe at start-up is the only one.
    with fake_runtime(default_model_dir) as (fake, runtime_url), \
            frontend(runtime_url, health_interval_s=3600) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        answers = [client.get("/health") for _ in range(200)]
        probes = fake.calls["/health"]
    assert {a.status_code for a in answers} == {200}
    assert answers[0].json()["status"] == "ok"
    assert probes == 1


def test_health_reports_the_last_probe(default_model_dir):
    with fake_runtime(default_model_dir) as (fake, runtime_url), \
            frontend(runtime_url, health_interval_s=0.1) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        fake.health_status = 503
        wait_for(lambda: client.get("/health").status_code == 503)
        probes = fake.calls["/health"]
        body = client.get("/health").json()
        fake.health_status = 200
        wait_for(lambda: client.get("/health").status_code == 200)
    assert body["status"] == "runtime unhealthy" and "503" in body["error"]
    assert probes >= 2  # probed in the background, not by the calls above


def test_hung_runtime_probe_times_out_into_503(default_model_dir):
    with fake_runtime(default_model_dir) as (fake, runtime_url):
        app = create_app(runtime_url)
        app.state.health = HealthMonitor(runtime_url, interval_s=0.1, probe_timeout_s=0.5)
        with serving(app) as url, httpx.Client(base_url=url, timeout=60) as client:
            assert client.get("/health").status_code == 200
            fake.health_open.clear()
            wait_for(lambda: client.get("/health").status_code == 503)
            body = client.get("/health").json()
            fake.health_open.set()
    assert body["status"] == "runtime unhealthy" and "unreachable" in body["error"], body


def test_health_flood_does_not_block_a_real_request(default_model_dir):
    async def flood_and_request(url: str, fake) -> tuple[httpx.Response, list[httpx.Response], int]:
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=None)) as client:
            flood = [asyncio.create_task(client.get("/health")) for _ in range(FLOOD)]
            await asyncio.wait(flood, timeout=10)  # the flood is answered (passed on, it would hang)
            real = await client.post("/generate", json={"text": "hello"})
            probes = fake.calls["/health"]
            fake.health_open.set()
            return real, await asyncio.gather(*flood), probes

    with fake_runtime(default_model_dir) as (fake, runtime_url), \
            frontend(runtime_url, health_interval_s=0.1) as url:
        # The runtime's /health hangs from now on: a probe waits on it, as would any /health
        # that the frontend passed on.
        fake.health_open.clear()
        real, flood, probes = asyncio.run(flood_and_request(url, fake))
    assert real.status_code == 200 and real.json()["text"] == "ok"
    # Every /health answered from the last probe, none waiting on the runtime (passed on, they
    # would hold every connection until their timeout and then fail).
    assert {r.status_code for r in flood} == {200}
    assert probes <= 2  # the probe at start-up, and the one waiting


def test_a_dead_runtime_is_reported_at_once():
    monitor = HealthMonitor("http://127.0.0.1:1")
    assert monitor.report() == (503, {"status": "starting"})
    monitor.mark_dead("its scheduler process 123 exited")
    assert monitor.report() == (503, {"status": "runtime dead", "error": "its scheduler process 123 exited"})


def test_a_runtime_closing_idle_connections_stays_healthy():
    """A server that drops a kept-alive connection as the next request arrives (the race when
    its idle timeout equals the probe interval) must not read as a runtime down."""

    async def scenario() -> list[bool]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")  # a second request on this connection: dropped unanswered
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        monitor = HealthMonitor(f"http://127.0.0.1:{port}", interval_s=3600)
        await monitor.start()
        results = [(await monitor.probe()).ok for _ in range(3)]
        await monitor.aclose()
        server.close()
        return results

    assert asyncio.run(scenario()) == [True, True, True]
