"""Read-only sessions on SQLite do not wait for, or hold up, a writer."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from sqlalchemy import select, text

from packtune.errors import StoreUnavailable
from service import store
from service.db import make_engine, read_only, session_factory, session_scope, upgrade
from service.models import Study


def test_a_read_only_session_reads_while_a_writer_holds_the_lock(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    factory = session_factory(engine)
    with session_scope(factory) as s:
        store.create_study(s, name="before", workload="digits-mlp", spec={}, seed=0)

    writing, release = threading.Event(), threading.Event()

    def writer() -> None:
        with session_scope(factory) as s:  # BEGIN IMMEDIATE: holds the write lock
            store.create_study(s, name="during", workload="digits-mlp", spec={}, seed=0)
            s.flush()
            writing.set()
            release.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert writing.wait(10)
        started = time.monotonic()
        with session_scope(read_only(factory)) as s:
            names = list(s.scalars(select(Study.name)))
        assert time.monotonic() - started < 1.0  # did not wait for the writer's commit
        assert names == ["before"]  # its snapshot: the uncommitted study is not there
        # A session of the ordinary kind waits for the lock instead (here: past a short timeout).
        raw = sqlite3.connect(engine.url.database, timeout=0.2)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            raw.execute("BEGIN IMMEDIATE")
        raw.close()
    finally:
        release.set()
        thread.join()
    with session_scope(read_only(factory)) as s:
        assert sorted(s.scalars(select(Study.name))) == ["before", "during"]
        # Writing in a read-only session is possible when nobody else writes...
        s.execute(text("UPDATE studies SET name = 'renamed' WHERE name = 'before'"))
    engine.dispose()


def test_a_write_in_a_read_only_session_fails_rather_than_waits(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    factory = session_factory(engine)
    raw = sqlite3.connect(engine.url.database)
    raw.execute("PRAGMA busy_timeout=100")
    with session_scope(factory) as s:
        store.create_study(s, name="x", workload="digits-mlp", spec={}, seed=0)
    with pytest.raises(StoreUnavailable), session_scope(read_only(factory)) as s:
        s.scalars(select(Study.name)).all()  # the snapshot starts here
        raw.execute("BEGIN IMMEDIATE")
        raw.execute("UPDATE studies SET name = 'y'")
        raw.execute("COMMIT")  # the snapshot is now stale: upgrading it to a writer fails
        s.execute(text("UPDATE studies SET name = 'z'"))
    raw.close()
    engine.dispose()
