"""Service-wide routes: health, workers, workloads."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from packtune.errors import PacktuneError
from service import queries
from service.api.deps import SessionDep, SettingsDep
from service.api.schemas import Health, ListOf, WorkerPublic, WorkloadPublic
from service.db import ping

log = logging.getLogger(__name__)

router = APIRouter()


@router.head("/healthz", include_in_schema=False)  # load balancers probe with HEAD
@router.get(
    "/healthz",
    response_model=Health,
    response_model_exclude_none=True,
    tags=["system"],
    responses={503: {"model": Health, "description": "The database cannot be reached."}},
)
def healthz(request: Request) -> Any:
    """200 when the database answers ``select 1``; 503 otherwise."""
    try:
        ping(request.app.state.read_sessionmaker)
    except (PacktuneError, SQLAlchemyError) as exc:
        log.warning("healthz: %s", exc)  # the driver's text names the database's host
        detail = "the database cannot be reached"
        return JSONResponse(status_code=503, content={"status": "unavailable", "detail": detail})
    return {"status": "ok"}


@router.get("/api/workers", response_model=ListOf[WorkerPublic], tags=["system"])
def list_workers(s: SessionDep, settings: SettingsDep) -> dict[str, Any]:
    """Every worker that has sent a heartbeat; ``alive`` within ``heartbeat_timeout``."""
    rows = queries.workers(s, settings.heartbeat_timeout)
    return {"data": rows, "count": len(rows)}


@router.get("/api/workloads", response_model=ListOf[WorkloadPublic], tags=["system"])
def list_workloads() -> dict[str, Any]:
    """The registered workloads: parameters (defaults), structural and fusible ones."""
    rows = queries.workloads()
    return {"data": rows, "count": len(rows)}
