"""The dispatcher contract between the scheduler and whatever runs packs.

The scheduler only ever calls :meth:`Dispatcher.enqueue` with a pack id and a
job id (``pack-<id>-<attempt>``, :func:`job_id_for`) and asks
:meth:`Dispatcher.state` what became of a job. The job itself is
``worker.jobs.run_pack`` (:data:`JOB_FUNC`), named by dotted path so that the
scheduler and the API process never import torch. Two implementations:

- ``service.rq_dispatcher.RQDispatcher`` (``PACKTUNE_REDIS_URL`` set): RQ
  workers on any host take the packs;
- ``worker.embedded.EmbeddedDispatcher`` (no Redis): one child process of the
  scheduler's runs them (``packtune run`` and ``packtune serve`` on a laptop).

``service.runtime.make_dispatcher`` picks one from the settings.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol

JOB_FUNC = "worker.jobs.run_pack"
#: the job of a workload check asked for through the API (``packtune check`` on a worker)
CHECK_FUNC = "worker.jobs.run_check"


class JobState(enum.StrEnum):
    queued = "queued"
    running = "running"
    finished = "finished"
    failed = "failed"
    missing = "missing"  # never enqueued here, or vanished (e.g. Redis restarted)


#: what an RQ job's error says when RQ gave it up because its worker died while it ran
ABANDONED = "AbandonedJobError"


def rq_worker_name(name: str, tag: str) -> str:
    """The name a ``packtune worker`` called ``name`` registers with RQ: a new ``tag`` each
    time it (re)connects, since Redis may still hold the last registration."""
    return f"{name}-{tag}"


def worker_of(rq_name: str | None) -> str | None:
    """The ``packtune worker`` name of an RQ worker's (:func:`rq_worker_name`), if it is one."""
    if not rq_name or "-" not in rq_name:
        return None
    return rq_name.rsplit("-", 1)[0]


def job_id_for(pack_id: int, attempt: int) -> str:
    return f"pack-{pack_id}-{attempt}"


def check_job_id(check_id: int) -> str:
    return f"check-{check_id}"


class Dispatcher(Protocol):
    """Everything the scheduler asks of a dispatcher."""

    #: the names of the worker rows of this dispatcher's own runners, or none (RQ workers
    #: report themselves through heartbeats)
    embedded_workers: frozenset[str]
    #: set by the scheduler: called (from any thread) when a job ends, to wake its loop
    notify: Callable[[], None] | None

    def start(self, workload: str | None = None) -> None:
        """Get ready for packs, without waiting (the embedded runner starts its process and
        loads ``workload``'s module and data); optional, the first enqueue does it anyway."""
        ...

    def enqueue(self, pack_id: int, job_id: str) -> None: ...

    def enqueue_check(self, check_id: int, job_id: str) -> None:
        """Run workload check ``check_id`` (:data:`CHECK_FUNC`) as job ``job_id``."""
        ...

    def state(self, job_id: str) -> tuple[JobState, str | None]:
        """The job's state and, for a failed job, its error text; for a running one, the
        name of the worker that took it where the dispatcher knows it (RQ)."""
        ...

    def runner_statuses(self) -> list[dict[str, Any]]:
        """The embedded runners' heartbeat fields (``name``, ``device_kind``, ``gpus``,
        ``memory_budget``, ``busy``), which the scheduler writes for them; none for RQ."""
        ...

    def nudge(self) -> None:
        """Running packs were just asked to give their device up (committed): have the
        runners read their packs' rows now rather than at their next look (RQ: nothing)."""
        ...

    def close(self) -> None: ...
