"""Repository functions: every read and write the services make.

Each function takes a :class:`~sqlalchemy.orm.Session` first, flushes but
never commits; the caller's :func:`service.db.session_scope` commits. Writes
that two processes may race on (adding trials, measurements, promotions,
claiming a pack, heartbeats, profiles, leases) are single conditional
statements -- ``INSERT ... ON CONFLICT`` or ``UPDATE ... WHERE <state>`` --
so they are idempotent and safe on SQLite and PostgreSQL alike.

Times are timezone-aware UTC from the application clock; hosts are expected to
keep their clocks in sync (NTP) for heartbeats and leases to mean the same
thing everywhere.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import (
    JSON,
    ColumnElement,
    Integer,
    Select,
    Text,
    any_,
    case,
    cast,
    column,
    delete,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import InstrumentedAttribute, Session

from service.db import json_dumps
from service.errors import NotFound, SpecError
from service.models import (
    Base,
    Lease,
    Measurement,
    Pack,
    PackMember,
    PackStatus,
    Profile,
    RungPromotion,
    Study,
    StudyStatus,
    Trial,
    TrialStatus,
    Worker,
    WorkerStatus,
    utcnow,
)
from service.objective import objective_of, value_of

StatusT = TypeVar("StatusT", TrialStatus, PackStatus)

FINISHED_STUDY = frozenset({StudyStatus.completed, StudyStatus.failed, StudyStatus.cancelled})
CLAIMABLE_PACK = (PackStatus.pending, PackStatus.queued)
FINISHED_PACK = frozenset(
    {PackStatus.completed, PackStatus.failed, PackStatus.split, PackStatus.cancelled}
)
THROUGHPUT_SMOOTHING = 0.5
"""Weight of a new throughput reading in the per-k moving average (1.0 keeps the latest)."""


def _insert(s: Session, model: type[Base]) -> postgresql.Insert | sqlite.Insert:
    """The dialect's INSERT, which knows ``ON CONFLICT``."""
    backend = s.get_bind().dialect.name
    if backend == "postgresql":
        return postgresql.insert(model)
    if backend == "sqlite":
        return sqlite.insert(model)
    raise NotImplementedError(f"unsupported database backend: {backend}")


def _statuses(status: StatusT | Iterable[StatusT]) -> list[StatusT]:
    if isinstance(status, TrialStatus | PackStatus):
        return [status]  # type: ignore[list-item]
    return list(status)


def _fresh(stmt: Select[Any]) -> Select[Any]:
    # Rows may have changed under objects already in the session (upserts and
    # conditional UPDATEs run below the ORM), so reads overwrite them.
    return stmt.execution_options(populate_existing=True)


# -- studies ------------------------------------------------------------------


def create_study(s: Session, *, name: str, workload: str, spec: dict[str, Any], seed: int) -> Study:
    if "\x00" in name:  # PostgreSQL text cannot hold it (a 500 there); refused on every backend
        raise SpecError("name", "must not contain the NUL character")
    study = Study(name=name, workload=workload, spec=spec, seed=seed, status=StudyStatus.pending)
    s.add(study)
    s.flush()
    return study


def get_study(s: Session, study_id: int) -> Study:
    study = s.get(Study, study_id)
    if study is None:
        raise NotFound(f"study {study_id} not found")
    return study


def list_studies(s: Session, *, limit: int = 100, offset: int = 0) -> tuple[list[Study], int]:
    """One page of studies, newest first, and the total number of studies."""
    total = s.scalar(select(func.count()).select_from(Study)) or 0
    page = s.scalars(select(Study).order_by(Study.id.desc()).limit(limit).offset(offset))
    return list(page), total


def set_study_status(
    s: Session, study: Study, status: StudyStatus, *, error: str | None = None
) -> None:
    """Set ``status``: the first move to running stamps ``started_at``, a final status
    ``finished_at``."""
    now = utcnow()
    study.status = status
    if status is StudyStatus.running and study.started_at is None:
        study.started_at = now
    if status in FINISHED_STUDY:
        study.finished_at = now
    if error is not None:
        study.error = error
    s.flush()


