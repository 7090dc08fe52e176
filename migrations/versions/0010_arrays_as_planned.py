"""Arrays as the planner cut them (``pack_members.array_no``), and the trial-steps/s of
arrays trained several at once (``profiles.concurrent``).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26

- ``profiles.concurrent``: beside ``throughput`` (an array of k trials training alone),
  the trial-steps/s a whole pack reached while its arrays of one fusion key, k trials
  each, trained at once (in threads; on a GPU, each thread's kernels on their own stream),
  ``{"<k>": trial-steps per second}``. The planner picks an array size from both curves.
  Empty for every profile before.
- ``pack_members.array_no``: which of its pack's arrays a member trains in, as the planner
  cut the pack's units by the measured array size. Before, a worker trained all of a pack's
  members of one fusion key and span as one array, whatever size the planner had chosen.
  0 for every member before (each key and span one array, as it trained).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        batch.add_column(
            sa.Column("concurrent", sa.JSON(), nullable=False, server_default=sa.text("'{}'"))
        )
    with op.batch_alter_table("pack_members") as batch:
        batch.add_column(
            sa.Column("array_no", sa.Integer(), nullable=False, server_default=sa.text("0"))
        )


def downgrade() -> None:
    with op.batch_alter_table("pack_members") as batch:
        batch.drop_column("array_no")
    with op.batch_alter_table("profiles") as batch:
        batch.drop_column("concurrent")
