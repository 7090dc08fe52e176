"""Study routes: thin adapters from HTTP to :mod:`service.store` and :mod:`service.queries`."""

from __future__ import annotations

import shutil
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Depends, Path, Query, Response, status
from fastapi.responses import FileResponse

from packtune.checkpoints import checkpoint_path, study_folder
from packtune.errors import Conflict, NotFound
from packtune.spec import StudySpec
from service import bus, queries, store
from service.api.bodies import JSONRoute
from service.api.deps import SessionDep, SettingsDep, require_token
from service.api.schemas import (
    BracketPublic,
    CurvePublic,
    LeaderboardEntry,
    ListOf,
    PackPublic,
    ProfilePublic,
    StudyPatch,
    StudyPublic,
    TrialPublic,
    problems,
)
from service.models import PackStatus, StudyStatus, TrialStatus

# Ids are 32-bit integer columns; a bigger number is a client error, not a database one.
MAX_ID = 2**31 - 1
StudyId = Annotated[int, Path(ge=1, le=MAX_ID, description="Study id.")]
Limit = Annotated[int, Query(ge=1, le=500)]
# Unbounded, a huge offset overflowed the database's 64-bit integer: a 500, not a 422.
Offset = Annotated[int, Query(ge=0, le=MAX_ID)]

router = APIRouter(prefix="/api/studies", tags=["studies"], responses=problems(503))
writes = APIRouter(
    prefix="/api/studies",
    tags=["studies"],
    dependencies=[Depends(require_token)],
    responses=problems(401, 413, 503),
    route_class=JSONRoute,
)
ONE_STUDY = problems(404)

CANCELLABLE = (StudyStatus.pending, StudyStatus.running)
#: packs whose job may still write to the study's rows
ACTIVE_PACK = (PackStatus.queued, PackStatus.running)


@writes.post("", status_code=status.HTTP_201_CREATED, response_model=StudyPublic)
def create_study(
    spec: StudySpec,
    s: SessionDep,
    settings: SettingsDep,
    response: Response,
    background: BackgroundTasks,
) -> dict[str, Any]:
    """Create a study in status ``pending``; the scheduler is woken to pick it up at once
    (after the commit; see :mod:`service.bus`).

    The body is checked in full (workload, space, Hyperband settings) before
    anything is stored; a bad field gives 422 with its path in ``loc``.
    """
    study = store.create_study(
        s, name=spec.name, workload=spec.workload, spec=spec.model_dump(mode="json"), seed=spec.seed
    )
    response.headers["Location"] = f"/api/studies/{study.id}"
    background.add_task(bus.study_changed, settings)
    return queries.study_summary(s, study.id)


@writes.post("/{study_id}/cancel", response_model=StudyPublic, responses=problems(404, 409))
def cancel_study(
    study_id: StudyId, s: SessionDep, settings: SettingsDep, background: BackgroundTasks
) -> dict[str, Any]:
    """Cancel a pending or running study; the scheduler, woken, cancels its trials at once."""
    study = store.lock_study(s, study_id)
    if study.status not in CANCELLABLE:
        raise Conflict(f"study {study_id} is {study.status.value}; it can no longer be cancelled")
    store.move_study(s, study, StudyStatus.cancelled)
    background.add_task(bus.study_changed, settings)
    return queries.study_summary(s, study_id)


@writes.patch("/{study_id}", response_model=StudyPublic, responses=problems(404, 409))
def update_study(
    study_id: StudyId,
    change: StudyPatch,
    s: SessionDep,
    settings: SettingsDep,
    background: BackgroundTasks,
) -> dict[str, Any]:
    """Change a pending or running study's ``priority`` (its weight in the fair share of
    device time, used from the scheduler's next tick) or ``owner`` label."""
    study = store.lock_study(s, study_id)
    if study.status not in CANCELLABLE:
        raise Conflict(f"study {study_id} is {study.status.value}; it can no longer change")
    fields = change.model_dump(exclude_unset=True)  # null: as a spec without it
    if fields.get("priority", 1.0) is None:
        fields["priority"] = 1.0
    if fields:
        store.update_spec(s, study, **fields)
        background.add_task(bus.study_changed, settings)
    return queries.study_summary(s, study_id)


@writes.delete("/{study_id}", status_code=status.HTTP_204_NO_CONTENT, responses=problems(404, 409))
def delete_study(
    study_id: StudyId, s: SessionDep, settings: SettingsDep, background: BackgroundTasks
) -> Response:
    """Delete a finished, failed or cancelled study: its trials, packs, measurements and
    checkpoints. 409 while it is pending or running, or while its last packs still train
    after a cancel (cancel it first; they stop within seconds)."""
    study = store.lock_study(s, study_id)
    if study.status in CANCELLABLE:
        raise Conflict(f"study {study_id} is {study.status.value}; cancel it before deleting it")
    busy = store.packs_of(s, study_id, status=ACTIVE_PACK)
    if busy:
        raise Conflict(f"study {study_id} still has packs training ({len(busy)}); try again")
    store.delete_study(s, study_id)
    # after the commit: files of a study whose rows are gone are never read again
    background.add_task(shutil.rmtree, study_folder(settings.checkpoint_dir, study_id), True)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@writes.post("/{study_id}/retry", response_model=StudyPublic, responses=problems(404, 409))
