"""Drop the trials indexes on (study_id, status) and (study_id, bracket, rung).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22

Every read of trials is per study, which the unique (study_id, sample_index)
index already finds; a study's 10,000 rows are then filtered in one scan. The
two indexes cost more than they saved: a rung decision changes the status (and
rung) of thousands of trials in one statement, and PostgreSQL rewrote both
indexes for each row (an UPDATE that changes no indexed column can stay on its
heap page and touch no index).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_index("ix_trials_study_status", table_name="trials")
    op.drop_index("ix_trials_study_bracket_rung", table_name="trials")


def downgrade() -> None:
    op.create_index("ix_trials_study_bracket_rung", "trials", ["study_id", "bracket", "rung"])
    op.create_index("ix_trials_study_status", "trials", ["study_id", "status"])
