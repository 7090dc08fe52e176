"""Packs: create, queue, claim (one worker wins), finish."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from packtune.errors import NotFound
from packtune.fleet import split_seconds
from packtune.packing import retry_delay
from service.models import Pack, PackMember, PackStatus, Trial, TrialStatus, utcnow
from service.store._sql import fresh, id_in, insert_rows, statuses
from service.store.transitions import FINISHED_PACK, move_pack, move_trials, of_study
from service.store.trials import trials_by_id

CLAIMABLE_PACK = (PackStatus.pending, PackStatus.queued)


# -- packs --------------------------------------------------------------------


#: a unit of work in a new pack: (trial id, fusion key, from resource, to resource), then
#: optionally the segment (-1, the whole trial, when left out) and the array it trains in
#: (0 when left out)
MemberRow = (
    tuple[int, str, float, float]
    | tuple[int, str, float, float, int]
    | tuple[int, str, float, float, int, int]
)


@dataclass(frozen=True)
class NewPack:
    """A ``pending`` pack to add (:func:`add_packs`)."""

    study_id: int
    members: Sequence[MemberRow]
    device: str | None = None
    estimated_bytes: int | None = None
    parent_id: int | None = None


def add_packs(s: Session, packs: Sequence[NewPack]) -> list[int]:
    """Add ``pending`` packs of units of work, below the ORM (a plan makes several inside a
    scheduler tick, each of hundreds of units): an INSERT per pack for its id, in order, and
    one INSERT for every pack's members. Returns the packs' ids."""
    if any(not pack.members for pack in packs):
        raise ValueError("a pack needs at least one member")
    ids: list[int] = []
    rows: list[dict[str, Any]] = []
    for pack in packs:
        pack_id = s.execute(
            insert(Pack)
            .values(
                study_id=pack.study_id, status=PackStatus.pending, device=pack.device,
                estimated_bytes=pack.estimated_bytes, parent_id=pack.parent_id, attempts=0,
            )
            .returning(Pack.id)
        ).scalar_one()  # fmt: skip
        ids.append(pack_id)
        rows += [
            {"pack_id": pack_id, "trial_id": m[0], "fusion_key": m[1], "from_resource": m[2],
             "to_resource": m[3], "segment": m[4] if len(m) > 4 else -1,
             "array_no": m[5] if len(m) > 5 else 0}
            for m in pack.members
        ]  # fmt: skip
    if rows:
        stmt, params = insert_rows(s, PackMember, rows)
        s.execute(stmt, params)
    return ids


def create_pack(
    s: Session,
    *,
    study_id: int,
    members: Sequence[MemberRow],
    device: str | None = None,
    estimated_bytes: int | None = None,
    parent_id: int | None = None,
) -> Pack:
    """A ``pending`` pack of units of work (:data:`MemberRow`), read back as a :class:`Pack`
    (:func:`add_packs` adds several without reading them)."""
    new = NewPack(study_id, members, device, estimated_bytes, parent_id)
    [pack_id] = add_packs(s, [new])
    return get_pack(s, pack_id)


def get_pack(s: Session, pack_id: int) -> Pack:
    pack = s.get(Pack, pack_id)
    if pack is None:
        raise NotFound(f"pack {pack_id} not found")
    return pack


def packs_of(
    s: Session, study_id: int, *, status: PackStatus | Iterable[PackStatus] | None = None
) -> list[Pack]:
    stmt = select(Pack).where(of_study(study_id))
    if status is not None:
        stmt = stmt.where(Pack.status.in_(statuses(status)))
    return list(s.scalars(fresh(stmt.order_by(Pack.id))))


def queue_pack(s: Session, pack_id: int, *, job_id: str | None = None) -> bool:
    """Move a ``pending`` pack to ``queued``; False if it was not pending (someone queued it)."""
    return move_pack(s, pack_id, PackStatus.queued, job_id=job_id, enqueued_at=utcnow())


def claim_pack(
    s: Session, pack_id: int, *, worker_name: str, device: str, job_id: str | None = None
) -> Pack | None:
    """Atomically take a ``queued`` (or ``pending``) pack to ``running`` for this worker;
    ``job_id``: only for the job the pack was last dispatched as.

    Attempts are counted when the scheduler dispatches, not here. Returns None when the
    pack is not claimable: another worker has it, it finished or was cancelled, or it was
    dispatched again since ``job_id`` (a stale job of an earlier attempt: run, it would
    train the pack while the current attempt's job found it running and ended, and the
    scheduler, seeing that job end with the pack unfinished, dispatched it once more).
    """
    claimed = move_pack(
        s, pack_id, PackStatus.running, only_from=CLAIMABLE_PACK,
        where=Pack.job_id == job_id if job_id is not None else None,
        worker_name=worker_name, device=device, started_at=utcnow(),
    )  # fmt: skip
    return s.get(Pack, pack_id, populate_existing=True) if claimed else None


def finish_pack(
    s: Session,
    pack: Pack,
    status: PackStatus,
    *,
    peak_bytes: int | None = None,
    train_seconds: float | None = None,
    error: str | None = None,
    arrays: list[Any] | None = None,
) -> bool:
    """Close a pack with a final status (completed, failed, split or cancelled); False when
    it had been closed already. ``arrays``: how each of its arrays ran."""
    if status not in FINISHED_PACK:
        raise ValueError(f"finish_pack needs a final status, not {status!r}")
    values: dict[str, Any] = {
        "peak_bytes": peak_bytes, "train_seconds": train_seconds, "error": error,
        "arrays": arrays,
    }  # fmt: skip
    return move_pack(s, pack, status, **{k: v for k, v in values.items() if v is not None})


def packs_with_status(s: Session, status: PackStatus | Iterable[PackStatus]) -> list[Pack]:
    """Every study's packs in ``status``, in id order."""
    stmt = select(Pack).where(Pack.status.in_(statuses(status))).order_by(Pack.id)
    return list(s.scalars(fresh(stmt)))


