"""Pack retries: when a pack may be tried again, and how many attempts were not its fault.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23

- ``retry_after``: a pack that failed waits until then before it is dispatched again
  (exponential backoff with jitter), so that a transient fault (a full or read-only
  checkpoint folder, a database or Redis restart) does not use every attempt in seconds;
- ``faults``: attempts that ended in a fault that is not the trials' (storage, database,
  job queue): they do not count toward ``PACKTUNE_MAX_ATTEMPTS``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("packs") as batch:
        batch.add_column(sa.Column("retry_after", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("faults", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("packs") as batch:
        batch.drop_column("faults")
        batch.drop_column("retry_after")
