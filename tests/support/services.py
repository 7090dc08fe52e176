"""Where the tests' servers are, and what a test does when one is missing."""

from __future__ import annotations

import os

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
