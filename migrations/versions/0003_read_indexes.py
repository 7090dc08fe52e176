"""Covering indexes for the read endpoints of a large study.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22

Measured on a study of 10,582 trials (SQLite, one query each):

- ``(study_id, status, rung)`` replaces ``(study_id, status)``: a study's trial
  counts and rung-units done read the index alone (4.9 -> 1.5 ms);
- ``(study_id, measured_resource, objective)``: the leaderboard walks it from
  the highest resource down and sorts only within a resource, stopping after
  ``limit`` rows (4.3 -> 0.05 ms for the top 20), and counts measured trials
  from it (2.7 -> 0.4 ms);
- ``(study_id, id)`` on trials and on packs: a page of a study's trials by id,
  or of its packs newest first, without sorting them all (trials: 1.5 -> 0.3 ms).

Writes pay for them: every measurement updates the second index, and a rung
decision that changes thousands of statuses updates the first as it did before.
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
    op.create_index("ix_trials_study_status_rung", "trials", ["study_id", "status", "rung"])
    op.create_index(
        "ix_trials_study_measured", "trials", ["study_id", "measured_resource", "objective"]
    )
    op.create_index("ix_trials_study_id", "trials", ["study_id", "id"])
    op.create_index("ix_packs_study_id", "packs", ["study_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_packs_study_id", table_name="packs")
    op.drop_index("ix_trials_study_id", table_name="trials")
    op.drop_index("ix_trials_study_measured", table_name="trials")
    op.drop_index("ix_trials_study_status_rung", table_name="trials")
    op.create_index("ix_trials_study_status", "trials", ["study_id", "status"])
