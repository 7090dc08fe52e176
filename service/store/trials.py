"""Trials: add, read, count, and change many at once; their measurements and promotions."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import (
    Table,
    bindparam,
    func,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.orm import Session

from packtune.errors import NotFound
from packtune.objective import value_of
from packtune.spec import StoredSpec
from service.models import (
    Measurement,
    PackMember,
    RungPromotion,
    Study,
    Trial,
    TrialStatus,
    utcnow,
)
from service.store._sql import fresh, id_in, insert_for, insert_rows, is_postgres, statuses
from service.store.transitions import UPDATE_CHUNK

# -- trials -------------------------------------------------------------------


def add_trials(s: Session, study_id: int, rows: Sequence[dict[str, Any]]) -> int:
    """Insert trials (dicts of :class:`Trial` columns), skipping sample indexes already there.

    Returns how many rows were new. Existing rows are left exactly as they were.
    """
    if not rows:
        return 0
    stmt, params = insert_rows(s, Trial, [{**row, "study_id": study_id} for row in rows])
    stmt = stmt.on_conflict_do_nothing(index_elements=["study_id", "sample_index"])
    return len(s.execute(stmt.returning(Trial.id), params).all())


def get_trial(s: Session, trial_id: int) -> Trial:
    trial = s.get(Trial, trial_id)
    if trial is None:
        raise NotFound(f"trial {trial_id} not found")
    return trial


def trials_by_id(s: Session, ids: Sequence[int]) -> list[Trial]:
    """The trials ``ids`` (those that exist), read afresh: moves write below the ORM."""
    if not ids:
        return []
    return list(s.scalars(fresh(select(Trial).where(id_in(s, Trial.id, list(ids))))))


class MemberPlace(NamedTuple):
    """A pending pack's member and where its trial stands in its study's Hyperband: what
    dispatch order reads."""

    trial_id: int
    from_resource: float
    study_id: int
    bracket: int
    rung: int


def member_places(s: Session, pack_ids: Sequence[int]) -> dict[int, list[MemberPlace]]:
    """Pack id -> its members' :class:`MemberPlace` rows (of trials that exist), in one query
    of five columns per member: a fair dispatch order reads every member of every pending
    pack, thousands on a large fleet, and loading them as ORM objects pack by pack took a
    query per pack."""
    out: dict[int, list[MemberPlace]] = {i: [] for i in pack_ids}
    if not out:
        return out
    stmt = (
        select(PackMember.pack_id, PackMember.trial_id, PackMember.from_resource,
               Trial.study_id, Trial.bracket, Trial.rung)
        .join(Trial, Trial.id == PackMember.trial_id)
        .where(id_in(s, PackMember.pack_id, list(out)))
        .order_by(PackMember.pack_id, PackMember.trial_id)
    )  # fmt: skip
    for pack_id, trial_id, done, study_id, bracket, rung in s.execute(stmt):
        out[pack_id].append(MemberPlace(trial_id, done, study_id, bracket, rung))
    return out


def trials_of(
    s: Session,
    study_id: int,
    *,
    status: TrialStatus | Iterable[TrialStatus] | None = None,
    bracket: int | None = None,
    rung: int | None = None,
    iteration: int | None = None,
) -> list[Trial]:
    """A study's trials in id order, optionally filtered by status(es), iteration, bracket
    and rung."""
    stmt = select(Trial).where(Trial.study_id == study_id)
    if status is not None:
        stmt = stmt.where(Trial.status.in_(statuses(status)))
    if iteration is not None:
        stmt = stmt.where(Trial.iteration == iteration)
    if bracket is not None:
        stmt = stmt.where(Trial.bracket == bracket)
    if rung is not None:
        stmt = stmt.where(Trial.rung == rung)
    return list(s.scalars(stmt.order_by(Trial.id)))


def count_trials_by_status(s: Session, study_id: int | None = None) -> dict[TrialStatus, int]:
    """Number of trials per status (every status present, zeros included)."""
    stmt = select(Trial.status, func.count()).group_by(Trial.status)
    if study_id is not None:
        stmt = stmt.where(Trial.study_id == study_id)
    counts = dict.fromkeys(TrialStatus, 0)
    for status, n in s.execute(stmt):
        counts[TrialStatus(status)] = n
    return counts


def count_trials(
    s: Session,
    study_id: int,
    *,
    iteration: int,
    bracket: int,
    rung: int,
    status: Iterable[TrialStatus],
    index_from: int,
    index_to: int,
) -> int:
    """Trials of one bracket at ``rung`` in ``status`` whose sample index is in
    ``[index_from, index_to)``."""
    stmt = select(func.count()).select_from(Trial).where(
        Trial.study_id == study_id, Trial.iteration == iteration, Trial.bracket == bracket,
        Trial.rung == rung, Trial.status.in_(statuses(status)),
        Trial.sample_index >= index_from, Trial.sample_index < index_to,
    )  # fmt: skip
    return int(s.scalar(stmt) or 0)


class TrialBrief(NamedTuple):
    """A trial's scheduling state, without its config: what rung decisions and planning read."""

    id: int
    sample_index: int
    iteration: int
    bracket: int
    rung: int
    status: TrialStatus
    fusion_key: str
    resource_done: float
    measured_resource: float | None  # of its latest measurement
    objective: float | None  # the objective value there (None if not finite)


