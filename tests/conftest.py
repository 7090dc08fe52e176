"""Shared fixtures: real PostgreSQL and Redis, failing (not skipping) under CI=true."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

POSTGRES_URL = os.environ.get(
    "PACKTUNE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("PACKTUNE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def unavailable(what: str, exc: BaseException) -> None:
    """A server a test needs is missing: fail under CI, skip on a laptop."""
    message = f"{what} is not reachable: {exc}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


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
    from service.settings import get_settings

    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()
