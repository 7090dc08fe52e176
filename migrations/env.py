"""Alembic environment: which database, and which metadata to compare against.

The URL comes from, in order: ``config.attributes["url"]`` (set by
:func:`service.db.upgrade`), ``sqlalchemy.url`` in the Alembic config, and
finally the settings' ``database_url``. Connections are made through
:func:`service.db.make_engine` so SQLite gets the same pragmas as the service.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import URL, Connection

from packtune.settings import get_settings
from service.db import make_engine, normalise_url
from service.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> URL:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    return normalise_url(url or get_settings().database_url)


def _options(url: URL) -> dict[str, object]:
    # SQLite cannot ALTER most things: later migrations copy-and-move tables.
    batch = url.get_backend_name() == "sqlite"
    return {"target_metadata": target_metadata, "render_as_batch": batch}


def run_offline() -> None:
    """Write the SQL to stdout instead of running it (``alembic upgrade --sql``)."""
    url = _url()
    context.configure(url=url, literal_binds=True, **_options(url))
    with context.begin_transaction():
        context.run_migrations()


def _foreign_keys(connection: Connection, on: bool) -> None:
    """SQLite's foreign key enforcement for this connection, set outside any transaction
    (SQLite ignores the pragma inside one)."""
    driver = connection.connection.driver_connection
    assert driver is not None
    driver.execute(f"PRAGMA foreign_keys={'ON' if on else 'OFF'}")


def run_online() -> None:
    url = _url()
    sqlite = url.get_backend_name() == "sqlite"
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            # A batch migration copies a table and drops the old one; with foreign keys on,
            # the drop would delete every row referring to it (ON DELETE CASCADE). Off while
            # migrating, and checked before the commit instead.
            if sqlite:
                _foreign_keys(connection, on=False)
            try:
                context.configure(connection=connection, **_options(url))
                with context.begin_transaction():
                    context.run_migrations()
                    if sqlite:
                        broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
                        if broken:
                            raise RuntimeError(
                                f"rows referring to no row after migrating: {broken}"
                            )
            finally:
                if sqlite:
                    _foreign_keys(connection, on=True)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
