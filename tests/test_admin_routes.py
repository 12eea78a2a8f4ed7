"""Admin routes (/flush_cache, /abort_request) act on every client's requests and the shared
cache: with an admin key they need it (an API key is refused), without one they answer loopback
clients only. The runtime is a fake (tests/fake_runtime.py) that counts the calls reaching it."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import httpx
import pytest
from fastapi.responses import JSONResponse

from rag_server.api.app import create_app
from rag_server.api.auth import ADMIN_PATHS, AccessGuard
from tests.fake_runtime import fake_runtime
from tests.inprocess_frontend import frontend

API_KEY = "ordinary-key"
ADMIN_KEY = "admin-key"
ABORT = {"rid": "someone-elses-request"}


def sglang_admin_paths() -> set[str]:
    """The paths of SGLang's HTTP server whose handlers it marks admin (`@auth_level(AuthLevel.ADMIN_*)`)."""
    import sglang

    source = Path(sglang.__file__).parent / "srt" / "entrypoints" / "http_server.py"
    paths = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = [d for d in node.decorator_list if isinstance(d, ast.Call)]
        if not any(ast.unparse(d).startswith("auth_level(AuthLevel.ADMIN") for d in decorators):
            continue
        for d in decorators:
            if isinstance(d.func, ast.Attribute) and d.func.attr in {"api_route", "get", "post", "put", "delete"} \
                    and d.args and isinstance(d.args[0], ast.Constant):
                paths.add(d.args[0].value)
    return paths


def frontend_paths() -> set[str]:
    app = create_app("http://127.0.0.1:1")
    routes = [r for included in app.routes for r in getattr(getattr(included, "original_router", None), "routes",
                                                            [included])]
    return {r.path for r in routes}


def test_admin_paths_are_sglangs_admin_routes_that_the_frontend_serves():
    sglang_admin = sglang_admin_paths()
    assert {"/flush_cache", "/abort_request"} <= sglang_admin  # the parse found SGLang's marks
    assert ADMIN_PATHS == sglang_admin & frontend_paths()


def test_without_admin_key_admin_routes_answer_loopback_clients_only(default_model_dir):
    with fake_runtime(default_model_dir) as (fake, runtime_url), frontend(runtime_url) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        local = [client.post("/flush_cache"), client.post("/abort_request", json=ABORT)]
        # A reverse proxy on this machine forwards other machines' clients: not local.
        proxied = [client.post("/flush_cache", headers={"X-Forwarded-For": "203.0.113.9"}),
                   client.post("/abort_request", json=ABORT, headers={"Forwarded": "for=203.0.113.9"}),
                   client.post("/abort_request", json=ABORT, headers={"X-Real-IP": "203.0.113.9"})]
        ordinary = client.post("/generate", json={"text": "hello"}, headers={"X-Forwarded-For": "203.0.113.9"})
    assert [r.status_code for r in local] == [200, 200]
    assert [r.status_code for r in proxied] == [403, 403, 403], [r.text for r in proxied]
    assert all("--admin-api-key" in r.json()["detail"] for r in proxied)
    assert ordinary.status_code == 200
    assert (fake.calls["/flush_cache"], fake.calls["/abort_request"]) == (1, 1)  # the local ones only


async def _ok(scope, receive, send):
    await JSONResponse({"ok": True})(scope, receive, send)


@pytest.mark.parametrize(("host", "allowed"), [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
                                               ("10.1.2.3", False), ("203.0.113.9", False), ("2001:db8::1", False),
                                               ("testclient", False)])
def test_loopback_rule_by_client_address(host, allowed):
    async def statuses() -> tuple[set[int], int]:
        transport = httpx.ASGITransport(app=AccessGuard(_ok), client=(host, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://picrag") as client:
            admin = {(await client.post(path)).status_code for path in sorted(ADMIN_PATHS)}
            return admin, (await client.post("/generate")).status_code

    admin, ordinary = asyncio.run(statuses())
    assert admin == ({200} if allowed else {403})
    assert ordinary == 200


def test_with_admin_key_only_the_admin_key_opens_admin_routes(default_model_dir):
    with fake_runtime(default_model_dir) as (fake, runtime_url), \
            frontend(runtime_url, api_key=API_KEY, admin_api_key=ADMIN_KEY) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        ordinary_key = [client.post("/abort_request", json=ABORT, headers={"Authorization": f"Bearer {API_KEY}"}),
                        client.post("/flush_cache", headers={"X-API-Key": API_KEY})]
        no_key = [client.post("/abort_request", json=ABORT),  # loopback: no exception once a key is set
                  client.post("/flush_cache", headers={"Authorization": "Bearer wrong"})]
        refused_calls = (fake.calls["/flush_cache"], fake.calls["/abort_request"])
        admin = [client.post("/abort_request", json=ABORT, headers={"Authorization": f"Bearer {ADMIN_KEY}"}),
                 client.post("/flush_cache", headers={"X-API-Key": ADMIN_KEY})]
        # The admin key opens the ordinary routes too; the API key still does.
        info = [client.get("/get_model_info", headers={"Authorization": f"Bearer {key}"}).status_code
                for key in (ADMIN_KEY, API_KEY)]
    assert [r.status_code for r in ordinary_key] == [403, 403], [r.text for r in ordinary_key]
    assert [r.status_code for r in no_key] == [401, 401]
    assert all(ADMIN_KEY not in r.text and API_KEY not in r.text for r in ordinary_key + no_key)
    assert refused_calls == (0, 0)
    assert [r.status_code for r in admin] == [200, 200]
    assert (fake.calls["/flush_cache"], fake.calls["/abort_request"]) == (1, 1)
    assert fake.bodies["/abort_request"] == b'{"rid":"someone-elses-request"}'
    assert info == [200, 200]


def test_admin_key_alone_leaves_ordinary_routes_open(default_model_dir):
    with fake_runtime(default_model_dir) as (fake, runtime_url), \
            frontend(runtime_url, admin_api_key=ADMIN_KEY) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        ordinary = client.post("/generate", json={"text": "hello"}).status_code
        admin = [client.post("/flush_cache").status_code,
                 client.post("/flush_cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code]
    assert ordinary == 200
    assert admin == [401, 200]
    assert fake.calls["/flush_cache"] == 1


def test_keys_must_differ_and_not_be_empty():
    with pytest.raises(ValueError):
        AccessGuard(_ok, api_key="same", admin_api_key="same")
    with pytest.raises(ValueError):
        AccessGuard(_ok, admin_api_key="")


def test_serve_admin_key_flag():
    from rag_server.cli import build_parser

    assert build_parser().parse_args(["serve", "--admin-api-key", ADMIN_KEY]).admin_api_key == ADMIN_KEY
    assert build_parser().parse_args(["serve"]).admin_api_key is None
