"""The read side: what the API and the dashboard show, as plain dicts.

ORM rows never leave this module. Every function costs a fixed number of
queries whatever the study's size (no query per trial): a trial's latest
metrics come from one join against each trial's largest measured resource.

Progress counts *rung-units*, one per trial per rung that Hyperband would run
if every rung filled (``total_units`` of the spec's plan). A trial at rung
``i`` has finished ``i`` units, plus the one at rung ``i`` if it is paused,
stopped, completed, diverged or failed there (a diverged or failed trial's
unit is finished though it gave no usable metric; a cancelled one's is not).
Rungs can fill short of plan (trials that diverge are never promoted), so a
completed study reports ``done = total`` rather than leave its bar unfilled.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, String, and_, func, select, type_coerce
from sqlalchemy.orm import Session, selectinload

from service import store
from service.hyperband import Rung, plan_brackets, total_units
from service.models import (
    Measurement,
    Pack,
    PackStatus,
    Study,
    StudyStatus,
    Trial,
    TrialStatus,
    Worker,
    WorkerStatus,
)
from service.objective import objective_of

Row = dict[str, Any]

UNIT_FINISHED = (
    TrialStatus.paused,
    TrialStatus.stopped,
    TrialStatus.completed,
    TrialStatus.diverged,
    TrialStatus.failed,
)


def plan_of(spec: dict[str, Any]) -> list[list[Rung]]:
    """Hyperband's brackets for a stored spec, highest ``s`` first."""
    hb = spec["hyperband"]
    return plan_brackets(hb["max_resource"], hb.get("eta", 3), hb.get("min_resource", 1))


# -- studies ------------------------------------------------------------------------------


def study_summary(s: Session, study_id: int) -> Row:
    """One study with progress, trial counts, its best trial and the best so far."""
    study = store.get_study(s, study_id)
    summary = _summaries(s, [study])[0]
    board = leaderboard(s, study_id, limit=1)[0]
    summary["best_so_far"] = board[0] if board else None
    return summary


def list_studies(s: Session, limit: int, offset: int) -> tuple[list[Row], int]:
    """A page of studies, newest first, and how many there are."""
    rows, count = store.list_studies(s, limit=limit, offset=offset)
    return _summaries(s, list(rows)), count


def _summaries(s: Session, studies: list[Study]) -> list[Row]:
    ids = [study.id for study in studies]
    counts: dict[int, dict[str, int]] = defaultdict(dict)
    done: dict[int, int] = defaultdict(int)
    stmt = (
        select(
            Trial.study_id,
            Trial.status,
            func.count(),
            func.coalesce(func.sum(Trial.rung), 0),
        )
        .where(Trial.study_id.in_(ids))
        .group_by(Trial.study_id, Trial.status)
    )
    for study_id, status, n, rungs in s.execute(stmt):
        counts[study_id][TrialStatus(status).value] = n
        done[study_id] += int(rungs) + (n if status in UNIT_FINISHED else 0)
    running: dict[int, int] = defaultdict(int)
    packs_stmt = (
        select(Pack.study_id, func.count())
        .where(Pack.study_id.in_(ids), Pack.status == PackStatus.running)
        .group_by(Pack.study_id)
    )
    for study_id, n in s.execute(packs_stmt):
        running[study_id] = n
    best = _trials_by_id(s, [st.best_trial_id for st in studies if st.best_trial_id is not None])
    out = []
    for study in studies:
        metric, mode = objective_of(study.spec)
        total = total_units(plan_of(study.spec))
        finished = total if study.status == StudyStatus.completed else min(done[study.id], total)
        best_row = best.get(study.best_trial_id) if study.best_trial_id is not None else None
        out.append(
            {
                "id": study.id,
                "name": study.name,
                "workload": study.workload,
                "status": study.status.value,
                "seed": study.seed,
                "objective": {"metric": metric, "mode": mode},
                "spec": study.spec,
                "error": study.error,
                "created_at": study.created_at,
                "started_at": study.started_at,
                "finished_at": study.finished_at,
                "progress": {"done": finished, "total": total},
                "trial_counts": counts[study.id],
                "packs_running": running[study.id],
                "best_trial": _brief(best_row) if best_row else None,
            }
        )
    return out


def _brief(trial: Row) -> Row:
    return {"id": trial["id"], "config": trial["config"], "metrics": trial["metrics"]}


# -- trials -------------------------------------------------------------------------------