def packs_per_device(s: Session, status: Iterable[PackStatus]) -> Counter[str]:
    """How many packs in ``status`` each target device has, across studies."""
    rows = s.execute(
        select(Pack.device, func.count())
        .where(Pack.status.in_(statuses(status)))
        .group_by(Pack.device)
    )
    return Counter({str(d): int(n) for d, n in rows if d is not None})


def fusion_keys_of_packs(s: Session, status: Iterable[PackStatus]) -> set[str]:
    """The fusion keys of every pack in ``status`` (of any study)."""
    rows = s.scalars(
        select(PackMember.fusion_key)
        .join(Pack, Pack.id == PackMember.pack_id)
        .where(Pack.status.in_(statuses(status)))
        .distinct()
    )
    return set(rows)


def studies_of_packs(s: Session, pack_ids: Iterable[int]) -> dict[int, set[int]]:
    """Pack id -> the ids of the studies whose trials it holds."""
    ids = list(pack_ids)
    out: dict[int, set[int]] = {i: set() for i in ids}
    if not ids:
        return out
    stmt = (
        select(PackMember.pack_id, Trial.study_id)
        .join(Trial, Trial.id == PackMember.trial_id)
        .where(PackMember.pack_id.in_(ids))
        .distinct()
    )
    for pack_id, study_id in s.execute(stmt):
        out[pack_id].add(study_id)
    return out


