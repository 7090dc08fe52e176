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

import math
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, func, select
from sqlalchemy.orm import Session, selectinload

from service import store
from service.hyperband import Rung, plan_brackets, total_units
from service.models import (
    Measurement,
    Pack,
    PackStatus,
    RungPromotion,
    Study,
    StudyStatus,
    Trial,
    TrialStatus,
    Worker,
    WorkerStatus,
)

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


def objective_of(spec: dict[str, Any]) -> tuple[str, str]:
    """``(metric, mode)`` of a stored spec."""
    objective = spec.get("objective") or {}
    return objective.get("metric", "val_loss"), objective.get("mode", "min")


def value_of(metrics: dict[str, Any] | None, metric: str) -> float | None:
    """``metrics[metric]`` as a float when it is a finite number, else None."""
    value = (metrics or {}).get(metric)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


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


def _latest(which: ColumnElement[bool]) -> Any:
    """Subquery: each trial matching ``which`` with its largest measured resource."""
    return (
        select(Measurement.trial_id, func.max(Measurement.resource).label("resource"))
        .join(Trial, Trial.id == Measurement.trial_id)
        .where(which)
        .group_by(Measurement.trial_id)
        .subquery()
    )


def _trial_select(latest: Any) -> Select[Any]:
    return (
        select(
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
            latest.c.resource.label("measured_resource"),
            Measurement.metrics,
        )
        .outerjoin(latest, latest.c.trial_id == Trial.id)
        .outerjoin(
            Measurement,
            and_(Measurement.trial_id == Trial.id, Measurement.resource == latest.c.resource),
        )
    )


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
    which = Trial.id.in_(trial_ids)
    rows = s.execute(_trial_select(_latest(which)).where(which))
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
    latest = _latest(Trial.study_id == study_id)
    stmt = _trial_select(latest).where(*where).order_by(Trial.id).offset(offset)
    if limit is not None:
        stmt = stmt.limit(limit)
    return [_trial_row(row) for row in s.execute(stmt)], count


def leaderboard(s: Session, study_id: int, limit: int | None = None) -> tuple[list[Row], int]:
    """Measured trials ranked by the objective at their highest resource.

    Order: higher resource first (a trial that went further beat its rivals
    to get there); then the objective by the study's mode; then trial id.
    Trials whose objective is missing or not finite come last.
    """
    study = store.get_study(s, study_id)
    metric, mode = objective_of(study.spec)
    sign = 1.0 if mode == "min" else -1.0
    # Rank on (id, resource, metrics) alone; whole rows only for the page shown.
    latest = _latest(Trial.study_id == study_id)
    stmt = select(Measurement.trial_id, Measurement.resource, Measurement.metrics).join(
        latest,
        and_(Measurement.trial_id == latest.c.trial_id, Measurement.resource == latest.c.resource),
    )
    ranked: list[tuple[bool, float, float, int]] = []
    for trial_id, resource, metrics in s.execute(stmt):
        value = value_of(metrics, metric)
        if value is None:
            ranked.append((True, 0.0, 0.0, trial_id))
        else:
            ranked.append((False, -resource, sign * value, trial_id))
    ranked.sort()
    shown = ranked[:limit] if limit is not None else ranked
    if len(shown) <= 500:  # an id list stays well under SQLite's bound-parameter limit
        rows = _trials_by_id(s, [trial_id for *_, trial_id in shown])
    else:
        rows = {row["id"]: row for row in trials(s, study_id)[0]}
    out = []
    for position, (_, _, _, trial_id) in enumerate(shown, start=1):
        row = rows[trial_id]
        out.append({**row, "rank": position, "value": value_of(row["metrics"], metric)})
    return out, len(ranked)


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
    ``paused`` (where it stood when promoted) with ``promoted`` true.
    """
    study = store.get_study(s, study_id)
    plan = plan_of(study.spec)
    promoted = {
        (trial_id, rung)
        for trial_id, rung in s.execute(
            select(RungPromotion.trial_id, RungPromotion.rung).where(
                RungPromotion.study_id == study_id
            )
        )
    }
    members: dict[tuple[int, int], list[Row]] = defaultdict(list)
    stmt = (
        select(Trial.id, Trial.bracket, Trial.rung, Trial.status)
        .where(Trial.study_id == study_id)
        .order_by(Trial.id)
    )
    for trial_id, bracket_s, current, status in s.execute(stmt):
        for i in range(current + 1):
            members[(bracket_s, i)].append(
                {
                    "trial_id": trial_id,
                    "status": TrialStatus(status).value if i == current else "paused",
                    "promoted": (trial_id, i) in promoted,
                }
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
