"""The API's read micro-cache: shared answers within the ttl, single flight, reads own writes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request
from fastapi.testclient import TestClient

from packtune.settings import get_settings
from service import store
from service.api.app import create_app
from service.api.cache import ReadCache
from service.db import session_scope, upgrade


def counting_app(ttl: float) -> tuple[ReadCache, dict[str, int]]:
    """A small app whose endpoints count their calls, behind the cache."""
    app = FastAPI()
    calls: dict[str, int] = {"item": 0, "slow": 0, "missing": 0, "write": 0}

    @app.get("/api/studies/item")
    async def item(q: str = "") -> dict[str, Any]:
        calls["item"] += 1
        return {"n": calls["item"], "q": q}

    @app.get("/api/studies/slow")
    async def slow() -> dict[str, Any]:
        calls["slow"] += 1
        await asyncio.sleep(0.2)
        return {"n": calls["slow"]}

    @app.get("/api/studies/missing")
    async def missing() -> None:
        calls["missing"] += 1
        raise HTTPException(404, "no such thing")

    @app.post("/api/studies/item")
    async def write() -> dict[str, Any]:
        calls["write"] += 1
        return {}

    @app.get("/other")
    async def other() -> dict[str, Any]:
        calls["item"] += 1
        return {"n": calls["item"]}

    return ReadCache(app, ttl=ttl), calls


async def get(cache: ReadCache, path: str, method: str = "GET") -> httpx.Response:
    transport = httpx.ASGITransport(app=cache)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path)


def test_identical_gets_within_the_ttl_share_one_answer() -> None:
    cache, calls = counting_app(ttl=0.3)

    async def scenario() -> None:
        first = await get(cache, "/api/studies/item?q=a")
        again = await get(cache, "/api/studies/item?q=a")
        assert first.json() == again.json() == {"n": 1, "q": "a"}
        assert again.headers["content-type"] == "application/json"
        other_query = await get(cache, "/api/studies/item?q=b")
        assert other_query.json() == {"n": 2, "q": "b"}
        await asyncio.sleep(0.35)
        assert (await get(cache, "/api/studies/item?q=a")).json() == {"n": 3, "q": "a"}

    asyncio.run(scenario())
    assert calls["item"] == 3


def test_concurrent_identical_gets_compute_once() -> None:
    cache, calls = counting_app(ttl=5)

    async def scenario() -> list[httpx.Response]:
        return await asyncio.gather(*(get(cache, "/api/studies/slow") for _ in range(20)))

    responses = asyncio.run(scenario())
    assert [r.json() for r in responses] == [{"n": 1}] * 20
    assert calls["slow"] == 1


def test_errors_other_paths_and_zero_ttl_are_not_cached() -> None:
    cache, calls = counting_app(ttl=5)

    async def scenario() -> None:
        for _ in range(2):
            assert (await get(cache, "/api/studies/missing")).status_code == 404
            await get(cache, "/other")

    asyncio.run(scenario())
    assert calls["missing"] == 2 and calls["item"] == 2

    off, calls = counting_app(ttl=0)
    asyncio.run(get(off, "/api/studies/item"))
    asyncio.run(get(off, "/api/studies/item"))
    assert calls["item"] == 2


def test_a_write_empties_the_cache() -> None:
    cache, calls = counting_app(ttl=5)

    async def scenario() -> None:
        assert (await get(cache, "/api/studies/item")).json()["n"] == 1
        await get(cache, "/api/studies/item", method="POST")
        assert (await get(cache, "/api/studies/item")).json()["n"] == 2

    asyncio.run(scenario())
    assert calls == {"item": 2, "slow": 0, "missing": 0, "write": 1}


@pytest.fixture
def client(clean_env: pytest.MonkeyPatch, sqlite_url: str) -> Iterator[TestClient]:
    clean_env.setenv("PACKTUNE_DATABASE_URL", sqlite_url)
    clean_env.setenv("PACKTUNE_READ_CACHE_SECONDS", "30")
    get_settings.cache_clear()
    upgrade(sqlite_url)
    with TestClient(create_app()) as c:
        yield c
    get_settings.cache_clear()


SPEC = {
    "name": "cached",
    "workload": "digits-mlp",
    "space": {"lr": {"type": "loguniform", "low": 0.001, "high": 0.1}},
    "hyperband": {"max_resource": 9, "eta": 3},
}


def test_the_api_reads_its_own_writes_and_caches_other_writers(client: TestClient) -> None:
    created = client.post("/api/studies", json=SPEC).json()
    path = f"/api/studies/{created['id']}"
    assert client.get(path).json()["status"] == "pending"
    # Through the API: the next read sees it at once.
    assert client.post(f"{path}/cancel").json()["status"] == "cancelled"
    assert client.get(path).json()["status"] == "cancelled"
    # Another writer (the scheduler, a worker) is seen once the entry expires (30 s here).
    with session_scope(client.app.state.sessionmaker) as s:  # type: ignore[attr-defined]
        store.get_study(s, created["id"]).error = "written by the scheduler"
    assert client.get(path).json()["error"] is None
    assert client.get(f"{path}?fresh=1").json()["error"] == "written by the scheduler"


def test_a_write_drops_only_what_it_may_change() -> None:
    """Creating a study drops the list of studies, other studies' answers stay; a write under
    /api/studies/{id} drops every study's answers (each carries its fair share of the
    device, which that study's priority, owner or status changes); so does a write
    elsewhere."""
    app = FastAPI()
    calls: dict[str, int] = {}

    @app.get("/api/studies")
    @app.get("/api/studies/{study}")
    @app.get("/api/studies/{study}/trials")
    async def read(request: Request) -> dict[str, int]:
        calls[request.url.path] = calls.get(request.url.path, 0) + 1
        return {"n": calls[request.url.path]}

    @app.post("/api/studies")
    @app.post("/api/studies/{study}/cancel")
    @app.post("/elsewhere")
    async def write() -> dict[str, Any]:
        return {}

    cache = ReadCache(app, ttl=30)
    paths = ["/api/studies", "/api/studies/1", "/api/studies/1/trials", "/api/studies/12"]

    async def counts() -> list[int]:
        return [(await get(cache, path)).json()["n"] for path in paths]

    async def scenario() -> None:
        assert await counts() == [1, 1, 1, 1]
        await get(cache, "/api/studies", method="POST")
        assert await counts() == [2, 1, 1, 1]  # a new study: only the list
        await get(cache, "/api/studies/1/cancel", method="POST")
        assert await counts() == [3, 2, 2, 2]  # study 12's share changed too
        await get(cache, "/elsewhere", method="POST")
        assert await counts() == [4, 3, 3, 3]

    asyncio.run(scenario())


def test_gets_waiting_on_a_failed_answer_all_get_one() -> None:
    """Two GETs that waited for an answer that failed both compute it again; a third one
    arriving meanwhile waits for the latest of those and is answered too (it once waited for
    ever: the first of the two to finish unregistered the other's computation)."""
    app = FastAPI()
    calls = {"n": 0}

    @app.get("/api/studies/flaky")
    async def flaky() -> dict[str, int]:
        calls["n"] += 1
        n = calls["n"]
        await asyncio.sleep(0.1)
        if n == 1:
            raise HTTPException(503, "not yet")
        return {"n": n}

    cache = ReadCache(app, ttl=30)

    async def late() -> httpx.Response:
        await asyncio.sleep(0.15)
        return await get(cache, "/api/studies/flaky")

    async def scenario() -> list[httpx.Response]:
        first = [get(cache, "/api/studies/flaky") for _ in range(3)]
        return await asyncio.wait_for(asyncio.gather(*first, late()), timeout=5)

    statuses = [r.status_code for r in asyncio.run(scenario())]
    assert statuses == [503, 200, 200, 200]
    assert calls["n"] == 3
