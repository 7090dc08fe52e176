"""Time a study did not run, kept apart from its start (``studies.idle_seconds``,
``studies.interrupted_at``).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29

A ``max_seconds`` budget counts the time a study runs. A study whose scheduler stopped
(``packtune run`` interrupted, ``packtune serve`` shut down) sat with nothing scheduling
it until another took it on, and that time counted: resumed later than its budget after
its start, it ended at the first tick. ``interrupted_at`` is set, for each running study,
by the scheduler that stops; the next one to lead adds the time since to ``idle_seconds``.
A retried study's time spent failed goes there too (its ``started_at`` was moved on by
it before, which cut its own earlier packs out of its waiting time). 0 and NULL for every
study before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Not in a batch: SQLite adds (3.2+) and drops (3.35+) a plain column in place.
    op.add_column(
        "studies", sa.Column("idle_seconds", sa.Float(), nullable=False, server_default="0")
    )
    op.add_column("studies", sa.Column("interrupted_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("studies", "interrupted_at")
    op.drop_column("studies", "idle_seconds")
