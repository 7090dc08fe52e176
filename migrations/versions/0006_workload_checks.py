"""Workload checks asked for through the API (``POST /api/workloads/{name}/check``).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25

- ``workload_checks``: the workload, the request (space, members, steps), the status
  (queued, running, passed, failed, error), the report once a worker has run it, the job
  that runs it and the times.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workload_checks",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("workload", sa.String(100), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "queued",
                "running",
                "passed",
                "failed",
                "error",
                name="checkstatus",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("report", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("job_id", sa.String(100), nullable=True),
        sa.Column("worker_name", sa.String(200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_workload_checks_status", "workload_checks", ["status"])


def downgrade() -> None:
    op.drop_index("ix_workload_checks_status", table_name="workload_checks")
    op.drop_table("workload_checks")
