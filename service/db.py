"""Engines, sessions and schema upgrades.

Two backends are supported:

* **SQLite** (the embedded default). The API, the scheduler and the in-process
  runner share one file from several threads, so connections are made with
  ``check_same_thread=False``, a 30 s busy timeout, WAL journaling (readers do
  not block the writer) and foreign keys switched on. Every transaction starts
  with ``BEGIN IMMEDIATE``: it takes the write lock up front, so a transaction
  that reads and then writes waits for a busy writer (up to the timeout)
  instead of failing at once with "database is locked" when its read snapshot
  went stale. Sessions from :func:`read_only` (the API's GET requests) begin
  a plain deferred transaction instead: a snapshot that neither waits for the
  writer nor holds it up.
* **PostgreSQL** (scale-out). ``postgresql://`` URLs are served by the psycopg 3
  driver; pooled connections are pinged before use so a restarted server does
  not hand out dead ones. A worker's connections ask the server to end a session left
  idle inside a transaction for the heartbeat timeout
  (:func:`end_idle_transactions_after`): a worker cut off between a statement and its
  commit otherwise held that transaction's row locks for as long as the server kept the
  connection, and the scheduler waited on them.

Database errors that mean "cannot reach or use the store" are turned into
:class:`packtune.errors.StoreUnavailable` at one boundary, :func:`session_scope`.
:func:`retrying` runs a transaction again while that lasts (a server restart
takes seconds), for writes that must not be lost.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DatabaseError,
    DBAPIError,
    InterfaceError,
    NoSuchModuleError,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from packtune.errors import StoreUnavailable
from packtune.settings import ENV_PREFIX, SettingsError, get_settings
from packtune.tuning import RETRY_SECONDS, SQLITE_BUSY_TIMEOUT_S

T = TypeVar("T")
log = logging.getLogger(__name__)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def json_dumps(value: Any) -> str:
    """JSON for every JSON column: NaN and infinities become ``null``.

    JSON has no non-finite numbers; PostgreSQL refuses Python's ``NaN`` token
    while SQLite would store it, so a diverged loss reads back as ``None`` on
    both backends.
    """
    return json.dumps(_finite(value), allow_nan=False)


def normalise_url(url: str | URL) -> URL:
    """Parse ``url``, giving bare PostgreSQL URLs the psycopg 3 driver; one that does not
    parse (``host:notaport``) raises :class:`SettingsError` naming the setting."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise SettingsError(f"{ENV_PREFIX}DATABASE_URL: cannot use it: {exc}") from exc
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def _is_memory_sqlite(url: URL) -> bool:
    return url.database in (None, "", ":memory:") or "mode=memory" in str(url)


def missing_file_problem(url: str | URL) -> str | None:
    """Why ``url`` cannot be used by a process that does not create its database: it names
    a SQLite file that does not exist (connecting would create it, empty; a typo in the URL
    then looked like a database never migrated). None otherwise (other databases, in-memory
    ones, URI filenames, a file that exists)."""
    url = normalise_url(url)
    if url.get_backend_name() != "sqlite" or _is_memory_sqlite(url):
        return None
    database = str(url.database)
    if database.startswith("file:") or os.path.exists(database):
        return None
    return (
        f"the database file {database} does not exist (PACKTUNE_DATABASE_URL): run "
        "`packtune db upgrade` first to create it, or name the file `packtune serve` uses"
    )


def read_only_problem(url: str | URL) -> str | None:
    """Why a process that writes cannot use the SQLite file of ``url``: the file, or its
    folder (its journal is written beside it), is read-only. None otherwise (other
    databases, in-memory ones, URI filenames, a file not made yet)."""
    url = normalise_url(url)
    if url.get_backend_name() != "sqlite" or _is_memory_sqlite(url):
        return None
    database = str(url.database)
    if database.startswith("file:") or not os.path.exists(database):
        return None
    folder = os.path.dirname(os.path.abspath(database))
    for path in (database, folder):
        if not os.access(path, os.W_OK):
            return f"the database file {database} cannot be written ({path} is read-only)"
    return None


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Leave transactions to the "begin" hook below instead of the driver's
        # implicit BEGIN, so that it can be BEGIN IMMEDIATE.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA journal_mode=WAL")
            # In WAL mode NORMAL loses no committed transaction when a process dies, only
            # (the last ones) when the machine loses power; FULL fsyncs on every commit.
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        reads_only = conn.get_execution_options().get(READ_ONLY, False)
        conn.exec_driver_sql("BEGIN" if reads_only else "BEGIN IMMEDIATE")


