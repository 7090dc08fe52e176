"""Dispatch: hand a pack to RQ, or run it in the embedded runner — the same job either way.

The scheduler only ever calls :meth:`Dispatcher.enqueue` with a pack id and a
job id (``pack-<id>-<attempt>``) and asks :meth:`Dispatcher.state` what became
of a job. The job itself is ``worker.jobs.run_pack``, named by dotted path so
that this module (and the API process) never imports torch.

- :class:`RQDispatcher` (``PACKTUNE_REDIS_URL`` set): one RQ queue; any
  ``packtune worker`` takes the next pack, and announces each job's end on a
  Redis channel (:func:`announce_done`) that wakes the scheduler at once. A
  lost announcement costs a tick, nothing else: the database is the truth.
- :class:`EmbeddedDispatcher` (no Redis): a single child process runs packs
  one after another. It is started with ``spawn`` so the parent (API +
  scheduler) never loads torch or CUDA; a crashed child is replaced, and a
  child whose parent is gone (killed, or ended by a signal that skips its
  clean-up) exits instead of lingering as an orphan. :meth:`~Dispatcher.start`
  starts it ahead of the first pack, so that its imports (torch: ~1.5 s on a
  CPU, CUDA start-up several more on a GPU) overlap the parent's own start.
"""

from __future__ import annotations

import enum
import logging
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Protocol

from service.settings import Settings

if TYPE_CHECKING:
    from redis import Redis

log = logging.getLogger(__name__)

JOB_FUNC = "worker.jobs.run_pack"


class JobState(enum.StrEnum):
    queued = "queued"
    running = "running"
    finished = "finished"
    failed = "failed"
    missing = "missing"  # never enqueued here, or vanished (e.g. Redis restarted)


def job_id_for(pack_id: int, attempt: int) -> str:
    return f"pack-{pack_id}-{attempt}"


class Dispatcher(Protocol):
    #: the name of the device this dispatcher's own runner trains on, or None (RQ workers
    #: report themselves through heartbeats)
    embedded_worker: str | None

    def start(self, workload: str | None = None) -> None:
        """Get ready for packs, without waiting (the embedded runner starts its process and
        loads ``workload``'s module and data); optional, the first enqueue does it anyway."""
        ...

    def enqueue(self, pack_id: int, job_id: str) -> None: ...

    def state(self, job_id: str) -> tuple[JobState, str | None]:
        """The job's state and, for a failed job, its error text."""
        ...

    def close(self) -> None: ...


def done_channel(queue_name: str) -> str:
    """The Redis channel on which workers of queue ``queue_name`` announce a job's end."""
    return f"packtune:{queue_name}:job-done"


def announce_done(redis: Redis, queue_name: str, job_id: str) -> None:
    """Tell the scheduler (if one listens) that ``job_id`` ended; never raises."""
    try:
        redis.publish(done_channel(queue_name), job_id)
    except Exception as exc:  # Redis down: the scheduler finds out at its next tick
        log.debug("could not announce the end of job %s: %s", job_id, exc)


class _DoneListener(threading.Thread):
    """Calls ``on_done`` for each job end announced on ``channel``; survives Redis restarts."""

    def __init__(self, redis_url: str, channel: str, on_done: Callable[[], None]) -> None:
        super().__init__(name="packtune-job-done", daemon=True)
        self.redis_url, self.channel, self.on_done = redis_url, channel, on_done
        self.stop = threading.Event()

    def run(self) -> None:
        from redis import Redis

        while not self.stop.is_set():
            redis = Redis.from_url(self.redis_url, socket_timeout=10)
            pubsub = redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                while not self.stop.is_set():
                    if pubsub.get_message(timeout=1.0) is not None:
                        self.on_done()
            except Exception as exc:  # e.g. Redis restarting: the ticks go on meanwhile
                log.debug("job-end listener: %s; subscribing again", exc)
                self.stop.wait(1.0)
            finally:
                pubsub.close()
                redis.close()


class RQDispatcher:
    embedded_worker: str | None = None

    def __init__(self, settings: Settings) -> None:
        from redis import Redis
        from rq import Queue

        assert settings.redis_url is not None
        self.redis_url = settings.redis_url
        self.redis = Redis.from_url(settings.redis_url)
        self.queue = Queue(settings.queue_name, connection=self.redis)
        self.job_timeout = settings.job_timeout
        self.notify: Callable[[], None] | None = None  # called when a worker announces a job end
        self._listener: _DoneListener | None = None

    def start(self, workload: str | None = None) -> None:
        """Listen for workers' job-end announcements (workers are started on their own)."""
        if self._listener is None:
            channel = done_channel(self.queue.name)
            self._listener = _DoneListener(self.redis_url, channel, self._done)
            self._listener.start()

    def _done(self) -> None:
        if self.notify is not None:
            self.notify()

    def enqueue(self, pack_id: int, job_id: str) -> None:
        self.start()
        self.queue.enqueue_call(
            JOB_FUNC,
            args=(pack_id,),
            job_id=job_id,
            timeout=self.job_timeout,
            result_ttl=24 * 3600,
            failure_ttl=7 * 24 * 3600,
            description=f"pack {pack_id}",
        )

    def state(self, job_id: str) -> tuple[JobState, str | None]:
        from rq.exceptions import NoSuchJobError
        from rq.job import Job, JobStatus

        try:
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
            return JobState.running, None
        return JobState.queued, None

    def close(self) -> None:
        if self._listener is not None:
            self._listener.stop.set()
            self._listener.join(timeout=5)
            self._listener = None
        self.redis.close()


