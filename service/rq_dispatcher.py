"""Hand packs to RQ: any ``packtune worker`` on any host takes the next one.

Workers announce each job's end on the queue's wake channel
(:func:`service.bus.announce`), which wakes the scheduler at once. A lost
announcement costs a tick, nothing else: the database is the truth.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from packtune.dispatcher import CHECK_FUNC, JOB_FUNC, JobState, worker_of
from packtune.errors import QueueUnavailable
from packtune.settings import Settings
from service.bus import WakeListener, wake_channel

log = logging.getLogger(__name__)


@contextmanager
def _queue_errors() -> Iterator[None]:
    """Redis's connection trouble as :class:`~packtune.errors.QueueUnavailable`."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise QueueUnavailable(f"Redis: {exc}") from exc


class RQDispatcher:
    embedded_workers: frozenset[str] = frozenset()

    def __init__(self, settings: Settings) -> None:
        from redis import Redis
        from rq import Queue

        assert settings.redis_url is not None
        self.redis_url = settings.redis_url
        self.redis = Redis.from_url(settings.redis_url)
        self.queue = Queue(settings.queue_name, connection=self.redis)
        self.job_timeout = settings.job_timeout
        self.notify: Callable[[], None] | None = None  # called on each wake-up
        self._listener: WakeListener | None = None

    def start(self, workload: str | None = None) -> None:
        """Listen for wake-ups (workers' job ends, the API's study changes); workers are
        started on their own."""
        if self._listener is None:
            channel = wake_channel(self.queue.name)
            self._listener = WakeListener(self.redis_url, channel, self._woken)
            self._listener.start()

    def _woken(self) -> None:
        if self.notify is not None:
            self.notify()

    def enqueue(self, pack_id: int, job_id: str) -> None:
        self._enqueue(JOB_FUNC, pack_id, job_id, f"pack {pack_id}")

    def enqueue_check(self, check_id: int, job_id: str) -> None:
        self._enqueue(CHECK_FUNC, check_id, job_id, f"workload check {check_id}")

    def _enqueue(self, func: str, arg: int, job_id: str, description: str) -> None:
        self.start()
        with _queue_errors():
            self.queue.enqueue_call(
                func,
                args=(arg,),
                job_id=job_id,
                timeout=self.job_timeout,
                result_ttl=24 * 3600,
                failure_ttl=7 * 24 * 3600,
                description=description,
            )

    def state(self, job_id: str) -> tuple[JobState, str | None]:
        from rq.exceptions import NoSuchJobError
        from rq.job import Job, JobStatus

        try:
            with _queue_errors():
                job = Job.fetch(job_id, connection=self.redis)
                status = job.get_status(refresh=True)
        except NoSuchJobError:
            return JobState.missing, None
        if status == JobStatus.FINISHED:
            return JobState.finished, None
        if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
            result = job.latest_result()
            error = getattr(result, "exc_string", None) if result is not None else None
            return JobState.failed, (error or str(status)).strip().splitlines()[-1]
        if status == JobStatus.STARTED:
            return JobState.running, worker_of(job.worker_name)
        return JobState.queued, None

    def runner_statuses(self) -> list[dict[str, Any]]:
        return []  # RQ workers send their own heartbeats

    def nudge(self) -> None:
        """RQ workers read their packs' rows every ``YIELD_CHECK_SECONDS``: nothing to do."""

    def close(self) -> None:
        if self._listener is not None:
            self._listener.stop.set()
            self._listener.join(timeout=5)
            self._listener = None
        self.redis.close()