def retry_study(
    study_id: StudyId, s: SessionDep, settings: SettingsDep, background: BackgroundTasks
) -> dict[str, Any]:
    """Run a failed study again once the cause is fixed: its failed trials whose rung is
    still open go back to pending, resuming from their checkpoints; 409 for a study that is
    not failed."""
    study = store.lock_study(s, study_id)
    store.retry_study(s, study)
    background.add_task(bus.study_changed, settings)
    return queries.study_summary(s, study_id)


@router.get("", response_model=ListOf[StudyPublic])
def list_studies(
    s: SessionDep,
    limit: Limit = 50,
    offset: Offset = 0,
    status: Annotated[list[StudyStatus] | None, Query()] = None,
) -> dict[str, Any]:
    """Studies, newest first; ``status`` (repeatable) keeps those in it, ``count`` counts them."""
    rows, count = queries.list_studies(s, limit, offset, status)
    return {"data": rows, "count": count}


@router.get("/{study_id}", response_model=StudyPublic, responses=ONE_STUDY)
def get_study(study_id: StudyId, s: SessionDep) -> dict[str, Any]:
    """One study: status, progress in rung-units, best trial (and best so far while running)."""
    return queries.study_summary(s, study_id)


@router.get("/{study_id}/trials", response_model=ListOf[TrialPublic], responses=ONE_STUDY)
def list_trials(
    study_id: StudyId,
    s: SessionDep,
    status: TrialStatus | None = None,
    bracket: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
    limit: Annotated[int | None, Query(ge=1, le=100_000)] = None,
    offset: Offset = 0,
) -> dict[str, Any]:
    """The study's trials by id with their latest metrics (all of them unless ``limit``)."""
    rows, count = queries.trials(
        s, study_id, status=status, bracket=bracket, limit=limit, offset=offset
    )
    return {"data": rows, "count": count}


@router.get(
    "/{study_id}/trials/{trial_id}/checkpoint",
    response_class=FileResponse,
    responses={**ONE_STUDY, 200: {"content": {"application/octet-stream": {}},
               "description": "The trial's latest checkpoint (torch.save of a dict)."}},
)  # fmt: skip
def trial_checkpoint(
    study_id: StudyId,
    trial_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    s: SessionDep,
    settings: SettingsDep,
) -> FileResponse:
    """The trial's latest checkpoint, as ``torch.save`` wrote it: a dict of ``params`` and
    ``buffers`` (the model's state dict, split), ``config`` (with ``seed``), ``steps_done``,
    ``optimizer`` and ``rng`` state. Load it with ``torch.load(f, weights_only=True)`` and
    ``workload.build_model(state["config"]).load_state_dict({**params, **buffers})``."""
    trial = store.get_trial(s, trial_id)
    path = checkpoint_path(settings.checkpoint_dir, study_id, trial_id)
    if trial.study_id != study_id:
        raise NotFound(f"trial {trial_id} is not a trial of study {study_id}")
    if trial.checkpoint_path is None or not path.is_file():
        raise NotFound(
            f"trial {trial_id} has no checkpoint: not trained yet, or removed when its study "
            "ended (only the best stopped trials keep theirs: PACKTUNE_KEEP_CHECKPOINTS)"
        )
    name = f"study-{study_id}-trial-{trial_id}.pt"
    return FileResponse(path, media_type="application/octet-stream", filename=name)


@router.get("/{study_id}/brackets", response_model=ListOf[BracketPublic], responses=ONE_STUDY)
def list_brackets(study_id: StudyId, s: SessionDep) -> dict[str, Any]:
    """Hyperband's brackets, highest ``s`` first: planned rungs and the trials that reached them."""
    rows = queries.brackets(s, study_id)
    return {"data": rows, "count": len(rows)}


@router.get("/{study_id}/packs", response_model=ListOf[PackPublic], responses=ONE_STUDY)
def list_packs(
    study_id: StudyId,
    s: SessionDep,
    status: PackStatus | None = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> dict[str, Any]:
    """The study's packs, newest first, with members, device, memory and timing."""
    rows, count = queries.packs(s, study_id, status=status, limit=limit, offset=offset)
    return {"data": rows, "count": count}


@router.get("/{study_id}/profiles", response_model=ListOf[ProfilePublic], responses=ONE_STUDY)
def list_profiles(study_id: StudyId, s: SessionDep) -> dict[str, Any]:
    """Per fusion key of the study and device kind: the memory model, the measured
    trial-steps/s by array size, and the array size the planner takes next."""
    rows = queries.profiles(s, study_id)
    return {"data": rows, "count": len(rows)}


@router.get("/{study_id}/curves", response_model=ListOf[CurvePublic], responses=ONE_STUDY)
def list_curves(
    study_id: StudyId,
    s: SessionDep,
    trial_id: Annotated[list[Annotated[int, Query(ge=1, le=MAX_ID)]] | None, Query()] = None,
) -> dict[str, Any]:
    """Learning curves: each trial's metrics at every resource measured (``trial_id`` filters)."""
    rows = queries.curves(s, study_id, trial_id)
    return {"data": rows, "count": len(rows)}


@router.get("/{study_id}/leaderboard", response_model=ListOf[LeaderboardEntry], responses=ONE_STUDY)
def leaderboard(
    study_id: StudyId, s: SessionDep, limit: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None
) -> dict[str, Any]:
    """Measured trials, best first: higher resource first, then the objective; ``count`` is all."""
    rows, count = queries.leaderboard(s, study_id, limit)
    return {"data": rows, "count": count}
