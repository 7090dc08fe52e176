"""Repeated Hyperband iterations: which iteration a trial (and a promotion) belongs to, and
why a study with a budget stopped.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24

- ``trials.iteration``, ``rung_promotions.iteration``: a study may repeat Hyperband's outer
  loop (``budget.max_iterations``); a bracket is (iteration, s). Existing rows are
  iteration 0. The bracket index of ``trials`` gains the column;
- ``studies.stop_reason``: the budget that ended a study early (``max_trials``,
  ``max_seconds``, ``target``), or NULL.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("iteration", sa.Integer(), nullable=False, server_default="0"))
        batch.drop_index("ix_trials_study_bracket_rung")
        batch.create_index(
            "ix_trials_study_bracket_rung", ["study_id", "iteration", "bracket", "rung"]
        )
    with op.batch_alter_table("rung_promotions") as batch:
        batch.add_column(sa.Column("iteration", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("studies") as batch:
        batch.add_column(sa.Column("stop_reason", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("studies") as batch:
        batch.drop_column("stop_reason")
    with op.batch_alter_table("rung_promotions") as batch:
        batch.drop_column("iteration")
    with op.batch_alter_table("trials") as batch:
        batch.drop_index("ix_trials_study_bracket_rung")
        batch.create_index("ix_trials_study_bracket_rung", ["study_id", "bracket", "rung"])
        batch.drop_column("iteration")
