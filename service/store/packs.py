"""Packs: create, queue, claim (one worker wins), finish."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import (
    select,
    update,
)
from sqlalchemy.orm import Session

from packtune.errors import NotFound
from service.models import (
    Pack,
    PackMember,
    PackStatus,
    utcnow,
)
from service.store._sql import fresh, insert_rows, statuses

CLAIMABLE_PACK = (PackStatus.pending, PackStatus.queued)
FINISHED_PACK = frozenset(
    {PackStatus.completed, PackStatus.failed, PackStatus.split, PackStatus.cancelled}
)


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
    stmt, params = insert_rows(s, PackMember, rows)
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
        stmt = stmt.where(Pack.status.in_(statuses(status)))
    return list(s.scalars(fresh(stmt.order_by(Pack.id))))


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
