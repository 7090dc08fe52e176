"""Ids of studies, trials, packs and workload checks are never reused on SQLite.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28

SQLite gives a new row the largest id of its table plus one: once the newest study was
deleted, the next one got its id, and a script, a retried ``packtune delete`` or an open
dashboard tab holding that id acted on an unrelated study (its trials' and packs' ids were
reused the same way). ``AUTOINCREMENT`` tables never reuse an id. SQLite cannot alter a
table into one, so each is copied into a new table (batch mode; ``migrations/env.py``
turns foreign keys off while it does, so nothing referring to them is deleted). Nothing
changes on PostgreSQL, whose sequences never go back.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("studies", "trials", "packs", "workload_checks")


def _recreate(autoincrement: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for table in TABLES:
        with op.batch_alter_table(
            table, recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}
        ):
            pass


def upgrade() -> None:
    _recreate(True)


def downgrade() -> None:
    _recreate(False)
