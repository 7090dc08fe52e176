"""Shared fixtures: real PostgreSQL and Redis, failing (not skipping) under CI=true."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.services import POSTGRES_URL, REDIS_URL, unavailable


@pytest.fixture(scope="session")
def postgres_url() -> str:
    import sqlalchemy as sa

    engine = sa.create_engine(POSTGRES_URL)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
    except Exception as exc:  # noqa: BLE001 - any connection failure
        unavailable("PostgreSQL", exc)
    finally:
        engine.dispose()
    return POSTGRES_URL


@pytest.fixture
def fresh_postgres(postgres_url: str) -> Iterator[str]:
    """The URL of a database of its own on the PostgreSQL server, dropped afterwards."""
    import sqlalchemy as sa

    from service.db import dispose_engines

    name = f"packtune_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield (
            sa.engine.make_url(postgres_url)
            .set(database=name)
            .render_as_string(hide_password=False)
        )
    finally:
        dispose_engines()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001
        unavailable("Redis", exc)
    return REDIS_URL


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'packtune.db'}"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No PACKTUNE_ variables from the caller's shell leak into a test."""
    for key in list(os.environ):
        if key.startswith("PACKTUNE_") and not key.startswith("PACKTUNE_TEST_"):
            monkeypatch.delenv(key)
    from packtune.settings import get_settings

    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()


@pytest.fixture
def embedded_db(
    clean_env: pytest.MonkeyPatch, sqlite_url: str, tmp_path: Path
) -> Iterator[pytest.MonkeyPatch]:
    """Settings for in-process jobs: a migrated SQLite file, checkpoints in tmp, the CPU."""
    from packtune.settings import get_settings
    from service.db import dispose_engines, upgrade

    clean_env.setenv("PACKTUNE_DATABASE_URL", sqlite_url)
    clean_env.setenv("PACKTUNE_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    clean_env.setenv("PACKTUNE_DEVICE", "cpu")
    get_settings.cache_clear()
    dispose_engines()
    upgrade(sqlite_url)
    yield clean_env
    dispose_engines()


@pytest.fixture(scope="module", autouse=True)
def _heap_frozen_between_modules() -> None:
    """Freeze what earlier test modules left alive out of the collector's way.

    The probe collects garbage before each array size (``worker.memory.probe``); in a
    process that ran many modules (a pytest-xdist worker) each full collection walked all
    their leftovers: 0.55 s a collection, five a pack, after ``test_scheduler.py`` and
    ``test_compiled.py``, which made ``test_jobs.py`` 165 CPU-s against 27 with this.
    Objects alive at a module's start are the suite's long-lived ones (its module fixtures
    are torn down by then); what the module makes stays collectable. A worker and a
    runner do the same once, at their start (``_settle_heap``, ``settle_heap``).
    """
    from service.runtime import settle_heap

    settle_heap()
