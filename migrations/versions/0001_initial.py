"""Initial schema: studies, trials, promotions, packs, measurements, workers, profiles, leases.

Revision ID: 0001
Revises:
Create Date: 2026-11-22

studies.best_trial_id and trials.study_id point at each other. On PostgreSQL
the studies -> trials key is added after both tables exist; SQLite cannot add
a foreign key to an existing table, but it accepts one naming a table that does
not exist yet, so there it is declared inline.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STUDY_STATUSES = ("pending", "running", "completed", "failed", "cancelled")
TRIAL_STATUSES = (
    "pending",
    "queued",
    "running",
    "paused",
    "stopped",
    "completed",
    "diverged",
    "failed",
    "cancelled",
)
PACK_STATUSES = ("pending", "queued", "running", "completed", "failed", "split", "cancelled")
WORKER_STATUSES = ("idle", "busy", "dead")


def _status(name: str, values: tuple[str, ...]) -> sa.Enum:
    # Stored as VARCHAR(16) without a CHECK constraint, as in service.models.
    return sa.Enum(*values, name=name, native_enum=False, length=16)


def _ts(name: str, *, nullable: bool = False) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _separate_fk() -> bool:
    return bool(op.get_context().dialect.supports_alter)


def upgrade() -> None:
    op.create_table(
        "studies",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("workload", sa.String(100), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("status", _status("studystatus", STUDY_STATUSES), nullable=False),
        sa.Column("best_trial_id", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("created_at"),
        _ts("started_at", nullable=True),
        _ts("finished_at", nullable=True),
        # Left out of CREATE TABLE where the dialect can ALTER (use_alter); added below.
        sa.ForeignKeyConstraint(
            ["best_trial_id"],
            ["trials.id"],
            name="fk_studies_best_trial",
            ondelete="SET NULL",
            use_alter=True,
        ),
    )
    op.create_table(
        "trials",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "study_id",
            sa.Integer(),
            sa.ForeignKey("studies.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("bracket", sa.Integer(), nullable=False),
        sa.Column("rung", sa.Integer(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("fusion_key", sa.String(500), nullable=False),
        sa.Column("status", _status("trialstatus", TRIAL_STATUSES), nullable=False),
        sa.Column("resource_done", sa.Float(), nullable=False),
        sa.Column("checkpoint_path", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        sa.UniqueConstraint("study_id", "sample_index", name="uq_trials_study_sample"),
    )
    op.create_index("ix_trials_study_status", "trials", ["study_id", "status"])
    op.create_index("ix_trials_study_bracket_rung", "trials", ["study_id", "bracket", "rung"])
    if _separate_fk():
        op.create_foreign_key(
            "fk_studies_best_trial",
            "studies",
            "trials",
            ["best_trial_id"],
            ["id"],
            ondelete="SET NULL",
        )

    op.create_table(
        "rung_promotions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "study_id",
            sa.Integer(),
            sa.ForeignKey("studies.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column(
            "trial_id",
            sa.Integer(),
            sa.ForeignKey("trials.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("bracket", sa.Integer(), nullable=False),
        sa.Column("rung", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        _ts("created_at"),
        sa.UniqueConstraint("trial_id", "rung", name="uq_promotions_trial_rung"),
    )
    op.create_index("ix_promotions_study_bracket", "rung_promotions", ["study_id", "bracket"])

    op.create_table(
        "packs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "study_id",
            sa.Integer(),
            sa.ForeignKey("studies.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("status", _status("packstatus", PACK_STATUSES), nullable=False),
        sa.Column("device", sa.String(200), nullable=True),
        sa.Column("worker_name", sa.String(200), nullable=True),
        sa.Column("job_id", sa.String(200), nullable=True),
        sa.Column("parent_id", sa.Integer(), sa.ForeignKey("packs.id"), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("estimated_bytes", sa.BigInteger(), nullable=True),
        sa.Column("peak_bytes", sa.BigInteger(), nullable=True),
        sa.Column("train_seconds", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("created_at"),
        _ts("enqueued_at", nullable=True),
        _ts("started_at", nullable=True),
        _ts("finished_at", nullable=True),
    )
    op.create_index("ix_packs_study_status", "packs", ["study_id", "status"])

    op.create_table(
        "pack_members",
        sa.Column(
            "pack_id",
            sa.Integer(),
            sa.ForeignKey("packs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column(
            "trial_id",
            sa.Integer(),
            sa.ForeignKey("trials.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("fusion_key", sa.String(500), nullable=False),
        sa.Column("from_resource", sa.Float(), nullable=False),
        sa.Column("to_resource", sa.Float(), nullable=False),
    )
    op.create_index("ix_pack_members_trial", "pack_members", ["trial_id"])

    op.create_table(
        "measurements",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "trial_id",
            sa.Integer(),
            sa.ForeignKey("trials.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("resource", sa.Float(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        _ts("created_at"),
        sa.UniqueConstraint("trial_id", "resource", name="uq_measurements_trial_resource"),
    )

    op.create_table(
        "workers",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("device_kind", sa.String(200), nullable=False),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.Column("memory_budget", sa.BigInteger(), nullable=True),
        sa.Column("status", _status("workerstatus", WORKER_STATUSES), nullable=False),
        _ts("started_at"),
        _ts("last_heartbeat"),
    )

    op.create_table(
        "profiles",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("workload", sa.String(100), nullable=False),
        sa.Column("fusion_key", sa.String(500), nullable=False),
        sa.Column("device_kind", sa.String(200), nullable=False),
        sa.Column("base_bytes", sa.BigInteger(), nullable=True),
        sa.Column("per_trial_bytes", sa.BigInteger(), nullable=True),
        sa.Column("throughput", sa.JSON(), nullable=False),
        _ts("updated_at"),
        sa.UniqueConstraint("workload", "fusion_key", "device_kind", name="uq_profiles_key"),
    )

    op.create_table(
        "leases",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("holder", sa.String(200), nullable=False),
        _ts("expires_at"),
    )


def downgrade() -> None:
    for table in ("leases", "profiles", "workers", "measurements", "pack_members", "packs"):
        op.drop_table(table)
    op.drop_table("rung_promotions")
    if _separate_fk():
        op.drop_constraint("fk_studies_best_trial", "studies", type_="foreignkey")
    else:
        op.execute("UPDATE studies SET best_trial_id = NULL")
    op.drop_table("trials")
    op.drop_table("studies")