def _trial_select() -> Select[Any]:
    """Trials with the metrics of their measurement at the largest resource (if any)."""
    return select(
        Trial.id,
        Trial.study_id,
        Trial.sample_index,
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


def _trials_by_id(s: Session, trial_ids: list[int]) -> dict[int, Row]:
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
    study = store.get_study(s, study_id)
    mode = objective_of(study.spec)[1]
    measured = [Trial.study_id == study_id, Trial.measured_resource.is_not(None)]
    count = s.scalar(select(func.count()).select_from(Trial).where(*measured)) or 0
    order = [
        Trial.objective.is_(None),
        Trial.measured_resource.desc(),
        Trial.objective.asc() if mode == "min" else Trial.objective.desc(),
        Trial.id,
    ]
    stmt = _page(measured, order, limit)
    out = []
    for position, row in enumerate(s.execute(stmt), start=1):
        out.append({**_trial_row(row), "rank": position, "value": row.objective})
    return out, count


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


# -- brackets -----------------------------------------------------------------------------


def brackets(s: Session, study_id: int) -> list[Row]:
    """Each bracket ``s`` (highest first) with its planned rungs and the trials in each.

    A trial is in rung ``i`` if it reached it (its current rung is ``i`` or
    later). At its current rung it shows its status; rungs it has left show
    ``paused`` (where it stood when promoted) with ``promoted`` true: a trial's
    rung only ever advances by a promotion (:func:`service.lifecycle.advance_brackets`
    records both in one transaction), so the rungs below its current one are
    exactly those it was promoted from. One row per trial is read, as plain
    strings (a study of 10,000 trials answers in tens of milliseconds).
    """
    study = store.get_study(s, study_id)
    plan = plan_of(study.spec)
    members: dict[tuple[int, int], list[Row]] = defaultdict(list)
    stmt = (
        select(Trial.id, Trial.bracket, Trial.rung, type_coerce(Trial.status, String))
        .where(Trial.study_id == study_id)
        .order_by(Trial.id)
    )
    for trial_id, bracket_s, current, status in s.execute(stmt).tuples():
        for i in range(current):
            members[(bracket_s, i)].append(
                {"trial_id": trial_id, "status": "paused", "promoted": True}
            )
        members[(bracket_s, current)].append(
            {"trial_id": trial_id, "status": status, "promoted": False}
        )
    out = []
    for index, rungs in enumerate(plan):
        bracket_s = len(plan) - 1 - index
        out.append(
            {
                "s": bracket_s,
                "rungs": [
                    {
                        "rung": i,
                        "n": rung.n,
                        "resource": rung.resource,
                        "trials": members[(bracket_s, i)],
                    }
                    for i, rung in enumerate(rungs)
                ],
            }
        )
    return out


# -- packs, workers, workloads ------------------------------------------------------------


def packs(
    s: Session,
    study_id: int,
    *,
    status: PackStatus | None = None,
    limit: int = 100,
    offset: int = 0,
) -> tuple[list[Row], int]:
    """The study's packs, newest first, with their members."""
    store.get_study(s, study_id)
    where = [Pack.study_id == study_id]
    if status is not None:
        where.append(Pack.status == status)
    count = s.scalar(select(func.count()).select_from(Pack).where(*where)) or 0
    stmt = (
        select(Pack)
        .where(*where)
        .options(selectinload(Pack.members))
        .order_by(Pack.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return [_pack_row(pack) for pack in s.scalars(stmt)], count


def _pack_row(pack: Pack) -> Row:
    duration = None
    if pack.started_at is not None and pack.finished_at is not None:
        duration = (pack.finished_at - pack.started_at).total_seconds()
    return {
        "id": pack.id,
        "status": pack.status.value,
        "members": [
            {
                "trial_id": m.trial_id,
                "fusion_key": m.fusion_key,
                "from_resource": m.from_resource,
                "to_resource": m.to_resource,
            }
            for m in pack.members
        ],
        "device": pack.device,
        "worker": pack.worker_name,
        "estimated_bytes": pack.estimated_bytes,
        "peak_bytes": pack.peak_bytes,
        "train_seconds": pack.train_seconds,
        "created_at": pack.created_at,
        "enqueued_at": pack.enqueued_at,
        "started_at": pack.started_at,
        "finished_at": pack.finished_at,
        "duration": duration,
        "attempts": pack.attempts,
        "error": pack.error,
        "parent_id": pack.parent_id,
    }


def workers(s: Session, timeout_seconds: float, now: datetime | None = None) -> list[Row]:
    """Every worker known; ``alive`` when not dead and heard from within the timeout."""
    now = now or datetime.now(UTC)
    out = []
    for worker in s.scalars(select(Worker).order_by(Worker.name)):
        beat = worker.last_heartbeat
        if beat.tzinfo is None:
            beat = beat.replace(tzinfo=UTC)
        out.append(
            {
                "name": worker.name,
                "host": worker.host,
                "device_kind": worker.device_kind,
                "gpus": worker.gpus,
                "memory_budget": worker.memory_budget,
                "status": worker.status.value,
                "started_at": worker.started_at,
                "last_heartbeat": beat,
                "alive": worker.status != WorkerStatus.dead
                and (now - beat).total_seconds() <= timeout_seconds,
            }
        )
    return out


def workloads() -> list[Row]:
    """``describe()`` of every registered workload, by name."""
    from worker.workloads import registry  # imports no torch

    return [registry()[name].describe() for name in sorted(registry())]