def device_seconds(s: Session, study_ids: Iterable[int], now: datetime) -> dict[int, float]:
    """Device-seconds each study's trials have trained so far: every pack's time on its
    device, its earlier attempts' (``spent_seconds``) and its current one's (to ``now``
    while it runs), split between the studies it holds in proportion to the resource each
    trains in it (:func:`packtune.fleet.split_seconds`), less what was charged to studies
    since deleted (``departed_seconds``)."""
    ids = list(study_ids)
    used = dict.fromkeys(ids, 0.0)
    if not ids:
        return used
    theirs = (
        select(PackMember.pack_id)
        .join(Trial, Trial.id == PackMember.trial_id)
        .where(Trial.study_id.in_(ids))
    )
    for by_study in pack_seconds(s, theirs, now).values():
        for study_id, share in by_study.items():
            if study_id in used:
                used[study_id] += share
    return used


def pack_seconds(s: Session, pack_ids: Any, now: datetime) -> dict[int, dict[int, float]]:
    """Pack id -> study id -> the device-seconds of the pack charged to the study so far
    (:func:`device_seconds`), for the started packs of ``pack_ids`` (ids or a subquery)."""
    stmt = (
        select(
            Pack.id, Pack.started_at, Pack.finished_at, Pack.spent_seconds, Pack.departed_seconds,
            Trial.study_id, func.sum(PackMember.to_resource - PackMember.from_resource),
        )
        .join(PackMember, PackMember.pack_id == Pack.id)
        .join(Trial, Trial.id == PackMember.trial_id)
        .where(or_(Pack.started_at.is_not(None), Pack.spent_seconds > 0), Pack.id.in_(pack_ids))
        .group_by(Pack.id, Pack.started_at, Pack.finished_at, Pack.spent_seconds,
                  Pack.departed_seconds, Trial.study_id)
    )  # fmt: skip
    packs: dict[int, tuple[float, float, dict[int, float]]] = {}
    for pack_id, started, finished, spent, departed, study_id, work in s.execute(stmt):
        took = max(0.0, ((finished or now) - started).total_seconds()) if started else 0.0
        took += float(spent or 0.0)
        packs.setdefault(pack_id, (took, float(departed or 0.0), {}))[2][study_id] = float(
            work or 0.0
        )
    return {
        pack_id: split_seconds(took, by_study, departed)
        for pack_id, (took, departed, by_study) in packs.items()
    }


def study_shares(s: Session, pack_ids: Iterable[int]) -> dict[int, dict[int, float]]:
    """Pack id -> study id -> the study's share of the pack's device time (the trial-resource
    it trains there over the pack's; :func:`packtune.fleet.split_seconds`)."""
    ids = list(pack_ids)
    if not ids:
        return {}
    stmt = (
        select(PackMember.pack_id, Trial.study_id,
               func.sum(PackMember.to_resource - PackMember.from_resource))
        .join(Trial, Trial.id == PackMember.trial_id)
        .where(PackMember.pack_id.in_(ids))
        .group_by(PackMember.pack_id, Trial.study_id)
    )  # fmt: skip
    work: dict[int, dict[int, float]] = {}
    for pack_id, study_id, amount in s.execute(stmt):
        work.setdefault(pack_id, {})[study_id] = float(amount or 0.0)
    return {pack_id: split_seconds(1.0, by_study) for pack_id, by_study in work.items()}


def unfinished_members(
    s: Session,
    pack: Pack,
    status: Iterable[TrialStatus] = (TrialStatus.queued, TrialStatus.running),
) -> list[PackMember]:
    """The pack's members that are still its business: in ``status`` and still at the
    unit's from-resource. A member that finished this pack's unit (an earlier attempt
    recorded it) or has moved on to another pack is not, whatever its status says:
    a retry must neither train it again nor fail it."""
    trials = {t.id: t for t in trials_by_id(s, [m.trial_id for m in pack.members])}
    wanted = set(status)
    return [
        m for m in pack.members
        if m.trial_id in trials
        and trials[m.trial_id].status in wanted
        and math.isclose(trials[m.trial_id].resource_done, m.from_resource, abs_tol=1e-9)
    ]  # fmt: skip


