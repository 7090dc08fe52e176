"""Every status change of trials, packs and studies: the allowed moves and the guarded writes.

A write names the status it moves rows *to*. The UPDATE touches only rows whose
current status may move there (:data:`TRIAL_FROM`, :data:`PACK_FROM`,
:data:`STUDY_FROM`), so a row that moved on meanwhile -- a trial cancelled while
its pack trained, a pack finished by an earlier run of its job -- is left
alone, the way Optuna's storages refuse to modify a finished trial. Callers
may narrow the guard further (``only_from``). Each function returns what it
moved; nothing else in the code writes a ``status`` column.

The moves, as the scheduler and the workers make them (docs/design.md draws
them as a state machine):

- trial: pending -> queued (planned) -> running (claimed) -> paused (at its
  rung) or pending (a segment on the way, or its pack gave its device up at a
  training step); paused -> pending (promoted),
  stopped (not promoted) or completed (last rung); running -> diverged or
  failed; running -> queued (its pack split or retried); queued -> pending (its
  pack withdrawn before it started, for a study with a better fair-share claim);
  any state that can still move -> cancelled.
- pack: pending -> queued (dispatched) -> running (claimed) -> completed,
  split (out of memory) or failed; queued/running -> pending (re-queued);
  pending -> failed (out of attempts); any unfinished state -> cancelled.
- study: pending -> running -> completed or failed; pending/running ->
  cancelled or failed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, func, or_, select, update
from sqlalchemy.orm import Session

from packtune.errors import Conflict
from packtune.tuning import UPDATE_CHUNK
from service.models import (
    CheckStatus,
    Pack,
    PackMember,
    PackStatus,
    Study,
    StudyStatus,
    Trial,
    TrialStatus,
    WorkloadCheck,
    utcnow,
)
from service.store._sql import id_in, is_postgres

T, P, S = TrialStatus, PackStatus, StudyStatus

#: a pack member in one of these still needs its pack
_STILL_TRAINING = (TrialStatus.pending, TrialStatus.queued, TrialStatus.running)

#: trial status -> the statuses a trial may move to it from
TRIAL_FROM: Mapping[TrialStatus, frozenset[TrialStatus]] = {
    T.queued: frozenset({T.pending, T.running}),
    T.running: frozenset({T.queued, T.running}),  # running: claimed again by a retried job
    T.paused: frozenset({T.running}),
    T.pending: frozenset({T.running, T.paused, T.queued}),
    T.stopped: frozenset({T.paused}),
    T.completed: frozenset({T.paused}),
    T.diverged: frozenset({T.running}),
    T.failed: frozenset({T.pending, T.queued, T.running}),
    T.cancelled: frozenset({T.pending, T.queued, T.running, T.paused}),
}
#: pack status -> the statuses a pack may move to it from
PACK_FROM: Mapping[PackStatus, frozenset[PackStatus]] = {
    P.queued: frozenset({P.pending}),
    P.running: frozenset({P.pending, P.queued}),
    P.pending: frozenset({P.queued, P.running}),
    P.completed: frozenset({P.running}),
    P.split: frozenset({P.running}),
    P.failed: frozenset({P.pending, P.running}),
    P.cancelled: frozenset({P.pending, P.queued, P.running}),
}
#: study status -> the statuses a study may move to it from
STUDY_FROM: Mapping[StudyStatus, frozenset[StudyStatus]] = {
    S.running: frozenset({S.pending}),
    S.completed: frozenset({S.running}),
    S.failed: frozenset({S.pending, S.running}),
    S.cancelled: frozenset({S.pending, S.running}),
}
FINISHED_PACK = frozenset({P.completed, P.failed, P.split, P.cancelled})
FINISHED_STUDY = frozenset({S.completed, S.failed, S.cancelled})


E = TypeVar("E", TrialStatus, PackStatus, StudyStatus)


def _guard(table: Mapping[E, frozenset[E]], to: E, only_from: Collection[E] | None) -> list[E]:
    allowed = table.get(to, frozenset())
    if only_from is not None:
        allowed = allowed & frozenset(only_from)
    return sorted(allowed)


def move_trials(
    s: Session,
    ids: Sequence[int],
    to: TrialStatus,
    *,
    only_from: Collection[TrialStatus] | None = None,
    only_at: float | None = None,
    **values: Any,
) -> int:
    """Move the trials ``ids`` that may go ``to`` (and are in ``only_from``, if given, and at
    cumulative resource ``only_at``, if given), setting ``values`` too; returns how many
    moved.

    Bulk, below the ORM: Trial objects already loaded in the session are not updated
    (callers work on ids and :class:`~service.store.TrialBrief` rows). One UPDATE on
    PostgreSQL, one per :data:`~packtune.tuning.UPDATE_CHUNK` ids on SQLite.
    """
    allowed = _guard(TRIAL_FROM, to, only_from)
    if not ids or not allowed:
        return 0
    chunk = max(len(ids), 1) if is_postgres(s) else UPDATE_CHUNK
    at = [] if only_at is None else [Trial.resource_done.between(only_at - 1e-9, only_at + 1e-9)]
    return sum(
        _update_trials(
            s, [id_in(s, Trial.id, ids[start : start + chunk]), *at], allowed, to, values
        )
        for start in range(0, len(ids), chunk)
    )


def move_study_trials(s: Session, study_id: int, to: TrialStatus) -> int:
    """Move every trial of the study that may go ``to`` (a cancelled study's rest)."""
    allowed = _guard(TRIAL_FROM, to, None)
    return _update_trials(s, [Trial.study_id == study_id], allowed, to, {})


def _update_trials(
    s: Session, where: list[Any], allowed: list[TrialStatus], to: TrialStatus, values: Any
) -> int:
    stmt = update(Trial).where(*where, Trial.status.in_(allowed)).values(status=to, **values)
    result = s.execute(stmt, execution_options={"synchronize_session": False})
    return int(getattr(result, "rowcount", 0) or 0)


def move_pack(
    s: Session,
    pack: Pack | int,
    to: PackStatus,
    *,
    only_from: Collection[PackStatus] | None = None,
    where: ColumnElement[bool] | None = None,
    **values: Any,
) -> bool:
    """Move one pack ``to`` if it may go there (and ``where`` holds of it); a final status
    also stamps ``finished_at``. A loaded :class:`Pack` is read again after the move.
    Returns whether it moved."""
    pack_id = pack if isinstance(pack, int) else pack.id
    if to in FINISHED_PACK:
        values.setdefault("finished_at", utcnow())
    guard = [Pack.id == pack_id, Pack.status.in_(_guard(PACK_FROM, to, only_from))]
    stmt = (
        update(Pack)
        .where(*guard, *([where] if where is not None else []))
        .values(status=to, **values)
        .returning(Pack.id)
    )
    moved = s.execute(stmt, execution_options={"synchronize_session": False}).first() is not None
    if moved and isinstance(pack, Pack):
        s.refresh(pack)  # the statement flushed pending changes first: nothing is lost
    return moved


def of_study(study_id: int) -> ColumnElement[bool]:
    """A WHERE clause: the pack trains a trial of the study. ``Pack.study_id`` is only the
    pack's first study: packs planned across studies hold trials of several."""
    members = (
        select(PackMember.pack_id)
        .join(Trial, Trial.id == PackMember.trial_id)
        .where(Trial.study_id == study_id)
    )
    return or_(Pack.study_id == study_id, Pack.id.in_(members))


def move_study_packs(
    s: Session, study_id: int, to: PackStatus, *, only_from: Collection[PackStatus]
) -> int:
    """Move the study's packs in ``only_from`` that may go ``to`` (e.g. unstarted ->
    cancelled), but not one shared with trials of another study that can still train."""
    others = (
        select(PackMember.pack_id)
        .join(Trial, Trial.id == PackMember.trial_id)
        .where(Trial.study_id != study_id, Trial.status.in_(_STILL_TRAINING))
    )
    result = s.execute(
        update(Pack)
        .where(
            of_study(study_id),
            Pack.id.not_in(others),
            Pack.status.in_(_guard(PACK_FROM, to, only_from)),
        )
        .values(status=to),
        execution_options={"synchronize_session": False},
    )
    return int(getattr(result, "rowcount", 0) or 0)


def move_study(
    s: Session,
    study: Study,
    to: StudyStatus,
    *,
    error: str | None = None,
    stop_reason: str | None = None,
) -> None:
    """Move a study ``to``: the move to running stamps ``started_at``, a final status
    ``finished_at``; ``stop_reason``: the budget that ended it. :class:`~packtune.errors.
    Conflict` when it may not go there (it is finished already, or a pending study was
    asked to complete)."""
    now = utcnow()
    values: dict[str, Any] = {"status": to}
    if to is StudyStatus.running and study.started_at is None:
        values["started_at"] = now
    if to in FINISHED_STUDY:
        values["finished_at"] = now
    if error is not None:
        values["error"] = error
    if stop_reason is not None:
        values["stop_reason"] = stop_reason
    stmt = (
        update(Study)
        .where(Study.id == study.id, Study.status.in_(_guard(STUDY_FROM, to, None)))
        .values(**values)
        .returning(Study.id)
    )
    moved = s.execute(stmt, execution_options={"synchronize_session": False}).first()
    s.refresh(study)  # the statement flushed pending changes first: nothing is lost
    if moved is None:
        raise Conflict(f"study {study.id} is {study.status.value}; it cannot become {to.value}")


def run_end(study: Study, now: datetime) -> datetime:
    """Where ``study``'s run ends so far: where its last scheduler stopped, its finish, or
    ``now``."""
    return study.interrupted_at or study.finished_at or now


def run_seconds(study: Study, now: datetime) -> float | None:
    """Seconds ``study`` has run (what its ``max_seconds`` budget counts): from its start to
    :func:`run_end`, less the time it sat idle before (failed until retried, or with no
    scheduler); None before it started."""
    if study.started_at is None:
        return None
    return max(0.0, (run_end(study, now) - study.started_at).total_seconds() - study.idle_seconds)


def interrupt_studies(s: Session, now: datetime) -> None:
    """The scheduler stops and none may follow soon: each running study's clock stops at
    ``now`` (:func:`resume_studies` starts it again)."""
    s.execute(
        update(Study)
        .where(Study.status == StudyStatus.running, Study.interrupted_at.is_(None))
        .values(interrupted_at=now),
        execution_options={"synchronize_session": False},
    )


def resume_studies(s: Session, now: datetime, live: Collection[str] = ()) -> None:
    """The leading scheduler's every tick: the time each running study sat with no scheduler
    since the last one stopped (:func:`interrupt_studies`) is not its running time, but for
    its packs that went on training meanwhile (queued on RQ workers): the gap counts from
    the last of them to finish, and not at all while one still trains on a worker of
    ``live`` (one that died meanwhile trains nothing). A study finished meanwhile
    (cancelled) keeps its stamp: :func:`run_seconds` ends there."""
    stopped = s.execute(
        select(Study.id, Study.interrupted_at, Study.idle_seconds).where(
            Study.interrupted_at.is_not(None), Study.status == StudyStatus.running
        )
    ).all()
    for study_id, since, idle in stopped:
        assert since is not None  # selected so
        trained = s.execute(
            select(func.max(Pack.finished_at)).where(of_study(study_id), Pack.finished_at > since)
        ).scalar()
        training = s.execute(
            select(Pack.id)
            .where(
                of_study(study_id),
                Pack.status == PackStatus.running,
                Pack.worker_name.in_(list(live)),
            )
            .limit(1)
        ).first()
        gap = 0.0 if training else (now - max(since, trained or since)).total_seconds()
        s.execute(
            update(Study)
            .where(Study.id == study_id, Study.interrupted_at == since)
            .values(idle_seconds=idle + max(0.0, gap), interrupted_at=None),
            execution_options={"synchronize_session": False},
        )


def retry_study(s: Session, study: Study) -> list[int]:
    """The one way out of ``failed``: a failed study's failed trials go back to ``pending``
    (their checkpoints and measurements kept) where nobody of their bracket has moved past
    their rung, and the study runs again. Returns the trials; :class:`Conflict` when the
    study is not failed or has no trial that can run again (a rung decided without a trial
    cannot be decided again with it). The time it sat failed is added to its
    ``idle_seconds``: a ``max_seconds`` budget counts the time it ran, not the time until
    someone retried it."""
    if study.status is not StudyStatus.failed:
        raise Conflict(f"study {study.id} is {study.status.value}; only a failed study is retried")
    rungs = s.execute(
        select(Trial.iteration, Trial.bracket, func.max(Trial.rung))
        .where(Trial.study_id == study.id)
        .group_by(Trial.iteration, Trial.bracket)
    )
    top = {(iteration, bracket): rung for iteration, bracket, rung in rungs}
    failed = s.execute(
        select(Trial.id, Trial.iteration, Trial.bracket, Trial.rung).where(
            Trial.study_id == study.id, Trial.status == TrialStatus.failed
        )
    ).all()
    ids = [tid for tid, it, bracket, rung in failed if rung == top[(it, bracket)]]
    if not ids:
        raise Conflict(f"study {study.id} has no failed trial whose rung is still open")
    for start in range(0, len(ids), UPDATE_CHUNK):
        s.execute(
            update(Trial)
            .where(id_in(s, Trial.id, ids[start : start + UPDATE_CHUNK]),
                   Trial.status == TrialStatus.failed)
            .values(status=TrialStatus.pending, error=None),
            execution_options={"synchronize_session": False},
        )  # fmt: skip
    values: dict[str, Any] = {
        "status": StudyStatus.running, "finished_at": None, "error": None,
        "interrupted_at": None,
    }  # fmt: skip
    if study.started_at is not None and study.finished_at is not None:
        # the time it sat failed (or, before, with no scheduler) is not its running time
        since = min(t for t in (study.finished_at, study.interrupted_at) if t is not None)
        idle = (utcnow() - since).total_seconds()
        values["idle_seconds"] = study.idle_seconds + max(0.0, idle)
    s.execute(
        update(Study)
        .where(Study.id == study.id, Study.status == StudyStatus.failed)
        .values(**values),
        execution_options={"synchronize_session": False},
    )
    s.refresh(study)
    return ids


#: workload checks: queued -> running on a worker -> passed | failed | error (queued ->
#: error too: its job failed or vanished before a worker started it)
CHECK_FROM: dict[CheckStatus, tuple[CheckStatus, ...]] = {
    CheckStatus.running: (CheckStatus.queued,),
    CheckStatus.passed: (CheckStatus.running,),
    CheckStatus.failed: (CheckStatus.running,),
    CheckStatus.error: (CheckStatus.queued, CheckStatus.running),
}


def move_check(s: Session, check_id: int, to: CheckStatus, **values: Any) -> bool:
    """Workload check ``check_id`` to ``to`` (with ``values``) if its status allows the move;
    False when it had moved on (run already, or closed)."""
    result = s.execute(
        update(WorkloadCheck)
        .where(WorkloadCheck.id == check_id, WorkloadCheck.status.in_(CHECK_FROM[to]))
        .values(status=to, **values),
        execution_options={"synchronize_session": False},
    )
    return bool(getattr(result, "rowcount", 0))
