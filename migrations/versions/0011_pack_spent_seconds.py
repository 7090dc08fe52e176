"""Device time of a pack's earlier attempts (``packs.spent_seconds``).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28

A pack whose attempt failed (its job raised, its worker died) goes back to pending with its
``started_at`` cleared, so that the wait for its next attempt is not counted as device time.
The failed attempt's own time on the device was then not charged to the pack's studies at
all: a study whose packs kept failing used the device without its fair share shrinking.
``spent_seconds`` keeps the seconds of the attempts that ended without finishing the pack;
0 for every pack before (nothing recorded them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Not in a batch: SQLite adds (3.2+) and drops (3.35+) a plain column in place, where a
    # batch would copy the whole table.
    op.add_column(
        "packs", sa.Column("spent_seconds", sa.Float(), nullable=False, server_default="0")
    )


def downgrade() -> None:
    op.drop_column("packs", "spent_seconds")