def planned_segments(s: Session, trial_ids: Sequence[int]) -> dict[int, set[tuple[float, int]]]:
    """``(from_resource, segment)`` of every segment unit of ``trial_ids`` in a pack that
    still stands (not cancelled, failed or split: those units are planned again): a trial
    of segment units may have some of a span's segments planned and the rest to come."""
    if not trial_ids:
        return {}
    gone = (PackStatus.cancelled, PackStatus.failed, PackStatus.split)
    stmt = (
        select(PackMember.trial_id, PackMember.from_resource, PackMember.segment)
        .join(Pack, Pack.id == PackMember.pack_id)
        .where(id_in(s, PackMember.trial_id, trial_ids), PackMember.segment >= 0,
               Pack.status.not_in(gone))
    )  # fmt: skip
    out: dict[int, set[tuple[float, int]]] = {}
    for trial_id, start, segment in s.execute(stmt):
        out.setdefault(int(trial_id), set()).add((float(start), int(segment)))
    return out


def request_yield(s: Session, pack_ids: Iterable[int]) -> list[int]:
    """Ask running packs to give their device up at their next training step (their job
    reads :func:`yield_requested` while it trains). A pack asked already, or no longer
    running, is left alone. Returns the packs asked now."""
    ids = sorted(set(pack_ids))
    if not ids:
        return []
    stmt = (
        update(Pack)
        .where(
            Pack.id.in_(ids),
            Pack.status == PackStatus.running,
            Pack.yield_requested_at.is_(None),
        )
        .values(yield_requested_at=utcnow())
        .returning(Pack.id)
    )
    return sorted(int(i) for i in s.scalars(stmt))


def yield_requested(s: Session, pack_id: int) -> bool:
    """Whether pack ``pack_id`` was asked to give its device up."""
    stmt = select(Pack.yield_requested_at).where(Pack.id == pack_id)
    return s.scalar(stmt) is not None


def release_members(s: Session, pack: Pack) -> list[int]:
    """A pack that gave its device up: its members still running at the unit's start (an
    array that had not begun) are ``pending`` again, to be planned anew; those that trained
    part of the unit were made ``pending`` at the (fractional) epoch they reached. Returns
    the trials released."""
    ids = [m.trial_id for m in unfinished_members(s, pack, (TrialStatus.running,))]
    move_trials(s, ids, TrialStatus.pending, only_from=(TrialStatus.running,))
    return ids


def requeue_packs_of(s: Session, worker_name: str, reason: str) -> list[int]:
    """Put back to ``pending`` every pack ``running`` on ``worker_name``, with its members
    still at the unit's start back to ``queued``: a worker starting under a name learns
    that its previous incarnation died holding them (its heartbeat name lives on, so the
    scheduler would wait for the job's timeout). Returns the packs' ids."""
    stmt = select(Pack).where(Pack.status == PackStatus.running, Pack.worker_name == worker_name)
    packs = list(s.scalars(fresh(stmt)))
    return [p.id for p in packs if requeue_pack(s, p, error=reason, fault=True, backoff=0.0)]


def requeue_pack(s: Session, pack: Pack, *, error: str, fault: bool, backoff: float) -> bool:
    """A running pack's attempt is over without finishing: the pack waits for a retry
    (:func:`retry_pack`) and its members still at the unit's start, running, are queued
    again, but for those another running pack trains too (a trial's other segment unit,
    whose end moves the trial only from running). False when the pack had moved on (then
    its members are left alone)."""
    members = [m.trial_id for m in unfinished_members(s, pack, (TrialStatus.running,))]
    if not retry_pack(s, pack, error=error, fault=fault, backoff=backoff):
        return False
    held = trained_elsewhere(s, pack, members)
    move_trials(s, [t for t in members if t not in held], TrialStatus.queued)
    return True