def _brief_columns() -> list[Any]:
    """The columns of a :class:`TrialBrief`, in its field order."""
    return [getattr(Trial, name) for name in TrialBrief._fields]


def trial_briefs(
    s: Session,
    study_id: int,
    *,
    status: TrialStatus | Iterable[TrialStatus] | None = None,
    bracket: int | None = None,
    iteration: int | None = None,
    checkpointed: bool = False,
) -> list[TrialBrief]:
    """:func:`trials_of` as plain rows of :class:`TrialBrief` columns, in id order (no
    configs: what a scheduler tick needs of thousands of trials); with ``checkpointed``,
    only the trials that have a checkpoint."""
    stmt = select(*_brief_columns())
    stmt = stmt.where(Trial.study_id == study_id)
    if checkpointed:
        stmt = stmt.where(Trial.checkpoint_path.is_not(None), Trial.checkpoint_path != "")
    if status is not None:
        stmt = stmt.where(Trial.status.in_(statuses(status)))
    if iteration is not None:
        stmt = stmt.where(Trial.iteration == iteration)
    if bracket is not None:
        stmt = stmt.where(Trial.bracket == bracket)
    return [TrialBrief(*row) for row in s.execute(stmt.order_by(Trial.id))]


def studies_briefs(
    s: Session, study_ids: Sequence[int], status: Iterable[TrialStatus]
) -> dict[int, list[TrialBrief]]:
    """:func:`trial_briefs` of several studies in one query (a tick plans the ready trials
    of every study of a group together): study id -> its trials in ``status``, in id order."""
    out: dict[int, list[TrialBrief]] = {i: [] for i in study_ids}
    if not out:
        return out
    stmt = (
        select(Trial.study_id, *_brief_columns())
        .where(Trial.study_id.in_(list(out)), Trial.status.in_(statuses(status)))
        .order_by(Trial.id)
    )
    for study_id, *row in s.execute(stmt):
        out[study_id].append(TrialBrief(*row))
    return out


def bracket_briefs(
    s: Session, study_id: int, brackets: Sequence[tuple[int, int]]
) -> dict[tuple[int, int], list[TrialBrief]]:
    """The :class:`TrialBrief` rows of each bracket ``(iteration, s)`` in ``brackets``, in id
    order, read in one query (a tick decides the finished rungs of several at once)."""
    out: dict[tuple[int, int], list[TrialBrief]] = {key: [] for key in brackets}
    if not brackets:
        return out
    stmt = (
        select(*_brief_columns())
        .where(Trial.study_id == study_id)
        .where(tuple_(Trial.iteration, Trial.bracket).in_(list(out)))
        .order_by(Trial.id)
    )
    for row in s.execute(stmt):
        brief = TrialBrief(*row)
        out[brief.iteration, brief.bracket].append(brief)
    return out


def brackets_summary(s: Session, study_id: int) -> dict[tuple[int, int], Counter[TrialStatus]]:
    """Trials per status in each bracket ``(iteration, s)`` of the study, brackets in order
    of their first trial."""
    stmt = (
        select(Trial.iteration, Trial.bracket, Trial.status, func.count(), func.min(Trial.id))
        .where(Trial.study_id == study_id)
        .group_by(Trial.iteration, Trial.bracket, Trial.status)
    )
    first: dict[tuple[int, int], int] = {}
    counts: dict[tuple[int, int], Counter[TrialStatus]] = {}
    for iteration, bracket, status, n, lowest in s.execute(stmt):
        key = (iteration, bracket)
        first[key] = min(lowest, first.get(key, lowest))
        counts.setdefault(key, Counter())[TrialStatus(status)] = n
    return {b: counts[b] for b in sorted(counts, key=first.__getitem__)}


