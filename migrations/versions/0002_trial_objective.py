"""Each trial's latest measured resource and objective, for ranking in SQL.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22

Existing trials are filled in from their measurement at the largest resource
and their study's objective metric (a finite number, else NULL). No index:
ranking a study's 10,000 trials is a top-N sort of one scan of its rows either
way, and every index on trials is one more to update when a rung decision
changes thousands of statuses at once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

from packtune.objective import value_of

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LATEST = """
SELECT t.id, s.spec, m.resource, m.metrics
FROM trials t
JOIN studies s ON s.id = t.study_id
JOIN (SELECT trial_id, MAX(resource) AS resource FROM measurements GROUP BY trial_id) l
  ON l.trial_id = t.id
JOIN measurements m ON m.trial_id = t.id AND m.resource = l.resource
"""


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _metric(spec: dict[str, Any]) -> str:
    """The objective metric a spec named when this migration was written (its own copy:
    a migration must not change meaning when the application's code does)."""
    return str((spec.get("objective") or {}).get("metric", "val_loss"))


def upgrade() -> None:
    op.add_column("trials", sa.Column("measured_resource", sa.Float(), nullable=True))
    op.add_column("trials", sa.Column("objective", sa.Float(), nullable=True))
    conn = op.get_bind()
    rows = [
        {
            "id": trial_id,
            "resource": resource,
            "objective": value_of(_json(metrics), _metric(_json(spec))),
        }
        for trial_id, spec, resource, metrics in conn.execute(sa.text(LATEST))
    ]
    if rows:
        conn.execute(
            sa.text(
                "UPDATE trials SET measured_resource = :resource, objective = :objective"
                " WHERE id = :id"
            ),
            rows,
        )


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("objective")
        batch.drop_column("measured_resource")
