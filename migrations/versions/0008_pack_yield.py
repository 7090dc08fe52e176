"""A running pack asked to give its device up (``packs.yield_requested_at``).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25

- ``packs.yield_requested_at``: set by the scheduler when a pack of a study with a better
  fair share waits and no device is free; the pack's job reads it while it trains and stops
  at its next training step, its trials checkpointed there and ready again. NULL for every
  pack before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("packs") as batch:
        batch.add_column(sa.Column("yield_requested_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("packs") as batch:
        batch.drop_column("yield_requested_at")