def trained_elsewhere(s: Session, pack: Pack, trial_ids: Sequence[int]) -> set[int]:
    """Those of ``trial_ids`` that a running pack other than ``pack`` holds a unit of."""
    if not trial_ids:
        return set()
    stmt = (
        select(PackMember.trial_id)
        .join(Pack, Pack.id == PackMember.pack_id)
        .where(id_in(s, PackMember.trial_id, trial_ids), Pack.id != pack.id,
               Pack.status == PackStatus.running)
    )  # fmt: skip
    return set(s.scalars(stmt))


def finished_before(pack: Pack, trials: Mapping[int, Trial]) -> bool:
    """Every member of the pack is past its unit's start (``trials``: the members' rows): an
    attempt trained it (and, for some, another pack since)."""
    return bool(pack.members) and all(
        m.trial_id in trials and trials[m.trial_id].resource_done > m.from_resource + 1e-9
        for m in pack.members
    )


def retry_pack(s: Session, pack: Pack, *, error: str, fault: bool, backoff: float) -> bool:
    """Back to ``pending`` for another attempt, not dispatched before
    :func:`~packtune.packing.retry_delay` of ``backoff`` seconds after its attempts so far
    (0: at once); ``fault``: the attempt ended in a fault that is not the trials' (it does not
    count toward ``max_attempts``). False when the pack had moved on (finished, cancelled),
    and when every unit was trained: the attempt ended after its units' ends (killed before
    closing the pack), so the pack is completed, with ``error`` kept, instead of waiting for
    a dispatch with nothing to train (and staying pending if its study ended first).

    Its ``started_at`` is cleared: a pack's start is its current attempt's, and the wait for
    the next one is not device time (:func:`device_seconds` and :func:`busy_intervals` count
    a started pack to now while it has no end). The attempt's own time, from its start to
    now, is added to ``spent_seconds``: it held the device for the pack's studies, and
    :func:`device_seconds` charges it to them."""
    trials = {t.id: t for t in trials_by_id(s, [m.trial_id for m in pack.members])}
    if finished_before(pack, trials):
        finish_pack(s, pack, PackStatus.completed, error=error)
        return False
    now = utcnow()
    delay = retry_delay(backoff, pack.attempts, random.random())
    retry_after = now + timedelta(seconds=delay) if delay > 0 else None
    values: dict[str, Any] = {"error": error, "retry_after": retry_after, "started_at": None}
    if pack.started_at is not None:
        took = max(0.0, (now - pack.started_at).total_seconds())
        values["spent_seconds"] = Pack.spent_seconds + took
    if fault:
        values["faults"] = Pack.faults + 1
    return move_pack(s, pack, PackStatus.pending, **values)


def busy_intervals(
    s: Session, study_ids: Iterable[int], now: datetime
) -> dict[int, list[tuple[datetime, datetime]]]:
    """Study id -> the (start, end) of every started pack holding its trials (to ``now``
    while one runs), in start order."""
    ids = list(study_ids)
    out: dict[int, list[tuple[datetime, datetime]]] = {i: [] for i in ids}
    if not ids:
        return out
    stmt = (
        select(Trial.study_id, Pack.id, Pack.started_at, Pack.finished_at)
        .join(PackMember, PackMember.pack_id == Pack.id)
        .join(Trial, Trial.id == PackMember.trial_id)
        .where(Trial.study_id.in_(ids), Pack.started_at.is_not(None))
        .distinct()
    )
    for study_id, _, started, finished in s.execute(stmt):
        if started is not None:
            out[study_id].append((started, finished or now))
    for spans in out.values():
        spans.sort()
    return out


def typical_pack_seconds(s: Session, last: int = 50) -> float | None:
    """The median time on its device of the last ``last`` finished packs (None: none yet)."""
    rows = s.execute(
        select(Pack.started_at, Pack.finished_at)
        .where(Pack.status == PackStatus.completed, Pack.started_at.is_not(None))
        .order_by(Pack.id.desc())
        .limit(last)
    ).all()
    took = sorted((b - a).total_seconds() for a, b in rows if a is not None and b is not None)
    return took[len(took) // 2] if took else None