def delete_study(s: Session, study_id: int) -> None:
    """Delete a study; the database cascades to its trials, packs, promotions, measurements."""
    get_study(s, study_id)
    s.execute(delete(Study).where(Study.id == study_id))


# -- trials -------------------------------------------------------------------


def add_trials(s: Session, study_id: int, rows: Sequence[dict[str, Any]]) -> int:
    """Insert trials (dicts of :class:`Trial` columns), skipping sample indexes already there.

    Returns how many rows were new. Existing rows are left exactly as they were.
    """
    if not rows:
        return 0
    stmt, params = _insert_rows(s, Trial, [{**row, "study_id": study_id} for row in rows])
    stmt = stmt.on_conflict_do_nothing(index_elements=["study_id", "sample_index"])
    return len(s.execute(stmt.returning(Trial.id), params).all())


def get_trial(s: Session, trial_id: int) -> Trial:
    trial = s.get(Trial, trial_id)
    if trial is None:
        raise NotFound(f"trial {trial_id} not found")
    return trial


def trials_of(
    s: Session,
    study_id: int,
    *,
    status: TrialStatus | Iterable[TrialStatus] | None = None,
    bracket: int | None = None,
    rung: int | None = None,
) -> list[Trial]:
    """A study's trials in id order, optionally filtered by status(es), bracket and rung."""
    stmt = select(Trial).where(Trial.study_id == study_id)
    if status is not None:
        stmt = stmt.where(Trial.status.in_(_statuses(status)))
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


class TrialBrief(NamedTuple):
    """A trial's scheduling state, without its config: what rung decisions and planning read."""

    id: int
    bracket: int
    rung: int
    status: TrialStatus
    fusion_key: str
    resource_done: float


def trial_briefs(
    s: Session,
    study_id: int,
    *,
    status: TrialStatus | Iterable[TrialStatus] | None = None,
    bracket: int | None = None,
) -> list[TrialBrief]:
    """:func:`trials_of` as plain rows of :class:`TrialBrief` columns, in id order.

    Loading 10,582 trials as ORM objects with their JSON configs took ~0.3 s on PostgreSQL,
    and a tick did it twice; these rows take ~0.04 s.
    """
    stmt = select(*(getattr(Trial, name) for name in TrialBrief._fields))
    stmt = stmt.where(Trial.study_id == study_id)
    if status is not None:
        stmt = stmt.where(Trial.status.in_(_statuses(status)))
    if bracket is not None:
        stmt = stmt.where(Trial.bracket == bracket)
    return [TrialBrief(*row) for row in s.execute(stmt.order_by(Trial.id))]


def brackets_summary(s: Session, study_id: int) -> dict[int, Counter[TrialStatus]]:
    """Trials per status in each bracket of the study, brackets in order of their first trial."""
    stmt = (
        select(Trial.bracket, Trial.status, func.count(), func.min(Trial.id))
        .where(Trial.study_id == study_id)
        .group_by(Trial.bracket, Trial.status)
    )
    first: dict[int, int] = {}
    counts: dict[int, Counter[TrialStatus]] = {}
    for bracket, status, n, lowest in s.execute(stmt):
        first[bracket] = min(lowest, first.get(bracket, lowest))
        counts.setdefault(bracket, Counter())[TrialStatus(status)] = n
    return {b: counts[b] for b in sorted(counts, key=first.__getitem__)}


#: trial ids per UPDATE on SQLite (its bound-parameter limit is 32,766)
UPDATE_CHUNK = 10_000


