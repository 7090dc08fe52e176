"""RQ workers announce each job's end; the scheduler wakes on it instead of its next tick."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from redis import Redis
from rq import Queue

from packtune.settings import get_settings
from service.bus import announce, wake_channel
from service.rq_dispatcher import RQDispatcher
from service.scheduler import Scheduler, TickReport
from worker.main import Heartbeat, PackWorker


@pytest.fixture
def rq_env(embedded_db: pytest.MonkeyPatch, redis_url: str) -> Iterator[str]:
    """SQLite for the scheduler, Redis for the queue, a queue name of this test's own."""
    queue = f"test-wakeup-{uuid.uuid4().hex[:8]}"
    embedded_db.setenv("PACKTUNE_REDIS_URL", redis_url)
    embedded_db.setenv("PACKTUNE_QUEUE_NAME", queue)
    embedded_db.setenv("PACKTUNE_SCHEDULER_INTERVAL", "30")  # an idle loop ticks every 30 s
    get_settings.cache_clear()
    yield queue
    get_settings.cache_clear()


def _listening(redis: Redis, channel: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while dict(redis.pubsub_numsub(channel)).get(channel.encode(), 0) < 1:
        assert time.monotonic() < deadline, f"nobody subscribed to {channel}"
        time.sleep(0.02)


@contextmanager
def listening_dispatcher(
    queue: str, redis_url: str
) -> Iterator[tuple[RQDispatcher, threading.Event, Redis]]:
    """An RQ dispatcher subscribed to ``queue``'s job-end channel; the event is its notify."""
    dispatcher = RQDispatcher(get_settings())
    notified = threading.Event()
    dispatcher.notify = notified.set
    dispatcher.start()
    redis = Redis.from_url(redis_url)
    try:
        _listening(redis, wake_channel(queue))
        yield dispatcher, notified, redis
    finally:
        dispatcher.close()
        redis.close()


def test_a_workers_job_end_notifies_the_dispatcher(rq_env: str, redis_url: str) -> None:
    with listening_dispatcher(rq_env, redis_url) as (dispatcher, ended, redis):
        queue = Queue(rq_env, connection=redis)
        ok = queue.enqueue_call("operator.add", args=(1, 2), job_id=f"ok-{uuid.uuid4().hex}")
        assert not ended.wait(0.3)  # queued, not ended
        PackWorker([queue], connection=redis).work(burst=True, with_scheduler=False)
        assert ok.get_status(refresh=True) == "finished"
        assert ended.wait(5), "the worker's job end did not reach the dispatcher"

        ended.clear()  # a failing job is announced too, once RQ has recorded the failure
        bad = queue.enqueue_call("operator.truediv", args=(1, 0), job_id=f"bad-{uuid.uuid4().hex}")
        PackWorker([queue], connection=redis).work(burst=True, with_scheduler=False)
        assert ended.wait(5)
        assert dispatcher.state(bad.id)[0] == "failed"


def test_an_announcement_wakes_the_scheduler_before_its_tick(rq_env: str, redis_url: str) -> None:
    """With a 30 s tick, the loop ticks again within seconds of a job-end announcement."""
    scheduler = Scheduler(
        get_settings(), dispatcher=RQDispatcher(get_settings()), holder="wakeup-test"
    )
    scheduler.dispatcher.start()
    ticks: list[float] = []
    stop = threading.Event()

    def on_tick(_: TickReport) -> None:
        ticks.append(time.monotonic())

    thread = threading.Thread(
        target=scheduler.run, kwargs={"stop": stop, "on_tick": on_tick}, daemon=True
    )
    redis = Redis.from_url(redis_url)
    try:
        thread.start()
        _listening(redis, wake_channel(rq_env))
        deadline = time.monotonic() + 10
        while not ticks:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        assert len(ticks) == 1  # idle: the next tick would be 30 s away
        announce(redis, rq_env, "pack-1-1")
        deadline = time.monotonic() + 5
        while len(ticks) < 2:
            assert time.monotonic() < deadline, "the announcement did not wake the scheduler"
            time.sleep(0.05)
    finally:
        stop.set()
        scheduler.wake.set()
        thread.join(10)
        scheduler.close()
        redis.close()


def test_announcing_without_redis_does_not_raise() -> None:
    announce(Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5), "q", "j")


def test_a_study_created_through_the_api_wakes_the_scheduler(rq_env: str, redis_url: str) -> None:
    """The API's wake-up (after a POST or a cancel) reaches a scheduler that listens."""
    from service import bus

    with listening_dispatcher(rq_env, redis_url) as (_, woken, _redis):
        assert not woken.wait(0.3)
        bus.study_changed(get_settings())
        assert woken.wait(5), "the API's wake-up did not reach the scheduler"


#: the heartbeat of the worker running :func:`busy_now` (RQ's SimpleWorker: this process)
BEAT: list[Heartbeat] = []


def busy_now() -> bool:
    """A job that says whether its worker's heartbeat said busy while it ran."""
    return BEAT[0].busy


def test_a_worker_is_busy_in_its_heartbeat_while_a_job_runs(rq_env: str, redis_url: str) -> None:
    """Before, an RQ worker's heartbeat said idle for ever: the API and dashboard showed
    every worker idle while it trained."""
    beat = Heartbeat("busy-test", None, 3600.0)  # not started: no database writes
    BEAT[:] = [beat]
    redis = Redis.from_url(redis_url)
    try:
        queue = Queue(rq_env, connection=redis)
        job = queue.enqueue_call(f"{__name__}.busy_now", job_id=f"busy-{uuid.uuid4().hex}")
        worker = PackWorker([queue], connection=redis)
        worker.beat = beat
        worker.work(burst=True, with_scheduler=False)
        assert job.get_status(refresh=True) == "finished"
        assert job.return_value() is True  # busy while it ran
        assert beat.busy is False and beat.changed.is_set()  # idle again, said at once
    finally:
        redis.close()