def _init_runner(parent: int, nice: int) -> None:
    """In the child, first thing: train at a lower CPU priority (``nice``: on a laptop the
    API, the dashboard and the scheduler share the cores with training), and exit once
    ``parent`` is gone (the child is re-parented).

    Without it, ``packtune serve`` ended by SIGTERM (uvicorn re-raises the signal, so
    no clean-up runs) or SIGKILL left its runner idle for ever, holding ~400 MB.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)  # a pack cut short is re-queued: its job is missing to the next scheduler

    if nice and hasattr(os, "nice"):
        os.nice(nice)
    threading.Thread(target=watch, name="packtune-parent-watch", daemon=True).start()


def _warm_up(workload: str | None) -> str:
    """In the child, ahead of its first pack: import what packs need, start the device and
    load ``workload``'s data (with its defaults: the built-ins' data do not depend on the
    searched parameters). A failure is only logged: the pack that needs it will raise it."""
    started = time.perf_counter()
    try:
        import torch

        from worker.jobs import pick_device
        from worker.workloads import get_workload

        device = pick_device()
        torch.zeros(1, device=device)  # on a GPU: the CUDA context, seconds
        if workload is not None:
            get_workload(workload).data({}, device)
    except Exception as exc:
        log.warning("embedded runner: warm-up failed (%s: %s)", type(exc).__name__, exc)
        return f"failed: {exc}"
    return f"warm in {time.perf_counter() - started:.2f} s"


def _run_in_child(pack_id: int) -> str:
    from worker.jobs import run_pack  # imported in the child only

    return str(run_pack(pack_id))


class EmbeddedDispatcher:
    """Runs packs in one spawned child process, one after another (FIFO)."""

    def __init__(self, settings: Settings) -> None:
        self.embedded_worker: str | None = f"embedded@{socket.gethostname()}"
        self._nice = settings.runner_nice
        self._ctx = multiprocessing.get_context("spawn")
        self._pool: ProcessPoolExecutor | None = None
        self._jobs: dict[str, Future[str]] = {}
        self.warm_up: Future[str] | None = None
        self.notify: Callable[[], None] | None = None  # called when a job ends

    def start(self, workload: str | None = None) -> None:
        """Start the child now (spawn and imports take ~1.5 s on a CPU) and warm it up; packs
        enqueued meanwhile run after the warm-up, in order."""
        if self._pool is None:
            self.warm_up = self._executor().submit(_warm_up, workload)

    def _submit(self, pack_id: int) -> Future[str]:
        fut = self._executor().submit(_run_in_child, pack_id)
        fut.add_done_callback(lambda _: self.notify() if self.notify else None)
        return fut

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=self._ctx,
                initializer=_init_runner,
                initargs=(os.getpid(), self._nice),
            )
        return self._pool

    def enqueue(self, pack_id: int, job_id: str) -> None:
        try:
            self._jobs[job_id] = self._submit(pack_id)
        except BrokenProcessPool:
            log.warning("embedded runner died; starting a new one")
            self._pool = None
            self._jobs[job_id] = self._submit(pack_id)

    def state(self, job_id: str) -> tuple[JobState, str | None]:
        fut = self._jobs.get(job_id)
        if fut is None:
            return JobState.missing, None
        if not fut.done():
            return (JobState.running if fut.running() else JobState.queued), None
        exc = fut.exception()
        if exc is not None:
            if isinstance(exc, BrokenProcessPool):
                self._pool = None
            return JobState.failed, f"{type(exc).__name__}: {exc}"
        return JobState.finished, None

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def busy(self) -> int:
        """Jobs submitted and not yet done."""
        return sum(not f.done() for f in self._jobs.values())

    def close(self) -> None:
        """Stop the runner at once: closed during its start-up (e.g. the database could not be
        migrated) there is nothing to finish, so do not wait seconds for its imports; closed
        with a pack training (the scheduler stopped), the pack is cut short as if the runner
        had been killed, and the next scheduler finds its job missing and dispatches it again.
        """
        if self._pool is None:
            return
        warming = not self._jobs and self.warm_up is not None and not self.warm_up.done()
        if warming or self.busy():
            for proc in list(getattr(self._pool, "_processes", {}).values()):
                proc.terminate()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None


def make_dispatcher(settings: Settings) -> Dispatcher:
    if settings.redis_url:
        return RQDispatcher(settings)
    return EmbeddedDispatcher(settings)
