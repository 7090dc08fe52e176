"""Studies: create, read, list, delete (status changes: :mod:`.transitions`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    delete,
    func,
    select,
    update,
)
from sqlalchemy.orm import Session

from packtune.errors import NotFound, SpecError
from service.models import Pack, PackMember, Study, StudyStatus, Trial, TrialStatus, utcnow
from service.store._sql import fresh
from service.store.packs import pack_seconds
from service.store.transitions import FINISHED_STUDY as FINISHED_STUDY
from service.store.transitions import of_study

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


def lock_study(s: Session, study_id: int) -> Study:
    """The study re-read under its row lock (PostgreSQL: ``FOR UPDATE``), so that no status
    change slips in between a write's check and the write itself.

    The lock waits for a transaction that holds the row; when that one deleted the study,
    the read finds nothing: :class:`NotFound`, as for a study that never was (a refresh of
    the object read before raised SQLAlchemy's ``InvalidRequestError``, a 500).
    """
    stmt = select(Study).where(Study.id == study_id).with_for_update()
    study = s.scalars(fresh(stmt)).one_or_none()
    if study is None:
        raise NotFound(f"study {study_id} not found")
    return study


def list_studies(
    s: Session,
    *,
    limit: int = 100,
    offset: int = 0,
    status: Iterable[StudyStatus] | None = None,
) -> tuple[list[Study], int]:
    """One page of studies, newest first, and how many there are (in ``status``, if given)."""
    where = [] if status is None else [Study.status.in_(list(status))]
    total = s.scalar(select(func.count()).select_from(Study).where(*where)) or 0
    query = select(Study).where(*where).order_by(Study.id.desc()).limit(limit).offset(offset)
    return list(s.scalars(query)), total


def update_spec(s: Session, study: Study, **fields: Any) -> None:
    """Set top-level fields of the study's stored spec (e.g. ``priority``, ``owner``); a new
    dict, so that the JSON column is written."""
    study.spec = {**study.spec, **fields}
    s.flush()


def delete_study(s: Session, study_id: int) -> None:
    """Delete a study; the database cascades to its trials, packs, promotions, measurements."""
    get_study(s, study_id)
    # a pack planned across studies names the first as its own: hand it to the next one
    # before the cascade takes it (its members of this study go with their trials)
    shared = (
        select(PackMember.pack_id, func.min(Trial.study_id))
        .join(Trial, Trial.id == PackMember.trial_id)
        .join(Pack, Pack.id == PackMember.pack_id)
        .where(Pack.study_id == study_id, Trial.study_id != study_id)
        .group_by(PackMember.pack_id)
    )
    for pack_id, other in s.execute(shared).all():
        s.execute(update(Pack).where(Pack.id == pack_id).values(study_id=other))
    # its share of the packs it shared so far stays its own, charged to nobody: the studies
    # left in them did not use that device time (their fair-share levels); what the packs
    # train from now on is theirs alone
    mine = select(Pack.id).where(of_study(study_id))
    for pack_id, by_study in pack_seconds(s, mine, utcnow()).items():
        if len(by_study) > 1 and by_study.get(study_id, 0.0) > 0:
            s.execute(
                update(Pack)
                .where(Pack.id == pack_id)
                .values(departed_seconds=Pack.departed_seconds + by_study[study_id])
            )
    s.execute(delete(Study).where(Study.id == study_id))


def studies_with_status(s: Session, status: Iterable[StudyStatus]) -> list[Study]:
    """The studies in ``status``, in id order."""
    return list(s.scalars(select(Study).where(Study.status.in_(list(status))).order_by(Study.id)))


def studies_with_trials_in(
    s: Session, status: StudyStatus, trial_status: Iterable[TrialStatus]
) -> list[Study]:
    """The studies in ``status`` that still have a trial in ``trial_status`` (e.g. cancelled
    studies whose trials can still move), as they are now: a study read earlier in the
    transaction may have moved since (cancelled through the API mid-tick), and its object
    kept the old status and no ``finished_at``."""
    movable = select(Trial.study_id).where(Trial.status.in_(list(trial_status)))
    stmt = select(Study).where(Study.status == status, Study.id.in_(movable))
    return list(s.scalars(fresh(stmt.order_by(Study.id))))