#: the largest ``idle_in_transaction_session_timeout`` PostgreSQL takes (milliseconds)
LONGEST_IDLE_MS = 2**31 - 1


def _end_idle_transactions(engine: Engine, seconds: float) -> None:
    """Each of ``engine``'s PostgreSQL connections, as it is made, sets
    ``idle_in_transaction_session_timeout``: the server ends a session that sits inside a
    transaction for ``seconds`` without a statement, and with it the transaction's locks
    (over a value from the URL's ``options``, the role's or the database's)."""
    # (PostgreSQL takes at most 2^31 - 1 ms, ~24.8 days: a longer heartbeat timeout, which
    # settings allow, made every connection fail)
    milliseconds = min(max(1, math.ceil(seconds * 1000)), LONGEST_IDLE_MS)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        autocommit = dbapi_conn.autocommit
        dbapi_conn.autocommit = True  # a SET of its own, not the start of a transaction
        try:
            with dbapi_conn.cursor() as cursor:
                cursor.execute(f"SET idle_in_transaction_session_timeout = {milliseconds}")
        finally:
            dbapi_conn.autocommit = autocommit


#: seconds after which PostgreSQL ends this process's sessions idle inside a transaction
#: (:func:`end_idle_transactions_after`); None: the server's own setting
_idle_transaction_limit: float | None = None


def end_idle_transactions_after(seconds: float | None) -> None:
    """From now on, this process's PostgreSQL sessions that sit idle inside a transaction
    for ``seconds`` are ended by the server (None: never, the server's default). A worker
    sets its heartbeat timeout: a worker cut off between a statement and its commit (a
    network partition, a frozen host: no connection is closed) held the transaction's row
    locks for as long as the server kept the connection (hours of TCP keepalive), and the
    scheduler's tick, marking that worker dead, waited on them: nothing was scheduled. A
    worker silent that long counts as dead anyway; none of its transactions waits on
    training. Engines this process already made are disposed of (new connections take the
    setting)."""
    global _idle_transaction_limit
    _idle_transaction_limit = seconds
    dispose_engines()


def make_engine(url: str | URL, idle_transaction_limit: float | None = None) -> Engine:
    """An engine configured for ``url``'s backend (see the module docstring); a URL that
    cannot be used (unparsable, an unknown dialect, its driver not installed) raises
    :class:`SettingsError` naming ``PACKTUNE_DATABASE_URL``. ``idle_transaction_limit``:
    seconds after which PostgreSQL ends a session idle inside a transaction (see
    :func:`end_idle_transactions_after`; SQLite has no such sessions)."""
    try:
        engine = _make_engine(url)
    except (ArgumentError, NoSuchModuleError, ImportError) as exc:
        raise SettingsError(f"{ENV_PREFIX}DATABASE_URL: cannot use it: {exc}") from exc
    if idle_transaction_limit is not None and engine.dialect.name == "postgresql":
        _end_idle_transactions(engine, idle_transaction_limit)
    return engine


