"""A pack member may be one segment of a trial (``pack_members.segment``).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25

- ``pack_members.segment``: with decoupled training and ``units: segment``, each segment
  of a trial's rung span is a unit of work of its own, so a pack may hold several segments
  of one trial (as separate arrays) and a trial's span may be spread over several packs.
  ``-1`` (every member before): the whole trial. The primary key becomes (pack, trial,
  segment); the table is rebuilt to change it, the same way on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = "pack_id, trial_id, fusion_key, from_resource, to_resource"


def _members(name: str, segment: bool) -> None:
    columns = [
        sa.Column("pack_id", sa.Integer(), sa.ForeignKey("packs.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("trial_id", sa.Integer(), sa.ForeignKey("trials.id", ondelete="CASCADE"),
                  primary_key=True),
    ]  # fmt: skip
    if segment:
        columns.append(
            sa.Column("segment", sa.Integer(), primary_key=True, server_default=sa.text("-1"))
        )
    op.create_table(
        name,
        *columns,
        sa.Column("fusion_key", sa.String(500), nullable=False),
        sa.Column("from_resource", sa.Float(), nullable=False),
        sa.Column("to_resource", sa.Float(), nullable=False),
    )


def _rebuild(segment: bool, where: str = "") -> None:
    op.drop_index("ix_pack_members_trial", table_name="pack_members")
    _members("pack_members_new", segment)
    op.execute(
        f"INSERT INTO pack_members_new ({COLUMNS}) SELECT {COLUMNS} FROM pack_members{where}"
    )
    op.drop_table("pack_members")
    op.rename_table("pack_members_new", "pack_members")
    op.create_index("ix_pack_members_trial", "pack_members", ["trial_id"])


def upgrade() -> None:
    _rebuild(segment=True)


def downgrade() -> None:
    # a trial's segments in one pack were several rows: one (its lowest segment) is kept
    _rebuild(
        segment=False,
        where=" AS m WHERE m.segment = (SELECT MIN(o.segment) FROM "
        "pack_members AS o WHERE o.pack_id = m.pack_id AND o.trial_id = m.trial_id)",
    )