def rung_counts(
    s: Session, study_id: int
) -> dict[tuple[int, int], Counter[tuple[int, TrialStatus]]]:
    """Trials per (rung, status) in each bracket ``(iteration, s)`` of the study."""
    stmt = (
        select(Trial.iteration, Trial.bracket, Trial.rung, Trial.status, func.count())
        .where(Trial.study_id == study_id)
        .group_by(Trial.iteration, Trial.bracket, Trial.rung, Trial.status)
    )
    out: dict[tuple[int, int], Counter[tuple[int, TrialStatus]]] = {}
    for iteration, bracket, rung, status, n in s.execute(stmt):
        out.setdefault((iteration, bracket), Counter())[(rung, TrialStatus(status))] = n
    return out


def set_trials(s: Session, ids: Sequence[int], **values: Any) -> None:
    """Set columns other than ``status`` on the trials ``ids`` in bulk (status changes go
    through :func:`service.store.transitions.move_trials`)."""
    if "status" in values:
        raise ValueError("a trial's status changes only through store.move_trials")
    chunk = max(len(ids), 1) if is_postgres(s) else UPDATE_CHUNK
    for start in range(0, len(ids), chunk):
        s.execute(
            update(Trial).where(id_in(s, Trial.id, ids[start : start + chunk])).values(**values),
            execution_options={"synchronize_session": False},
        )


# -- measurements -------------------------------------------------------------


def record_measurement(
    s: Session,
    trial_id: int,
    resource: float,
    metrics: dict[str, Any],
    *,
    metric: str | None = None,
) -> None:
    """Store a trial's metrics at cumulative ``resource``; a repeated report replaces them.

    The trial's ``measured_resource`` and ``objective`` follow its measurement
    at the largest resource, so that the read side can rank trials in SQL.
    ``metric`` is the study's objective metric; callers that know it (a worker
    writing every epoch) save a query per trial by passing it.
    """
    record_measurements(
        s, [(trial_id, resource, metrics)], metric=metric or _metric_of(s, trial_id)
    )


def record_measurements(
    s: Session, rows: Sequence[tuple[int, float, dict[str, Any]]], *, metric: str
) -> None:
    """:func:`record_measurement` for many trials of one study at once (an array's epoch):
    one INSERT and one executemany UPDATE, whatever the number of trials."""
    if not rows:
        return
    now = utcnow()
    values = [
        {"trial_id": tid, "resource": float(res), "metrics": metrics, "created_at": now}
        for tid, res, metrics in rows
    ]
    stmt = insert_for(s, Measurement).values(values)
    stmt = stmt.on_conflict_do_update(
        index_elements=["trial_id", "resource"], set_={"metrics": stmt.excluded.metrics}
    )
    s.execute(stmt)
    trials = Trial.__table__
    assert isinstance(trials, Table)
    latest = (
        update(trials)
        .where(
            trials.c.id == bindparam("tid"),
            or_(
                trials.c.measured_resource.is_(None),
                trials.c.measured_resource <= bindparam("res"),
            ),
        )
        .values(measured_resource=bindparam("res"), objective=bindparam("obj"))
    )
    s.execute(
        latest,
        [
            {"tid": tid, "res": float(res), "obj": value_of(metrics, metric)}
            for tid, res, metrics in rows
        ],
    )


def _metric_of(s: Session, trial_id: int) -> str:
    """The objective metric of the trial's study (remembered for the session's lifetime)."""
    known: dict[int, str] = s.info.setdefault("objective_metric", {})
    if trial_id not in known:
        spec = s.scalar(
            select(Study.spec).join(Trial, Trial.study_id == Study.id).where(Trial.id == trial_id)
        )
        if spec is None:
            raise NotFound(f"trial {trial_id} not found")
        known[trial_id] = StoredSpec.of(spec).objective.metric
    return known[trial_id]


def measurements_of(s: Session, trial_id: int) -> list[Measurement]:
    stmt = select(Measurement).where(Measurement.trial_id == trial_id)
    stmt = stmt.order_by(Measurement.resource)
    return list(s.scalars(fresh(stmt)))


