"""A small run of ``bench/load.py`` (20 clients x 20 GETs) against a live ``packtune serve``
while a study trains: every request answers 200. Timing is the benchmark's business."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from bench._study import start_serve
from bench.load import SMALL_STUDY, run_load, seed_big_study, stop
from packtune.errors import StoreUnavailable
from service.db import session_factory, session_scope, upgrade
from tests.support.processes import http

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, tuple[int, int, int]]]:
    """``packtune serve`` over a 1,000-trial study, with a small study training."""
    tmp = tmp_path_factory.mktemp("load")
    url = f"sqlite:///{tmp / 'packtune.db'}"
    upgrade(url)
    big, trials = seed_big_study(url, 1000)
    assert trials >= 1000
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACKTUNE_")}
    env.update(PACKTUNE_DATABASE_URL=url, PACKTUNE_CHECKPOINT_DIR=str(tmp / "ckpt"))
    proc, base = start_serve(env, tmp / "serve.log", timeout=60)
    try:
        small = http.post(f"{base}/api/studies", json=SMALL_STUDY, timeout=30).json()["id"]
        yield base, (big, small, trials)
    finally:
        stop(proc)


def test_twenty_clients_get_no_error(live: tuple[str, tuple[int, int, int]]) -> None:
    base, ids = live
    load = asyncio.run(run_load(base, ids, 20, 20, 0.05, 120))
    assert load.errors == []
    assert sum(len(v) for v in load.latencies.values()) == 400
    assert {"summary", "leaderboard", "trials page", "curves"} <= set(load.latencies)


def test_a_burst_of_eighty_clients_does_not_deadlock(
    live: tuple[str, tuple[int, int, int]],
) -> None:
    """More requests at once than the API has threads (40) and pooled connections (15):
    each is answered (it once waited for the 30 s pool timeout, then failed)."""
    base, ids = live
    load = asyncio.run(run_load(base, ids, 80, 3, 0.0, 120))
    assert load.errors == []
    assert sum(len(v) for v in load.latencies.values()) == 240


def test_only_loopback_is_loaded() -> None:
    with pytest.raises(ValueError, match="loopback"):
        asyncio.run(run_load("http://10.0.0.1:8000", (1, 2, 3), 1, 1, 0, 1))


def test_no_free_pooled_connection_is_503_not_500() -> None:
    """What a process overloaded with requests meets: StoreUnavailable, which the API maps
    to 503 with a detail."""
    engine = create_engine(
        f"sqlite:///{tempfile.mkdtemp()}/x.db", pool_size=1, max_overflow=0, pool_timeout=0.1
    )
    held = engine.connect()
    try:
        with pytest.raises(StoreUnavailable, match="no connection free"):
            with session_scope(session_factory(engine)) as s:
                s.execute(text("select 1"))
    finally:
        held.close()
        engine.dispose()
