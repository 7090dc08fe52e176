"""Jobs an RQ worker took and never ran: the scheduler gets their packs back, as faults.

Real PostgreSQL and Redis; the worker's side is RQ's own code (a ``SimpleWorker`` takes
the job, as ``packtune worker`` does) stopped where a killed process stops, before it
claims the pack in the database.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from packtune.dispatcher import rq_worker_name
from packtune.settings import Settings
from service import store
from service.db import make_engine, session_factory, session_scope, upgrade
from service.models import Pack, PackStatus, Worker
from service.rq_dispatcher import RQDispatcher
from service.scheduler import Scheduler
from tests.support.fleet import idle_cpu_worker_for

SPEC = {
    "name": "lost-jobs",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.3}},
    "hyperband": {"max_resource": 3, "eta": 3},
    "seed": 0,
}


@pytest.fixture
def factory(fresh_postgres: str) -> Iterator[sessionmaker[Session]]:
    upgrade(fresh_postgres)
    engine = make_engine(fresh_postgres)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


def _queued_pack(factory: sessionmaker[Session], redis_url: str) -> tuple[Scheduler, Pack]:
    """A scheduler over one study, and the pack it dispatched to worker ``w1`` (live)."""
    url = str(factory.kw["bind"].url.render_as_string(hide_password=False))
    with session_scope(factory) as s:
        store.create_study(s, name="lost", workload="digits-mlp", spec=SPEC, seed=0)
        idle_cpu_worker_for(s, "w1")  # digits-mlp measured already: no probe pack
    settings = Settings(
        database_url=url,
        redis_url=redis_url,
        queue_name=f"lost-{uuid.uuid4().hex[:8]}",
        heartbeat_timeout=30,
        retry_backoff=0,
    )
    sched = Scheduler(settings, factory, RQDispatcher(settings), holder="lost-test")
    for _ in range(20):
        sched.tick()
        with session_scope(factory) as s:
            queued = store.packs_with_status(s, (PackStatus.queued,))
        if queued:
            return sched, queued[0]
    raise AssertionError("no pack was dispatched")


def _taken_by(sched: Scheduler, job_id: str, worker: str) -> None:
    """RQ hands the job to ``worker`` (started), which dies before it runs it."""
    from rq import SimpleWorker

    dispatcher = sched.dispatcher
    assert isinstance(dispatcher, RQDispatcher)
    rq_worker = SimpleWorker(
        [dispatcher.queue], connection=dispatcher.redis, name=rq_worker_name(worker, "0dead0")
    )
    job, _ = dispatcher.queue.dequeue_any([dispatcher.queue], None, connection=dispatcher.redis)
    assert job.id == job_id
    rq_worker.prepare_execution(job)  # as its main loop does before the job runs
    rq_worker.prepare_job_execution(job)
    assert dispatcher.state(job_id)[0].value == "running"


def _pack(factory: sessionmaker[Session], pack_id: int) -> Pack:
    with session_scope(factory) as s:
        pack = s.scalars(select(Pack).where(Pack.id == pack_id)).one()
        s.expunge(pack)
        return pack


def test_a_job_taken_by_a_worker_that_died_before_claiming_its_pack(
    factory: sessionmaker[Session], redis_url: str
) -> None:
    """The pack stayed queued until RQ gave the job up as abandoned (an hour); it is
    pending again once the worker that took it is past its heartbeat timeout."""
    sched, pack = _queued_pack(factory, redis_url)
    assert pack.job_id is not None
    _taken_by(sched, pack.job_id, "w1")
    sched.tick()
    assert _pack(factory, pack.id).status is PackStatus.queued  # w1 still counts as live
    with session_scope(factory) as s:
        worker = s.scalars(select(Worker).where(Worker.name == "w1")).one()
        worker.last_heartbeat = datetime.now(UTC) - timedelta(minutes=5)
    sched.connected_since = time.monotonic() - 60  # long enough to trust its silence
    sched.tick()
    got = _pack(factory, pack.id)
    assert got.status in (PackStatus.pending, PackStatus.queued) and got.job_id != pack.job_id
    assert got.faults == 1 and got.error is not None and "worker w1" in got.error, got.error
    sched.close()


def test_a_job_rq_gave_up_as_abandoned_is_a_fault_not_an_attempt(
    factory: sessionmaker[Session], redis_url: str
) -> None:
    """RQ fails a started job whose worker died (its cleanup, after the job's timeout): the
    pack went back to pending charged to its trials (attempts count toward max_attempts)."""
    from rq.registry import StartedJobRegistry

    sched, pack = _queued_pack(factory, redis_url)
    assert pack.job_id is not None
    _taken_by(sched, pack.job_id, "w1")  # w1 restarted since under its name: it heartbeats
    dispatcher = sched.dispatcher
    assert isinstance(dispatcher, RQDispatcher)
    registry = StartedJobRegistry(dispatcher.queue.name, connection=dispatcher.redis)
    registry.cleanup(timestamp=time.time() + 10**6)  # as a worker's cleanup an hour on
    assert dispatcher.state(pack.job_id)[0].value == "failed"
    sched.tick()
    got = _pack(factory, pack.id)
    assert got.faults == 1, (got.faults, got.error)
    assert got.error is not None and "AbandonedJobError" in got.error
    sched.close()
