"""Brackets and their rungs, packs, workers, workloads and measured array sizes."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime

from sqlalchemy import String, func, select, type_coerce
from sqlalchemy.orm import Session, selectinload

from packtune.hyperband import total_trials
from packtune.iterations import asha_ladder, asha_slots
from packtune.packing import planned_array_size, segment_key
from packtune.spec import StoredSpec
from packtune.tuning import UPDATE_CHUNK
from service import store
from service.models import (
    Pack,
    PackStatus,
    Profile,
    Trial,
    Worker,
    WorkerStatus,
)
from service.queries.rows import Row

# -- brackets -----------------------------------------------------------------------------


def brackets(s: Session, study_id: int) -> list[Row]:
    """Each bracket (iteration by iteration, highest ``s`` first) with its planned rungs and
    the trials in each; the first iteration's brackets are listed before any is sampled,
    a later iteration's once it has trials.

    A trial is in rung ``i`` if it reached it (its current rung is ``i`` or
    later). At its current rung it shows its status; rungs it has left show
    ``paused`` (where it stood when promoted) with ``promoted`` true: a trial's
    rung only ever advances by a promotion (:func:`service.lifecycle.advance_brackets`
    records both in one transaction), so the rungs below its current one are
    exactly those it was promoted from. One row per trial is read, as plain
    strings (a study of 10,000 trials answers in tens of milliseconds).
    """
    study = store.get_study(s, study_id)
    spec = StoredSpec.of(study.spec)
    plan = spec.brackets
    shown = list(enumerate(plan))  # (index j, rungs): bracket s = len(plan) - 1 - j
    asha = spec.scheduler == "asha"  # one ladder, bracket s_max's, of an iteration's trials
    # each ASHA batch's own size: the last one may be cut short by max_trials
    batch = {slot.iteration: slot.n for slot in asha_slots(
        plan, spec.budget.iterations(), spec.budget.max_trials)} if asha else {}  # fmt: skip
    members: dict[tuple[int, int, int], list[Row]] = defaultdict(list)
    stmt = (
        select(
            Trial.id, Trial.iteration, Trial.bracket, Trial.rung, type_coerce(Trial.status, String)
        )
        .where(Trial.study_id == study_id)
        .order_by(Trial.id)
    )
    started = {0}
    for trial_id, iteration, bracket_s, current, status in s.execute(stmt):
        started.add(iteration)
        for i in range(current):
            members[(iteration, bracket_s, i)].append(
                {"trial_id": trial_id, "status": "paused", "promoted": True}
            )
        members[(iteration, bracket_s, current)].append(
            {"trial_id": trial_id, "status": status, "promoted": False}
        )
    out = []
    for iteration in sorted(started):
        if asha:
            n = batch.get(iteration, total_trials(plan))
            shown = [(0, asha_ladder(plan, int(spec.hyperband.eta), n))]
        for index, rungs in shown:
            bracket_s = len(plan) - 1 - index
            if iteration and not any(members[(iteration, bracket_s, i)] for i in range(len(rungs))):
                continue
            out.append(
                {
                    "iteration": iteration,
                    "s": bracket_s,
                    "rungs": [
                        {
                            "rung": i,
                            "n": rung.n,
                            "resource": rung.resource,
                            "trials": members[(iteration, bracket_s, i)],
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
    """The study's packs, newest first, with their members of this study (a pack planned
    across studies says how many of its trials were other studies' and which)."""
    store.get_study(s, study_id)
    where = [store.of_study(study_id)]
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
    packs = list(s.scalars(stmt))
    ids = [m.trial_id for pack in packs for m in pack.members]
    study_of: dict[int, int] = {}
    for lo in range(0, len(ids), UPDATE_CHUNK):
        chunk = ids[lo : lo + UPDATE_CHUNK]
        rows = s.execute(select(Trial.id, Trial.study_id).where(Trial.id.in_(chunk)))
        study_of.update((trial, study) for trial, study in rows)
    return [_pack_row(pack, study_id, study_of) for pack in packs], count


def _pack_row(pack: Pack, study_id: int, study_of: dict[int, int]) -> Row:
    mine = [m for m in pack.members if study_of.get(m.trial_id, study_id) == study_id]
    others = {study_of[m.trial_id] for m in pack.members} - {study_id}
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
                "segment": m.segment if m.segment >= 0 else None,
            }
            for m in mine
        ],
        "shared_trials": len(pack.members) - len(mine),
        "shared_with": sorted(others),
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
        "arrays": pack.arrays,
        "failed_trials": sorted(t for a in pack.arrays or [] for t in a.get("failed", [])),
        "yield_requested_at": pack.yield_requested_at,
        "yielded": any(a.get("gave_up") for a in pack.arrays or []),
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


def profiles(s: Session, study_id: int) -> list[Row]:
    """What the planner measured for each fusion key of the study's trials, per device kind:
    the memory model, trial-steps/s by array size (one array alone, and a pack's arrays of
    that size at once), and the array size it plans next from them
    (:func:`packtune.packing.planned_array_size`, capped by the study's ``max_pack_size``;
    None: not cut by measurement, one array per pack for each group)."""
    study = store.get_study(s, study_id)
    spec = StoredSpec.of(study.spec)
    keys = list(s.scalars(select(Trial.fusion_key).where(Trial.study_id == study_id).distinct()))
    if not keys:
        return []
    k = spec.training.segment_units  # each segment unit has a key, and a profile, of its own
    keys += [segment_key(key, j, k) for key in keys for j in range(k)]
    stmt = (
        select(Profile)
        .where(Profile.workload == study.workload, Profile.fusion_key.in_(keys))
        .order_by(Profile.device_kind, Profile.fusion_key)
    )
    rows = []
    cap = spec.packing.max_pack_size
    for profile in s.scalars(stmt):
        alone, at_once = store.measured_curve(profile)
        size = planned_array_size(alone, at_once, cap)
        uncapped = planned_array_size(alone, at_once, None)
        rows.append(
            {
                "fusion_key": profile.fusion_key,
                "device_kind": profile.device_kind,
                "base_bytes": profile.base_bytes,
                "per_trial_bytes": profile.per_trial_bytes,
                "throughput": [{"k": k, "steps_per_s": alone[k]} for k in sorted(alone)],
                "concurrent": [{"k": k, "steps_per_s": at_once[k]} for k in sorted(at_once)],
                "array_size": size,
                "at_once": size in at_once and at_once[size] > alone.get(size, 0.0),
                "capped": size != uncapped,
                "updated_at": profile.updated_at,
            }
        )
    return rows


def workloads() -> list[Row]:
    """``describe()`` of every registered workload, by name."""
    from packtune.workloads import registry  # imports no torch

    return [registry()[name].describe() for name in sorted(registry())]