def latest_measurement(s: Session, trial_id: int) -> Measurement | None:
    """The measurement at the largest resource reached, if any."""
    stmt = (
        select(Measurement)
        .where(Measurement.trial_id == trial_id)
        .order_by(Measurement.resource.desc())
        .limit(1)
    )
    return s.scalars(fresh(stmt)).first()


# -- promotions ---------------------------------------------------------------


class Promotion(NamedTuple):
    """A trial promoted out of ``rung`` of bracket ``(iteration, bracket)`` with ``value``."""

    trial_id: int
    value: float | None
    iteration: int
    bracket: int
    rung: int


def record_promotions(
    s: Session,
    study_id: int,
    bracket: int,
    rung: int,
    items: Sequence[tuple[int, float | None]],
    iteration: int = 0,
) -> int:
    """Record (trial id, objective value) pairs promoted out of ``rung``; returns the new ones."""
    return record_promotions_of(
        s, study_id, [Promotion(tid, v, iteration, bracket, rung) for tid, v in items]
    )


def record_promotions_of(s: Session, study_id: int, promotions: Sequence[Promotion]) -> int:
    """Record the ``promotions`` of a study, of any rungs and brackets, in one INSERT (in
    their order); returns how many were new."""
    if not promotions:
        return 0
    rows = [{"study_id": study_id, **p._asdict()} for p in promotions]
    stmt, params = insert_rows(s, RungPromotion, rows)
    stmt = stmt.on_conflict_do_nothing(index_elements=["trial_id", "rung"])
    return len(s.execute(stmt.returning(RungPromotion.id), params).all())


def promotions_of(s: Session, study_id: int) -> list[RungPromotion]:
    stmt = (
        select(RungPromotion)
        .where(RungPromotion.study_id == study_id)
        .order_by(
            RungPromotion.iteration, RungPromotion.bracket, RungPromotion.rung, RungPromotion.id
        )
    )
    return list(s.scalars(stmt))


def values_at(
    s: Session,
    study_id: int,
    ids: Sequence[int],
    resource: float,
    metric: str,
    *,
    bracket: int | None = None,
    rung: int | None = None,
    status: TrialStatus | None = None,
    iteration: int | None = None,
) -> dict[int, float | None]:
    """Each of the trials ``ids``' ``metric`` measured at ``resource`` (None when missing).

    The trials are selected by their study (and ``bracket``, ``rung``, ``status``: a
    superset of ``ids``), so that no list of thousands of ids goes into the statement;
    only measurements near ``resource`` are read, and ``math.isclose`` decides.
    """
    values: dict[int, float | None] = dict.fromkeys(ids)
    if not values:
        return values
    where = [Trial.study_id == study_id]
    if iteration is not None:
        where.append(Trial.iteration == iteration)
    if bracket is not None:
        where.append(Trial.bracket == bracket)
    if rung is not None:
        where.append(Trial.rung == rung)
    if status is not None:
        where.append(Trial.status == status)
    near = 2e-9 * (abs(resource) + 1)  # wider than isclose's tolerances
    rows = s.execute(
        select(Measurement.trial_id, Measurement.resource, Measurement.metrics)
        .join(Trial, Trial.id == Measurement.trial_id)
        .where(*where, Measurement.resource.between(resource - near, resource + near))
    )
    for trial_id, res, metrics in rows:
        if trial_id in values and math.isclose(res, resource, rel_tol=1e-9, abs_tol=1e-9):
            v = metrics.get(metric)
            values[trial_id] = float(v) if isinstance(v, int | float) else None
    return values


def forget_checkpoints(s: Session, trial_ids: list[int]) -> None:
    """The trials' checkpoints were deleted: they have none any more."""
    if trial_ids:
        s.execute(
            update(Trial).where(Trial.id.in_(trial_ids)).values(checkpoint_path=None),
            execution_options={"synchronize_session": False},
        )


def studies_with_trials(
    s: Session, study_ids: Sequence[int], status: TrialStatus | Iterable[TrialStatus]
) -> set[int]:
    """Those of ``study_ids`` with at least one trial in ``status`` (one statement)."""
    if not study_ids:
        return set()
    stmt = (
        select(Trial.study_id)
        .where(Trial.study_id.in_(list(study_ids)), Trial.status.in_(statuses(status)))
        .distinct()
    )
    return set(s.scalars(stmt))
