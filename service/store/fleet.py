"""Workers' heartbeats, the memory and throughput profiles they measure, and leases."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    case,
    delete,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from packtune.tuning import THROUGHPUT_SMOOTHING
from service.models import (
    Lease,
    Profile,
    Worker,
    WorkerStatus,
    utcnow,
)
from service.store._sql import fresh, insert_for

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
    stmt = insert_for(s, Worker).values(name=name, started_at=now, **fields)
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
    return list(s.scalars(fresh(stmt)))


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


def forget_dead_workers(s: Session, after_seconds: float) -> int:
    """Delete the rows of workers dead and silent for ``after_seconds``; how many. A worker
    started without a name is ``host-pid``, a new row each start: kept for ever, they
    filled ``/api/workers`` and ``/metrics`` (one ``worker_alive`` series each)."""
    cutoff = utcnow() - timedelta(seconds=after_seconds)
    stmt = delete(Worker).where(Worker.status == WorkerStatus.dead, Worker.last_heartbeat < cutoff)
    result = s.execute(stmt, execution_options={"synchronize_session": False})
    return int(getattr(result, "rowcount", 0) or 0)


# -- profiles -----------------------------------------------------------------


def _profile_key(workload: str, fusion_key: str, device_kind: str) -> list[Any]:
    return [
        Profile.workload == workload,
        Profile.fusion_key == fusion_key,
        Profile.device_kind == device_kind,
    ]


def get_profile(s: Session, workload: str, fusion_key: str, device_kind: str) -> Profile | None:
    stmt = select(Profile).where(*_profile_key(workload, fusion_key, device_kind))
    return s.scalars(fresh(stmt)).first()


def _locked_profile(s: Session, workload: str, fusion_key: str, device_kind: str) -> Profile:
    """Get or create the profile row, locked until commit (PostgreSQL; SQLite's write lock
    already serialises writers), so read-modify-write updates are not lost."""
    create = insert_for(s, Profile).values(
        workload=workload,
        fusion_key=fusion_key,
        device_kind=device_kind,
        throughput={},
        concurrent={},
        updated_at=utcnow(),
    )
    s.execute(
        create.on_conflict_do_nothing(index_elements=["workload", "fusion_key", "device_kind"])
    )
    stmt = select(Profile).where(*_profile_key(workload, fusion_key, device_kind))
    return s.scalars(fresh(stmt.with_for_update())).one()


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


def measured_curve(profile: Profile | None) -> tuple[dict[int, float], dict[int, float]]:
    """A profile's trial-steps/s by array size: ``(alone, at_once)``."""
    if profile is None:
        return {}, {}
    return (
        {int(k): float(v) for k, v in (profile.throughput or {}).items()},
        {int(k): float(v) for k, v in (profile.concurrent or {}).items()},
    )


def record_throughput(
    s: Session,
    workload: str,
    fusion_key: str,
    device_kind: str,
    k: int,
    trial_steps_per_second: float,
    concurrent: bool = False,
) -> float:
    """Fold a throughput reading for arrays of size ``k`` into the profile: one array
    training alone (``throughput``), or, with ``concurrent``, a pack's arrays of the key, k
    trials each, training at once (``concurrent``: the whole pack's trial-steps/s).

    Each table keeps an exponential moving average per k (keys are ``str(k)``):
    ``new = (1 - w) * old + w * reading`` with ``w = THROUGHPUT_SMOOTHING``; the
    first reading is taken as is. Returns the stored value.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not math.isfinite(trial_steps_per_second) or trial_steps_per_second <= 0:
        raise ValueError(f"throughput must be a positive number, got {trial_steps_per_second}")
    profile = _locked_profile(s, workload, fusion_key, device_kind)
    column = "concurrent" if concurrent else "throughput"
    table = dict(getattr(profile, column) or {})
    old = table.get(str(k))
    w = THROUGHPUT_SMOOTHING
    value = trial_steps_per_second if old is None else (1 - w) * old + w * trial_steps_per_second
    table[str(k)] = value
    setattr(profile, column, table)  # a new dict, so the change is seen
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
        insert_for(s, Lease)
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


def lease_holder(s: Session, name: str) -> str | None:
    """Who holds the lease ``name`` (expired or not), if anyone."""
    return s.scalar(select(Lease.holder).where(Lease.name == name))


def release_lease(s: Session, name: str, holder: str) -> bool:
    """Give the lease up if ``holder`` has it; returns whether it did."""
    stmt = (
        delete(Lease)
        .where(Lease.name == name, Lease.holder == holder)
        .returning(Lease.name)
        .execution_options(synchronize_session=False)
    )
    return s.execute(stmt).first() is not None


def worker_names(s: Session, *, but: WorkerStatus | None = None) -> set[str]:
    """Names of the workers that ever sent a heartbeat (but those with status ``but``)."""
    stmt = select(Worker.name)
    if but is not None:
        stmt = stmt.where(Worker.status != but)
    return set(s.scalars(stmt))


def profiles_of(s: Session, workload: str, kind: str) -> dict[str, Profile]:
    """The workload's measured profiles on device kind ``kind``, by fusion key."""
    rows = s.scalars(
        select(Profile).where(Profile.workload == workload, Profile.device_kind == kind)
    )
    return {p.fusion_key: p for p in rows}
