"""Device time of a shared pack charged to a study since deleted (``packs.departed_seconds``).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29

A pack shared by several studies charges its device time to each in proportion to the
trial-resource it trains there. Deleting a study deletes its trials and with them its pack
members, so its share of every pack it shared went to the studies left in the pack: their
device-seconds (a running study's fair-share level) grew by time they never used.
``departed_seconds`` keeps the deleted study's share of the pack's time up to its deletion,
charged to nobody; the pack's time after it is split between the studies left in it (they
alone train there then). 0 for every pack before (what deleted studies had moved stays
moved).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Not in a batch: SQLite adds (3.2+) and drops (3.35+) a plain column in place.
    op.add_column(
        "packs", sa.Column("departed_seconds", sa.Float(), nullable=False, server_default="0")
    )


def downgrade() -> None:
    op.drop_column("packs", "departed_seconds")
