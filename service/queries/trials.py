"""Trials with their latest metrics, the leaderboard, learning curves."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, func, select
from sqlalchemy.orm import Session

from packtune.spec import StoredSpec
from service import store
from service.models import (
    Measurement,
    Trial,
    TrialStatus,
)
from service.queries.rows import Row

# -- trials -------------------------------------------------------------------------------


def _trial_select() -> Select[Any]:
    """Trials with the metrics of their measurement at the largest resource (if any)."""
    return select(
        Trial.id,
        Trial.study_id,
        Trial.sample_index,
        Trial.iteration,
        Trial.bracket,
        Trial.rung,
        Trial.status,
        Trial.config,
        Trial.fusion_key,
        Trial.resource_done,
        Trial.error,
        Trial.updated_at,
        Trial.measured_resource,
        Trial.objective,
        Measurement.metrics,
    ).outerjoin(
        Measurement,
        and_(Measurement.trial_id == Trial.id, Measurement.resource == Trial.measured_resource),
    )


def _page(
    where: list[ColumnElement[bool]],
    order: list[Any],
    limit: int | None,
    offset: int = 0,
) -> Select[Any]:
    """:func:`_trial_select` for one page of trials: the page is chosen on the trials table
    alone, then only its rows are joined to their measurements."""
    page = select(Trial.id).where(*where).order_by(*order).offset(offset)
    if limit is not None:
        page = page.limit(limit)
    chosen = page.subquery()
    return _trial_select().join(chosen, chosen.c.id == Trial.id).order_by(*order)


def _trial_row(row: Any) -> Row:
    return {
        "id": row.id,
        "sample_index": row.sample_index,
        "iteration": row.iteration,
        "bracket": row.bracket,
        "rung": row.rung,
        "status": TrialStatus(row.status).value,
        "config": row.config,
        "fusion_key": row.fusion_key,
        "resource": row.resource_done,
        "measured_resource": row.measured_resource,
        "metrics": row.metrics or {},
        "error": row.error,
        "updated_at": row.updated_at,
    }


def trials_by_id(s: Session, trial_ids: list[int]) -> dict[int, Row]:
    if not trial_ids:
        return {}
    rows = s.execute(_trial_select().where(Trial.id.in_(trial_ids)))
    return {row.id: _trial_row(row) for row in rows}


def trials(
    s: Session,
    study_id: int,
    *,
    status: TrialStatus | None = None,
    bracket: int | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> tuple[list[Row], int]:
    """The study's trials by id with their latest metrics, and how many match."""
    store.get_study(s, study_id)
    where = [Trial.study_id == study_id]
    if status is not None:
        where.append(Trial.status == status)
    if bracket is not None:
        where.append(Trial.bracket == bracket)
    count = s.scalar(select(func.count()).select_from(Trial).where(*where)) or 0
    stmt = _page(where, [Trial.id], limit, offset)
    return [_trial_row(row) for row in s.execute(stmt)], count


def leaderboard(s: Session, study_id: int, limit: int | None = None) -> tuple[list[Row], int]:
    """Measured trials ranked by the objective at their highest resource, and how many.

    Order: trials with a finite objective first; then higher resource first (a
    trial that went further beat its rivals to get there); then the objective
    by the study's mode; then trial id. Ranked in SQL on the trials' own
    ``measured_resource`` and ``objective`` columns, so a page costs the rows
    it shows whatever the study's size.
    """
    store.get_study(s, study_id)
    measured = [Trial.study_id == study_id, Trial.measured_resource.is_not(None)]
    count = s.scalar(select(func.count()).select_from(Trial).where(*measured)) or 0
    return top_trials(s, study_id, limit), count


def top_trials(s: Session, study_id: int, limit: int | None = None) -> list[Row]:
    """The first ``limit`` rows of :func:`leaderboard`, without counting them all (one
    statement fewer: the study summary asks for its best so far on every poll)."""
    study = store.get_study(s, study_id)
    mode = StoredSpec.of(study.spec).objective.mode
    measured = [Trial.study_id == study_id, Trial.measured_resource.is_not(None)]
    # two pages, finite objectives then the rest, each in an order the index
    # (study_id, measured_resource, objective) serves from the highest resource down
    finite = [*measured, Trial.objective.is_not(None)]
    by_objective = Trial.objective.asc() if mode == "min" else Trial.objective.desc()
    order = [Trial.measured_resource.desc(), by_objective, Trial.id]
    rows = list(s.execute(_page(finite, order, limit)))
    if limit is None or len(rows) < limit:
        rest = None if limit is None else limit - len(rows)
        not_finite = [*measured, Trial.objective.is_(None)]
        rows += s.execute(_page(not_finite, [Trial.measured_resource.desc(), Trial.id], rest))
    out = []
    for position, row in enumerate(rows, start=1):
        out.append({**_trial_row(row), "rank": position, "value": row.objective})
    return out


def curves(s: Session, study_id: int, trial_ids: list[int] | None = None) -> list[Row]:
    """Every measurement, grouped per trial: ``[{trial_id, points: [{resource, metrics}]}]``."""
    store.get_study(s, study_id)
    stmt = (
        select(Measurement.trial_id, Measurement.resource, Measurement.metrics)
        .join(Trial, Trial.id == Measurement.trial_id)
        .where(Trial.study_id == study_id)
        .order_by(Measurement.trial_id, Measurement.resource)
    )
    if trial_ids:
        stmt = stmt.where(Measurement.trial_id.in_(trial_ids))
    points: dict[int, list[Row]] = defaultdict(list)
    for trial_id, resource, metrics in s.execute(stmt):
        points[trial_id].append({"resource": resource, "metrics": metrics})
    return [{"trial_id": trial_id, "points": pts} for trial_id, pts in points.items()]