def set_trials(s: Session, ids: Sequence[int], **values: Any) -> None:
    """Set ``values`` on the trials ``ids`` in bulk, below the ORM.

    Trial objects already loaded in the session are not updated: callers work on
    :class:`TrialBrief` rows. One UPDATE on PostgreSQL, one per :data:`UPDATE_CHUNK`
    ids on SQLite. (Attribute changes on ORM objects flushed one UPDATE per trial:
    ~4,500 statements and ~2 s for a rung decision over 6,561 trials.)
    """
    chunk = max(len(ids), 1) if _is_postgres(s) else UPDATE_CHUNK
    for start in range(0, len(ids), chunk):
        s.execute(
            update(Trial)
            .where(id_in(s, Trial.id, ids[start : start + chunk]))
            .values(**values),
            execution_options={"synchronize_session": False},
        )


def id_in(
    s: Session, column: ColumnElement[int] | InstrumentedAttribute[int], ids: Sequence[int]
) -> ColumnElement[bool]:
    """``column IN (ids)``; on PostgreSQL ``column = ANY(:ids)``, one array parameter: psycopg
    spent ~0.1 s converting a statement with an expanded list of thousands of ids."""
    if _is_postgres(s):
        return column == any_(literal(list(ids), postgresql.ARRAY(Integer)))
    return column.in_(list(ids))


def _is_postgres(s: Session) -> bool:
    return s.get_bind().dialect.name == "postgresql"


def _insert_rows(
    s: Session, model: type[Base], rows: Sequence[dict[str, Any]]
) -> tuple[postgresql.Insert | sqlite.Insert, list[dict[str, Any]] | None]:
    """An INSERT of ``rows`` (dicts with the same keys, JSON-able values) and the parameters to
    execute it with; the caller adds ``ON CONFLICT`` and ``RETURNING``.

    On PostgreSQL a single statement selecting from ``json_to_recordset()`` of one JSON
    text parameter. A multi-row VALUES list (insertmanyvalues, as RETURNING needs) or an
    executemany of thousands of rows took psycopg 0.5-0.8 s to convert and send, and
    arrays per column ~0.15 s (it escapes each string of an array with a regex).
    """
    stmt = _insert(s, model)
    if not _is_postgres(s):
        return stmt, list(rows)
    table = model.__table__
    names = list(rows[0])
    as_json = {name for name in names if isinstance(table.c[name].type, JSON)}
    payload = json.dumps(
        [{name: _recordset_value(row[name], name in as_json) for name in names} for row in rows],
        allow_nan=False,
    )
    source = (
        func.json_to_recordset(cast(literal(payload, Text), JSON))
        .table_valued(*(column(n, Text if n in as_json else table.c[n].type) for n in names))
        .render_derived(with_types=True)
    )
    picked = [cast(source.c[n], JSON) if n in as_json else source.c[n] for n in names]
    return stmt.from_select(names, select(*picked)), None


