"""``POST /api/workloads/{name}/check``: ``packtune check`` through the API.

The API never loads torch, so it does not run the check: it stores the request (checked in
full first: the space parses and the workload takes its parameters), the scheduler hands it
to a worker as a job (RQ, or the embedded runner), and the worker writes the report.
``GET /api/workloads/checks/{id}`` reads it: ``queued``, ``running``, then ``passed``
(fusion is exact and possible), ``failed`` (it is not: the report says why) or ``error``
(the check could not run: the workload raised, or the worker died).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Depends, Path, Response, status

from packtune.errors import NotFound
from packtune.spec import check_search_space
from packtune.workloads import registry
from service import bus, store
from service.api.bodies import JSONRoute
from service.api.deps import SessionDep, SettingsDep, require_token
from service.api.schemas import CheckPublic, CheckRequest, problems
from service.models import WorkloadCheck

writes = APIRouter(
    tags=["system"], dependencies=[Depends(require_token)], responses=problems(401, 413, 503),
    route_class=JSONRoute,
)  # fmt: skip
router = APIRouter(tags=["system"], responses=problems(503))


def public(check: WorkloadCheck) -> dict[str, Any]:
    return {
        "id": check.id, "workload": check.workload, "status": check.status.value,
        "request": check.request, "report": check.report, "error": check.error,
        "worker": check.worker_name, "created_at": check.created_at,
        "started_at": check.started_at, "finished_at": check.finished_at,
    }  # fmt: skip


@writes.post(
    "/api/workloads/{name}/check",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=CheckPublic,
    responses=problems(404),
)
def create_check(
    name: Annotated[str, Path(max_length=100)],
    body: CheckRequest,
    s: SessionDep,
    settings: SettingsDep,
    response: Response,
    background: BackgroundTasks,
) -> dict[str, Any]:
    """Check how workload ``name`` fuses, on a worker: members drawn from ``space`` (or the
    defaults), trained fused and one by one, and timed at k = 1, 2, 4, 8. 202: poll the
    ``Location`` until the status is ``passed``, ``failed`` or ``error``."""
    if name not in registry():
        raise NotFound(f"unknown workload {name!r}; known: {sorted(registry())}")
    if body.space is not None:  # a SpecError names the field from "space", as a study's
        check_search_space(name, body.space)
    check = store.create_check(s, name, body.model_dump(mode="json"))
    response.headers["Location"] = f"/api/workloads/checks/{check.id}"
    background.add_task(bus.study_changed, settings)  # wakes the scheduler
    return public(check)


@router.get("/api/workloads/checks/{check_id}", response_model=CheckPublic, responses=problems(404))
def get_check(check_id: Annotated[int, Path(ge=1, le=2**31 - 1)], s: SessionDep) -> dict[str, Any]:
    """A check asked for with ``POST /api/workloads/{name}/check``, and its report once done."""
    return public(store.get_check(s, check_id))
