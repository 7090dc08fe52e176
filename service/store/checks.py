"""Workload checks asked for through the API: created by the API, dispatched by the
scheduler, run and finished by a worker (``worker.jobs.run_check``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from packtune.errors import NotFound
from service.models import CheckStatus, WorkloadCheck, utcnow
from service.store.transitions import move_check


def _changed(result: Any) -> int:
    """Rows an UPDATE changed (a CursorResult's rowcount)."""
    return int(getattr(result, "rowcount", 0) or 0)


#: a check still to be run or running
OPEN_CHECK = (CheckStatus.queued, CheckStatus.running)


def create_check(s: Session, workload: str, request: dict[str, Any]) -> WorkloadCheck:
    check = WorkloadCheck(workload=workload, request=request, status=CheckStatus.queued)
    s.add(check)
    s.flush()
    return check


def get_check(s: Session, check_id: int) -> WorkloadCheck:
    check = s.get(WorkloadCheck, check_id)
    if check is None:
        raise NotFound(f"check {check_id} not found")
    return check


def checks_with_status(s: Session, statuses: Iterable[CheckStatus]) -> list[WorkloadCheck]:
    query = select(WorkloadCheck).where(WorkloadCheck.status.in_(list(statuses)))
    return list(s.scalars(query.order_by(WorkloadCheck.id)))


def set_check_job(s: Session, check: WorkloadCheck, job_id: str) -> bool:
    """Give a queued check its job id, once; False if it had one (or left ``queued``)."""
    done = _changed(s.execute(
        update(WorkloadCheck)
        .where(WorkloadCheck.id == check.id, WorkloadCheck.job_id.is_(None),
               WorkloadCheck.status == CheckStatus.queued)
        .values(job_id=job_id)
    ))  # fmt: skip
    s.expire(check)
    return bool(done)


def start_check(s: Session, check_id: int, worker: str) -> WorkloadCheck | None:
    """Queued -> running on ``worker``; None when the check is not queued (run already)."""
    moved = move_check(s, check_id, CheckStatus.running, worker_name=worker, started_at=utcnow())
    if not moved:
        return None
    check = get_check(s, check_id)
    s.refresh(check)
    return check


def finish_check(
    s: Session,
    check_id: int,
    status: CheckStatus,
    *,
    report: dict[str, Any] | None = None,
    error: str | None = None,
) -> bool:
    """An open check -> ``status`` with its report or error; False if it was closed."""
    return move_check(s, check_id, status, report=report, error=error, finished_at=utcnow())