def _recordset_value(value: Any, as_json: bool) -> Any:
    """``value`` as ``json_to_recordset`` reads it back: JSON columns as their text (written
    as every JSON column is), non-finite floats as the words PostgreSQL's float input takes."""
    if as_json:
        return json_dumps(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


# -- measurements -------------------------------------------------------------


def record_measurement(
    s: Session, trial_id: int, resource: float, metrics: dict[str, Any]
) -> None:
    """Store a trial's metrics at cumulative ``resource``; a repeated report replaces them.

    The trial's ``measured_resource`` and ``objective`` follow its measurement
    at the largest resource, so that the read side can rank trials in SQL.
    """
    resource = float(resource)
    stmt = _insert(s, Measurement).values(
        trial_id=trial_id, resource=resource, metrics=metrics, created_at=utcnow()
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["trial_id", "resource"], set_={"metrics": stmt.excluded.metrics}
    )
    s.execute(stmt)
    latest = (
        update(Trial)
        .where(
            Trial.id == trial_id,
            or_(Trial.measured_resource.is_(None), Trial.measured_resource <= resource),
        )
        .values(measured_resource=resource, objective=value_of(metrics, _metric_of(s, trial_id)))
        .execution_options(synchronize_session=False)
    )
    s.execute(latest)


def _metric_of(s: Session, trial_id: int) -> str:
    """The objective metric of the trial's study (remembered for the session's lifetime)."""
    known: dict[int, str] = s.info.setdefault("objective_metric", {})
    if trial_id not in known:
        spec = s.scalar(
            select(Study.spec).join(Trial, Trial.study_id == Study.id).where(Trial.id == trial_id)
        )
        if spec is None:
            raise NotFound(f"trial {trial_id} not found")
        known[trial_id] = objective_of(spec)[0]
    return known[trial_id]


def measurements_of(s: Session, trial_id: int) -> list[Measurement]:
    stmt = select(Measurement).where(Measurement.trial_id == trial_id)
    stmt = stmt.order_by(Measurement.resource)
    return list(s.scalars(_fresh(stmt)))


def latest_measurement(s: Session, trial_id: int) -> Measurement | None:
    """The measurement at the largest resource reached, if any."""
    stmt = (
        select(Measurement)
        .where(Measurement.trial_id == trial_id)
        .order_by(Measurement.resource.desc())
        .limit(1)
    )
    return s.scalars(_fresh(stmt)).first()


# -- promotions ---------------------------------------------------------------


def record_promotions(
    s: Session,
    study_id: int,
    bracket: int,
    rung: int,
    items: Sequence[tuple[int, float | None]],
) -> int:
    """Record (trial id, objective value) pairs promoted out of ``rung``; returns the new ones."""
    if not items:
        return 0
    rows = [
        {"study_id": study_id, "trial_id": trial_id, "bracket": bracket, "rung": rung, "value": v}
        for trial_id, v in items
    ]
    stmt, params = _insert_rows(s, RungPromotion, rows)
    stmt = stmt.on_conflict_do_nothing(index_elements=["trial_id", "rung"])
    return len(s.execute(stmt.returning(RungPromotion.id), params).all())


def promotions_of(s: Session, study_id: int) -> list[RungPromotion]:
    stmt = (
        select(RungPromotion)
        .where(RungPromotion.study_id == study_id)
        .order_by(RungPromotion.bracket, RungPromotion.rung, RungPromotion.id)
    )
    return list(s.scalars(stmt))


# -- packs --------------------------------------------------------------------


def create_pack(
    s: Session,
    *,
    study_id: int,
    members: Sequence[tuple[int, str, float, float]],
    device: str | None = None,
    estimated_bytes: int | None = None,
    parent_id: int | None = None,
) -> Pack:
    """A ``pending`` pack of units of work (trial id, fusion key, from resource, to resource)."""
    if not members:
        raise ValueError("a pack needs at least one member")
    pack = Pack(
        study_id=study_id,
        status=PackStatus.pending,
        device=device,
        estimated_bytes=estimated_bytes,
        parent_id=parent_id,
        attempts=0,
    )
    s.add(pack)
    s.flush()
    # one statement, not an ORM object per member: packs of hundreds of trials are planned
    # inside a scheduler tick (256 members: ~0.15 s as objects)
    rows = [
        {"pack_id": pack.id, "trial_id": t, "fusion_key": k, "from_resource": a, "to_resource": b}
        for t, k, a, b in members
    ]
    stmt, params = _insert_rows(s, PackMember, rows)
    s.execute(stmt, params)
    s.expire(pack, ["members"])
    return pack


def get_pack(s: Session, pack_id: int) -> Pack:
    pack = s.get(Pack, pack_id)
    if pack is None:
        raise NotFound(f"pack {pack_id} not found")
    return pack


def packs_of(
    s: Session, study_id: int, *, status: PackStatus | Iterable[PackStatus] | None = None
) -> list[Pack]:
    stmt = select(Pack).where(Pack.study_id == study_id)
    if status is not None:
        stmt = stmt.where(Pack.status.in_(_statuses(status)))
    return list(s.scalars(_fresh(stmt.order_by(Pack.id))))


def queue_pack(s: Session, pack_id: int, *, job_id: str | None = None) -> bool:
    """Move a ``pending`` pack to ``queued``; False if it was not pending (someone queued it)."""
    stmt = (
        update(Pack)
        .where(Pack.id == pack_id, Pack.status == PackStatus.pending)
        .values(status=PackStatus.queued, job_id=job_id, enqueued_at=utcnow())
        .returning(Pack.id)
    )
    return s.execute(stmt).first() is not None


def claim_pack(s: Session, pack_id: int, *, worker_name: str, device: str) -> Pack | None:
    """Atomically take a ``queued`` (or ``pending``) pack to ``running`` for this worker.

    Attempts are counted when the scheduler dispatches, not here. Returns None when the
    pack is not claimable: another worker has it, or it finished or was cancelled.
    """
    stmt = (
        update(Pack)
        .where(Pack.id == pack_id, Pack.status.in_(CLAIMABLE_PACK))
        .values(
            status=PackStatus.running,
            worker_name=worker_name,
            device=device,
            started_at=utcnow(),
        )
        .returning(Pack.id)
        .execution_options(synchronize_session=False)
    )
    if s.execute(stmt).first() is None:
        return None
    return s.get(Pack, pack_id, populate_existing=True)


def finish_pack(
    s: Session,
    pack: Pack,
    status: PackStatus,
    *,
    peak_bytes: int | None = None,
    train_seconds: float | None = None,
    error: str | None = None,
) -> None:
    """Close a pack with a final status (completed, failed, split or cancelled)."""
    if status not in FINISHED_PACK:
        raise ValueError(f"finish_pack needs a final status, not {status!r}")
    pack.status = status
    pack.finished_at = utcnow()
    if peak_bytes is not None:
        pack.peak_bytes = peak_bytes
    if train_seconds is not None:
        pack.train_seconds = train_seconds
    if error is not None:
        pack.error = error
    s.flush()


# -- workers ------------------------------------------------------------------


def heartbeat(
    s: Session,
    *,
    name: str,
    host: str,
    device_kind: str,
    gpus: list[dict[str, Any]],
    memory_budget: int | None = None,
    status: WorkerStatus = WorkerStatus.idle,
) -> Worker:
    """Register or refresh the worker ``name``; a worker back from the dead restarts its clock."""
    now = utcnow()
    fields = {
        "host": host,
        "device_kind": device_kind,
        "gpus": list(gpus),
        "memory_budget": memory_budget,
        "status": status,
        "last_heartbeat": now,
    }
    stmt = _insert(s, Worker).values(name=name, started_at=now, **fields)
    refresh: dict[str, Any] = {key: stmt.excluded[key] for key in fields}
    refresh["started_at"] = case(
        (Worker.status == WorkerStatus.dead, stmt.excluded.started_at), else_=Worker.started_at
    )
    upsert = stmt.on_conflict_do_update(index_elements=["name"], set_=refresh).returning(Worker)
    return s.scalars(upsert, execution_options={"populate_existing": True}).one()


def live_workers(s: Session, timeout_seconds: float) -> list[Worker]:
    """Workers heard from within the last ``timeout_seconds``, by name."""
    cutoff = utcnow() - timedelta(seconds=timeout_seconds)
    stmt = select(Worker).where(Worker.last_heartbeat >= cutoff).order_by(Worker.name)
    return list(s.scalars(_fresh(stmt)))


def mark_dead_workers(s: Session, timeout_seconds: float) -> list[str]:
    """Mark workers silent for ``timeout_seconds`` dead; returns the names newly marked."""
    cutoff = utcnow() - timedelta(seconds=timeout_seconds)
    stmt = (
        update(Worker)
        .where(Worker.last_heartbeat < cutoff, Worker.status != WorkerStatus.dead)
        .values(status=WorkerStatus.dead)
        .returning(Worker.name)
    )
    names = s.scalars(stmt, execution_options={"synchronize_session": "fetch"})
    return sorted(names)


# -- profiles -----------------------------------------------------------------


def _profile_key(workload: str, fusion_key: str, device_kind: str) -> list[Any]:
    return [
        Profile.workload == workload,
        Profile.fusion_key == fusion_key,
        Profile.device_kind == device_kind,
    ]


def get_profile(s: Session, workload: str, fusion_key: str, device_kind: str) -> Profile | None:
    stmt = select(Profile).where(*_profile_key(workload, fusion_key, device_kind))
    return s.scalars(_fresh(stmt)).first()


def _locked_profile(s: Session, workload: str, fusion_key: str, device_kind: str) -> Profile:
    """Get or create the profile row, locked until commit (PostgreSQL; SQLite's write lock
    already serialises writers), so read-modify-write updates are not lost."""
    create = _insert(s, Profile).values(
        workload=workload,
        fusion_key=fusion_key,
        device_kind=device_kind,
        throughput={},
        updated_at=utcnow(),
    )
    s.execute(
        create.on_conflict_do_nothing(index_elements=["workload", "fusion_key", "device_kind"])
    )
    stmt = select(Profile).where(*_profile_key(workload, fusion_key, device_kind))
    return s.scalars(_fresh(stmt.with_for_update())).one()


def set_memory_model(
    s: Session,
    workload: str,
    fusion_key: str,
    device_kind: str,
    base_bytes: int,
    per_trial_bytes: int,
) -> Profile:
    """Set the memory model ``bytes(k) = base_bytes + k * per_trial_bytes``."""
    profile = _locked_profile(s, workload, fusion_key, device_kind)
    profile.base_bytes = int(base_bytes)
    profile.per_trial_bytes = int(per_trial_bytes)
    s.flush()
    return profile


def record_throughput(
    s: Session,
    workload: str,
    fusion_key: str,
    device_kind: str,
    k: int,
    trial_steps_per_second: float,
) -> float:
    """Fold a throughput reading for fused arrays of size ``k`` into the profile.

    The table keeps an exponential moving average per k (keys are ``str(k)``):
    ``new = (1 - w) * old + w * reading`` with ``w = THROUGHPUT_SMOOTHING``; the
    first reading is taken as is. Returns the stored value.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not math.isfinite(trial_steps_per_second) or trial_steps_per_second <= 0:
        raise ValueError(f"throughput must be a positive number, got {trial_steps_per_second}")
    profile = _locked_profile(s, workload, fusion_key, device_kind)
    table = dict(profile.throughput or {})
    old = table.get(str(k))
    w = THROUGHPUT_SMOOTHING
    value = trial_steps_per_second if old is None else (1 - w) * old + w * trial_steps_per_second
    table[str(k)] = value
    profile.throughput = table  # a new dict, so the change is seen
    s.flush()
    return value


# -- leases -------------------------------------------------------------------


def acquire_lease(s: Session, name: str, holder: str, ttl_seconds: float) -> bool:
    """Take or renew the lease ``name`` for ``ttl_seconds``; True iff ``holder`` now holds it.

    The lease is won when it did not exist, when ``holder`` already held it, or
    when the previous holder let it expire. Commit promptly: until then a
    concurrent contender on PostgreSQL waits on the row, and SQLite's write
    lock is held.
    """
    now = utcnow()
    expires = now + timedelta(seconds=ttl_seconds)
    create = (
        _insert(s, Lease)
        .values(name=name, holder=holder, expires_at=expires)
        .on_conflict_do_nothing(index_elements=["name"])
        .returning(Lease.name)
    )
    if s.execute(create).first() is not None:
        return True
    take = (
        update(Lease)
        .where(Lease.name == name, or_(Lease.holder == holder, Lease.expires_at < now))
        .values(holder=holder, expires_at=expires)
        .returning(Lease.name)
        .execution_options(synchronize_session=False)
    )
    return s.execute(take).first() is not None


def release_lease(s: Session, name: str, holder: str) -> bool:
    """Give the lease up if ``holder`` has it; returns whether it did."""
    stmt = (
        delete(Lease)
        .where(Lease.name == name, Lease.holder == holder)
        .returning(Lease.name)
        .execution_options(synchronize_session=False)
    )
    return s.execute(stmt).first() is not None