def _make_engine(url: str | URL) -> Engine:
    parsed = normalise_url(url)
    if parsed.get_backend_name() == "sqlite":
        kwargs: dict[str, Any] = {
            "connect_args": {"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S},
            "json_serializer": json_dumps,
        }
        if _is_memory_sqlite(parsed):
            # One shared connection, or every session would see its own empty database.
            kwargs["poolclass"] = StaticPool
        engine = create_engine(parsed, **kwargs)
        _configure_sqlite(engine)
        return engine
    return create_engine(parsed, pool_pre_ping=True, json_serializer=json_dumps)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (they are handed to callers)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


READ_ONLY = "packtune_read_only"
"""Execution option of :func:`read_only` engines: SQLite begins deferred, not IMMEDIATE."""


def read_only(factory: sessionmaker[Session]) -> sessionmaker[Session]:
    """Sessions like ``factory``'s, over the same pool, for transactions that only read.

    On SQLite they do not take the write lock (see the module docstring); a write in
    one may fail with "database is locked" rather than wait. On PostgreSQL they are
    the same as ``factory``'s.
    """
    engine = factory.kw["bind"]
    return sessionmaker(bind=engine.execution_options(**{READ_ONLY: True}), expire_on_commit=False)


_engines: dict[str, tuple[Engine, sessionmaker[Session]]] = {}
_engines_lock = threading.Lock()


def _cached(url: str) -> tuple[Engine, sessionmaker[Session]]:
    with _engines_lock:
        if url not in _engines:
            engine = make_engine(url, _idle_transaction_limit)
            _engines[url] = (engine, session_factory(engine))
        return _engines[url]


def get_engine() -> Engine:
    """The process-wide engine for the settings' ``database_url``."""
    return _cached(get_settings().database_url)[0]


def get_sessionmaker() -> sessionmaker[Session]:
    """The process-wide session factory for the settings' ``database_url``."""
    return _cached(get_settings().database_url)[1]


def dispose_engines() -> None:
    """Close and forget every cached engine (tests; a child process after fork)."""
    with _engines_lock:
        for engine, _ in _engines.values():
            engine.dispose()
        _engines.clear()


def _rollback_quietly(session: Session) -> None:
    try:
        session.rollback()
    except SQLAlchemyError:
        # The connection is gone; the original error is the one worth reporting.
        pass


#: what a database's own trouble raises: code above the data layer re-raises these instead of
#: taking them for a fault of what it was doing
DATABASE_ERRORS: tuple[type[BaseException], ...] = (SQLAlchemyError, StoreUnavailable, PoolTimeout)


#: SQLSTATE of a session the server ended for sitting idle inside a transaction
#: (:func:`end_idle_transactions_after`): psycopg raises it as an ``InternalError``
IDLE_SESSION_ENDED = "25P03"


def connection_lost(exc: DBAPIError) -> bool:
    """Whether ``exc`` says the connection is lost or unusable (not what the statement did)."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return getattr(exc.orig, "sqlstate", None) == IDLE_SESSION_ENDED


def unavailable(exc: DBAPIError) -> StoreUnavailable:
    """The error a lost or unusable connection becomes, with the driver's own words."""
    return StoreUnavailable(f"database unavailable: {exc.orig or exc}")


@contextmanager
def session_scope(factory: sessionmaker[Session] | None = None) -> Iterator[Session]:
    """A session that commits when the block ends and rolls back if it raises.

    Lost or unusable connections (``OperationalError``, ``InterfaceError``, a session
    the server ended: :func:`connection_lost`), raised in the block or at commit, become
    :class:`StoreUnavailable`; so does waiting in vain for a pooled connection (an
    overloaded process).
    """
    session = (factory or get_sessionmaker())()
    try:
        yield session
        session.commit()
    except DBAPIError as exc:
        _rollback_quietly(session)
        if connection_lost(exc):
            raise unavailable(exc) from exc
        raise
    except PoolTimeout as exc:
        _rollback_quietly(session)
        raise StoreUnavailable(f"database busy: no connection free: {exc}") from exc
    except BaseException:
        _rollback_quietly(session)
        raise
    finally:
        session.close()


def ping(factory: sessionmaker[Session] | None = None) -> None:
    """``select 1``: returns when the database answers, raises one of
    :data:`DATABASE_ERRORS` when it does not."""
    with session_scope(factory) as s:
        s.execute(text("select 1"))


def retrying(
    work: Callable[[Session], T],
    *,
    within: float = RETRY_SECONDS,
    factory: sessionmaker[Session] | None = None,
) -> T:
    """``work(session)`` in a transaction of its own, tried again while the store is unavailable.

    Each try is a new :func:`session_scope`, so ``work`` must give the same
    database when repeated (the store's writes are conditional or upserts).
    Waits grow from 0.25 s to 5 s; after ``within`` seconds the last
    :class:`StoreUnavailable` is raised.
    """
    deadline = time.monotonic() + within
    delay = 0.25
    while True:
        try:
            with session_scope(factory) as session:
                return work(session)
        except StoreUnavailable as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            log.warning("%s; trying again in %.2f s", exc, min(delay, left))
            time.sleep(min(delay, left))
            delay = min(2 * delay, 5.0)


def alembic_config(url: str | URL | None = None) -> Any:
    """The Alembic ``Config`` for the packaged migrations, pointed at ``url``.

    ``url`` defaults to the settings' ``database_url``. It travels in
    ``config.attributes`` rather than the ini file, so no ``%`` escaping applies.
    """
    from alembic.config import Config

    ini = resources.files("migrations").joinpath("alembic.ini")
    config = Config(str(ini))
    config.set_main_option("script_location", str(resources.files("migrations")))
    target = normalise_url(url if url is not None else get_settings().database_url)
    config.attributes["url"] = target
    return config


class _MigrationsOnly(logging.Filter):
    """Alembic's INFO lines but the migrations it runs (``Running upgrade 0005 -> 0006``):
    a start that migrates nothing says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or record.getMessage().startswith("Running ")


_QUIET = _MigrationsOnly()


def _quiet_alembic() -> None:
    """Alembic says the migrations it runs, nothing else of its own at INFO (call before
    importing it)."""
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    migration_log = logging.getLogger("alembic.runtime.migration")
    if _QUIET not in migration_log.filters:
        migration_log.addFilter(_QUIET)


def upgrade(url: str | URL | None = None) -> None:
    """Bring the database at ``url`` (default: the settings' URL) to the newest schema.

    Two processes starting at once on a new SQLite file (two `packtune run`, or one beside
    `packtune serve`) both migrated it, a step at a time (SQLite's DDL is not one
    transaction here), and the slower failed on the other's work ("duplicate column name",
    alembic's "expected to match one row"): on SQLite, a failure while another process
    moves the schema on is waited out, as long as it keeps moving."""
    _quiet_alembic()
    from alembic import command
    from alembic.util.exc import CommandError

    config = alembic_config(url)
    # PostgreSQL migrates in one transaction: a second upgrade waits on the first's locks
    sqlite = config.attributes["url"].get_backend_name() == "sqlite"
    while True:
        seen = _revision(config) if sqlite else None
        try:
            command.upgrade(config, "head")
            return
        except (OperationalError, InterfaceError, CommandError) as exc:
            if not (sqlite and _moved_on(config, seen)):
                if isinstance(exc, CommandError):
                    raise
                raise unavailable(exc) from exc
        except DatabaseError as exc:  # a file that is not SQLite's: the user's to fix, one line
            raise StoreUnavailable(f"database unusable: {exc.orig or exc}") from exc


def _revision(config: Any) -> str | None:
    """The database's schema revision now (None: none yet, or it cannot be read)."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(config.attributes["url"])
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except (OperationalError, InterfaceError, DatabaseError):
        return None
    finally:
        engine.dispose()


def _moved_on(config: Any, seen: str | None, wait_s: float = 1.0) -> bool:
    """Whether another process moves the schema on from ``seen`` (within ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        if _revision(config) != seen:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def schema_problem(url: str | URL | None = None, *, newer_ok: bool = False) -> str | None:
    """Why the database at ``url`` (default: the settings') is not at this packtune's
    schema, on one line naming the fix; None when it is. A scheduler or worker started on a
    database never migrated said ``no such table`` every half second, for ever.
    ``newer_ok``: a schema a newer packtune migrated to is no problem (the API of a replica
    not upgraded yet: migrations add, so what it reads is there)."""
    _quiet_alembic()
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    config = alembic_config(url)
    missing = missing_file_problem(config.attributes["url"])
    if missing is not None:
        return missing
    script = ScriptDirectory.from_config(config)
    engine = make_engine(config.attributes["url"])
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    except (OperationalError, InterfaceError) as exc:
        raise unavailable(exc) from exc
    except DatabaseError as exc:  # a file that is not SQLite's
        raise StoreUnavailable(f"database unusable: {exc.orig or exc}") from exc
    finally:
        engine.dispose()
    head = script.get_current_head()
    if current == head:
        return None
    where = config.attributes["url"].render_as_string(hide_password=True)
    if current is None:
        return f"the database {where} has no packtune tables: run `packtune db upgrade` first"
    known = {rev.revision for rev in script.walk_revisions()}
    if current not in known:
        if newer_ok:
            return None
        return (
            f"the database {where} is at schema {current}, written by a newer packtune "
            f"(this one knows up to {head}): upgrade packtune"
        )
    return (
        f"the database {where} is at schema {current}, this packtune needs {head}: "
        "run `packtune db upgrade`"
    )
