"""How each array of a pack ran (``packs.arrays``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25

- ``packs.arrays``: written when a pack completes: each array's trials, its stacks and the
  forward each took (``bmm`` hand-fused, ``vmap``, ``serial`` one member at a time), the
  notes (a vmap step that fell back to one member at a time) and the trials that raised
  and were failed. NULL for packs that finished before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("packs") as batch:
        batch.add_column(sa.Column("arrays", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("packs") as batch:
        batch.drop_column("arrays")
