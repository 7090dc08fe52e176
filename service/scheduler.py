"""The scheduler loop: reads the database, decides, writes back, dispatches.

It keeps no state of its own. Each tick, under a database lease (so two
schedulers started by mistake do not both act):

1. reconcile dispatched packs with their jobs: a job that failed, vanished
   (e.g. Redis restarted) or whose worker stopped sending heartbeats puts its
   pack back to ``pending``. Workers are judged dead only once this scheduler
   has reached the database for a whole heartbeat timeout: after a database
   outage (or at start) every heartbeat looks old through no worker's fault;
2. for every study: sample the trials of a new one, cancel what a cancelled
   one still has, decide finished rungs (promotions), finish a study whose
   trials can no longer move, and plan packs for ready trials;
3. dispatch ``pending`` packs: attempt + 1, job id ``pack-<id>-<attempt>``,
   committed *before* the job is enqueued — a crash in between leaves a
   queued pack without a job, which step 1 re-dispatches. A pack out of
   attempts fails its trials with the error kept.

Killing it at any point and starting it again loses nothing and enqueues
nothing twice.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from packtune.dispatcher import ABANDONED, Dispatcher, JobState, check_job_id, job_id_for
from packtune.errors import Conflict, QueueUnavailable, StoreUnavailable, StudyCannotRun
from packtune.settings import Settings, get_settings
from packtune.tuning import (
    DEAD_WORKER_KEPT_S,
    IDLE_TICK_SHARE,
    MAX_FAULTS,
    MIN_WAKE_S,
    PLAN_NEXT_TICK,
    TICK_SAMPLES,
)
from service import lifecycle, planning, store
from service.db import DATABASE_ERRORS, get_sessionmaker, session_scope
from service.models import (
    CheckStatus,
    Pack,
    PackStatus,
    Study,
    StudyStatus,
    TrialStatus,
    Worker,
    WorkerStatus,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker


log = logging.getLogger(__name__)

LEASE = "scheduler"
#: how often a tick also deletes workers dead for DEAD_WORKER_KEPT_S (not every tick)
FORGET_WORKERS_EVERY_S = 60.0


@dataclass
class TickReport:
    leader: bool = False
    started: int = 0
    planned: int = 0
    more: bool = False  # planning left ready units while a device has a slot open
    dispatched: int = 0
    requeued: int = 0
    failed_packs: int = 0
    deferred: int = 0  # studies whose planning waits for the next tick (run at once)
    sampled: int = 0  # trials sampled by this tick (of every study: about TICK_SAMPLES)
    queue_error: str | None = None  # the job queue could not be reached
    finished_studies: list[int] = field(default_factory=list)
    yields: list[int] = field(default_factory=list)  # running packs asked to give way
    #: seconds after which a waiting pack may take a running one's device: tick then
    wakes: list[float] = field(default_factory=list)


def _now() -> datetime:
    return datetime.now(UTC)


def idle_wait(
    interval: float, tick_seconds: float, renew_within: float, share: float = IDLE_TICK_SHARE
) -> float:
    """Seconds to wait after a tick that found nothing to do and took ``tick_seconds``: the
    rest of ``interval`` (counted from the tick's start), but never less than keeps the
    scheduler ticking ``share`` of its time at most, however slow its ticks are, unless the
    next tick would then start more than ``renew_within`` after this one's start (the
    scheduler's lease, taken at a tick's start, must be renewed before it lapses).

    >>> idle_wait(0.5, 0.1, 5), idle_wait(0.5, 0.3, 5), idle_wait(0.2, 0.25, 5)
    (0.4, 0.6, 0.5)
    >>> idle_wait(0.5, 4.0, 5)  # a lease of 10 s: renewed 5 s after the last
    1.0
    """
    stretched = min(tick_seconds * (1 / share - 1), renew_within - tick_seconds)
    return max(0.0, interval - tick_seconds, stretched)


def _holder_gone(holder: str | None) -> bool:
    """Whether ``holder`` (``host:pid:...``, as :class:`Scheduler` names itself) is a process
    of this host that no longer exists. Of another host nothing is known: its lease lapses."""
    if holder is None:
        return False
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's) or cannot be asked: as alive
        return False
    return False


def _moved_on(s: Session, study: Study) -> str | None:
    """What another transaction made of ``study`` while this tick advanced it (``cancelled``
    or ``deleted`` through the API, which commits mid-tick on PostgreSQL), or None while it
    is still pending or running. The tick's guarded move of it then raised
    :class:`~packtune.errors.Conflict`; its writes are undone, and a cancelled study's rest
    is cancelled later in the tick (:meth:`Scheduler._cancelled`)."""
    current = s.get(Study, study.id, populate_existing=True)
    if current is None:
        return "deleted"
    if current.status in (StudyStatus.pending, StudyStatus.running):
        return None
    return current.status.value


class Scheduler:
    def __init__(
        self,
        settings: Settings | None = None,
        factory: sessionmaker[Session] | None = None,
        dispatcher: Dispatcher | None = None,
        holder: str | None = None,
    ) -> None:
        if dispatcher is None:
            raise TypeError("a Scheduler needs a dispatcher (service.runtime.make_dispatcher)")
        self.settings = settings or get_settings()
        self.factory = factory or get_sessionmaker()
        self.dispatcher = dispatcher
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.wake = threading.Event()
        # since when (monotonic) every tick has reached the database; None after a failure
        self.connected_since: float | None = None
        self._forgot_workers_at = -math.inf  # store.forget_dead_workers, at the first tick
        self.queue_outage = False  # the last tick found the job queue unreachable
        self.store_outage = False  # the last tick found the database unreachable
        self.dispatcher.notify = self.wake.set  # a job's end wakes the loop at once

    @property
    def lease_ttl(self) -> float:
        """Seconds the scheduler lease taken at a tick's start lasts."""
        return max(10.0, 5 * self.settings.scheduler_interval)

    # -- one tick ---------------------------------------------------------------------------

    def tick(self) -> TickReport:
        report = TickReport()
        to_enqueue: list[tuple[int, str]] = []
        with session_scope(self.factory) as s:
            leader = store.acquire_lease(s, LEASE, self.holder, self.lease_ttl)
            holder = None if leader else store.lease_holder(s, LEASE)
            if holder is not None and _holder_gone(holder):
                # a process of this host killed outright (`packtune run` after kill -9)
                # holds it: the next run waited out its lease (10 s) before doing anything
                store.release_lease(s, LEASE, holder)
                leader = store.acquire_lease(s, LEASE, self.holder, self.lease_ttl)
            if self.connected_since is None:
                self.connected_since = time.monotonic()
            if not leader:
                return report
            report.leader = True
            now = _now()
            self._embedded_heartbeat(s)
            timeout = self.settings.heartbeat_timeout
            workers = store.live_workers(s, timeout)
            # every tick, not once when it starts to lead: a tick that failed (and rolled
            # back), or a lease lost and taken back from a scheduler that stopped since,
            # would leave a study's clock stopped for good. Packs train on through the gap on
            # RQ workers only: an embedded runner's die with their scheduler (a runner of
            # this one's may bear the name of the one that ran them)
            rq_workers = {w.name for w in workers} - self.dispatcher.embedded_workers
            store.resume_studies(s, now, rq_workers)
            if time.monotonic() - self._forgot_workers_at >= FORGET_WORKERS_EVERY_S:
                store.forget_dead_workers(s, DEAD_WORKER_KEPT_S)  # not a statement every tick
                self._forgot_workers_at = time.monotonic()
            if time.monotonic() - self.connected_since >= timeout:
                store.mark_dead_workers(s, timeout)
                trusted = {w.name for w in workers}
            else:  # too soon to tell a dead worker from one we could not hear
                trusted = store.worker_names(s, but=WorkerStatus.dead)
            self._reconcile(s, trusted, report)
            ready = [
                study
                for study in store.studies_with_status(
                    s, (StudyStatus.pending, StudyStatus.running)
                )
                if self._advance_alone(s, study, report)
            ]
            used: dict[int, float] = {}  # studies' device-seconds, read once a tick
            self._plan(s, ready, workers, now, report, used)
            self._cancelled(s)
            to_enqueue = self._dispatch(s, now, report, used)
            checks = self._checks(s)
        if report.yields:  # committed: the runner reads the request now, not at its next look
            self.dispatcher.nudge()
        for pack_id, job_id in to_enqueue:
            try:
                self.dispatcher.enqueue(pack_id, job_id)
            except QueueUnavailable as exc:  # the next tick re-dispatches
                report.queue_error = str(exc)
            except Exception as exc:
                log.warning("could not enqueue pack %s: %s", pack_id, exc)
        for check_id, job_id in checks:
            try:
                self.dispatcher.enqueue_check(check_id, job_id)
            except Exception as exc:  # its job is then missing: the next tick closes it
                log.warning("could not enqueue workload check %s: %s", check_id, exc)
        return report

    def _checks(self, s: Session) -> list[tuple[int, str]]:
        """Workload checks asked for through the API: the queued ones to dispatch; those whose
        job failed or vanished without a report are closed as ``error`` (a check is cheap
        to ask for again, so it is not retried)."""
        out: list[tuple[int, str]] = []
        for check in store.checks_with_status(s, store.OPEN_CHECK):
            if check.job_id is None:
                job_id = check_job_id(check.id)
                if store.set_check_job(s, check, job_id):
                    out.append((check.id, job_id))
                continue
            state, error = self.dispatcher.state(check.job_id)
            if state == JobState.failed:
                reason = f"the check's job failed: {error or 'no error text'}"
            elif state == JobState.missing:
                reason = "the check's job vanished (its runner or the queue restarted); ask again"
            elif state == JobState.finished:
                reason = "the check's job ended without a report"
            else:
                continue
            s.refresh(check)
            if check.status in store.OPEN_CHECK:
                store.finish_check(s, check.id, CheckStatus.error, error=reason)
        return out

    def _embedded_heartbeat(self, s: Session) -> None:
        for status in self.dispatcher.runner_statuses():
            busy = status.pop("busy")
            store.heartbeat(
                s, host=socket.gethostname(), **status,
                status=WorkerStatus.busy if busy else WorkerStatus.idle,
            )  # fmt: skip

    def _reconcile(self, s: Session, live: set[str], report: TickReport) -> None:
        for pack in store.packs_with_status(s, (PackStatus.queued, PackStatus.running)):
            if pack.job_id is None:
                self._requeue(s, pack, "dispatched without a job id", report, fault=True)
                continue
            state, detail = self.dispatcher.state(pack.job_id)
            if state == JobState.failed:
                # RQ gives a job up as abandoned when its worker died: not the trials' doing
                abandoned = detail is not None and ABANDONED in detail
                self._requeue(s, pack, detail or "job failed", report, fault=abandoned)
            elif state == JobState.missing:
                if self._running_on_live_worker(pack, live):
                    continue  # e.g. Redis restarted under a running job: its worker goes on
                self._requeue(s, pack, "job vanished from the queue", report, fault=True)
            elif state == JobState.finished:
                s.refresh(pack)  # the job ended: its own status is the truth
                if pack.status in (PackStatus.queued, PackStatus.running):
                    reason = "job ended without finishing the pack"
                    self._requeue(s, pack, reason, report, fault=True)
            elif state == JobState.running and pack.status == PackStatus.queued:
                # a worker took the job and died before it claimed the pack: RQ would
                # give the job up as abandoned only after its timeout (an hour)
                taker = detail
                if self._gone(taker, live):
                    reason = f"worker {taker} took its job and stopped sending heartbeats"
                    self._requeue(s, pack, reason, report, fault=True)
            elif pack.status == PackStatus.running and self._gone(pack.worker_name, live):
                reason = f"worker {pack.worker_name} stopped sending heartbeats"
                self._requeue(s, pack, reason, report, fault=True)

    def _gone(self, worker: str | None, live: set[str]) -> bool:
        """``worker`` is an RQ worker that no longer sends heartbeats."""
        return (
            worker is not None
            and worker not in live
            and worker not in self.dispatcher.embedded_workers
        )

    def _running_on_live_worker(self, pack: Pack, live: set[str]) -> bool:
        """The pack is running on an RQ worker that still sends heartbeats.

        RQ workers run jobs in-process, so such a pack is being trained whatever
        Redis says of its job; dispatching it again would train it twice at once.
        """
        return (
            pack.status == PackStatus.running
            and pack.worker_name in live
            and pack.worker_name not in self.dispatcher.embedded_workers
        )

    def _requeue(
        self, s: Session, pack: Pack, reason: str, report: TickReport, *, fault: bool
    ) -> None:
        """Back to pending for a later attempt (backoff); ``fault``: not the trials' doing."""
        log.info("pack %s back to pending: %s", pack.id, reason)
        if store.retry_pack(
            s, pack, error=reason, fault=fault, backoff=self.settings.retry_backoff
        ):
            report.requeued += 1

    def _advance_alone(self, s: Session, study: Study, report: TickReport) -> bool:
        """Advance one study in a savepoint of the tick's transaction; True if its ready
        trials are to be planned now. A study that can never run is failed with the reason;
        any other error is logged with its traceback, its writes are undone and the other
        studies go on (the next tick tries it again); the database's own trouble ends the
        tick."""
        try:
            with s.begin_nested():
                return self._advance(s, study, report)
        except StudyCannotRun as exc:
            log.error("study %s failed: %s", study.id, exc)
            store.move_study(s, study, StudyStatus.failed, error=str(exc))
            lifecycle.cancel_rest(s, study)
        except DATABASE_ERRORS:
            raise
        except Exception as exc:
            if isinstance(exc, Conflict) and (became := _moved_on(s, study)) is not None:
                log.info("study %s was %s while this tick advanced it", study.id, became)
            else:
                log.exception("study %s could not advance this tick; trying again", study.id)
        return False

    def _advance(self, s: Session, study: Study, report: TickReport) -> bool:
        advanced = lifecycle.advance_brackets(s, study)
        was_pending = study.status == StudyStatus.pending
        limit = max(0, TICK_SAMPLES - report.sampled)  # the tick's studies share one budget
        inserted, more = lifecycle.sample_due(
            s, study, limit, sampled=advanced.sampled, whole=not report.sampled
        )
        report.sampled += inserted
        report.started += was_pending and inserted > 0
        reason = lifecycle.budget_spent(s, study, _now()) if not was_pending else None
        if reason is not None:
            log.info("study %s: its budget is spent (%s); stopping it", study.id, reason)
            lifecycle.stop_for_budget(s, study, reason)
            report.finished_studies.append(study.id)
            return False
        if more and (inserted or limit < TICK_SAMPLES):  # perhaps cut short by the budget:
            report.deferred += 1  # the next tick goes on at once
            if report.sampled >= TICK_SAMPLES:
                return False
        # the decisions' counts hold unless sampling added trials since
        counts = advanced.statuses if not inserted else None
        if lifecycle.finish_if_done(s, study, more, counts=counts):
            report.finished_studies.append(study.id)
            return False
        if advanced.promoted + advanced.stopped + advanced.completed >= PLAN_NEXT_TICK:
            report.deferred += 1
            return False
        return True

    def _plan(
        self,
        s: Session,
        studies: list[Study],
        workers: list[Worker],
        now: datetime,
        report: TickReport,
        used: dict[int, float] | None = None,
    ) -> None:
        """Plan the ready trials of every study that advanced, together (service.planning);
        an error undoes only the planning, and the next tick tries again."""
        try:
            with s.begin_nested():
                plan = planning.plan_fleet(
                    s,
                    studies,
                    workers,
                    self.settings,
                    now,
                    asked=report.yields,
                    wake=report.wakes,
                    used_memo=used,
                )
                report.planned += plan.made
                report.more = report.more or plan.more
        except DATABASE_ERRORS:
            raise
        except Exception:
            log.exception("planning failed this tick; trying again")

    @staticmethod
    def _cancelled(s: Session) -> None:
        movable = (*lifecycle.ACTIVE, TrialStatus.paused)
        for study in store.studies_with_trials_in(s, StudyStatus.cancelled, movable):
            lifecycle.cancel_rest(s, study)

    def _dispatch(
        self, s: Session, now: datetime, report: TickReport, used: dict[int, float] | None = None
    ) -> list[tuple[int, str]]:
        out: list[tuple[int, str]] = []
        pending = store.packs_with_status(s, PackStatus.pending)
        for pack in planning.dispatch_order(s, pending, self.settings, now, used):
            if pack.retry_after is not None and pack.retry_after > now:
                continue  # backing off after a failed attempt
            counted = pack.attempts - pack.faults
            if counted >= self.settings.max_attempts or (
                pack.attempts >= self.settings.max_attempts + MAX_FAULTS
            ):
                self._fail(s, pack)
                report.failed_packs += 1
                continue
            attempt = pack.attempts + 1
            job_id = job_id_for(pack.id, attempt)
            # by id: nothing below reads the pack again, so it is not read back (a SELECT
            # per pack, with its members, on the tick's critical path)
            if store.move_pack(
                s, pack.id, PackStatus.queued, attempts=attempt, job_id=job_id, enqueued_at=now
            ):
                out.append((pack.id, job_id))
        report.dispatched = len(out)
        return out

    @staticmethod
    def _fail(s: Session, pack: Pack) -> None:
        error = f"pack {pack.id} failed after {pack.attempts} attempts: {pack.error}"
        # only the members still at this pack's unit: one that finished it in an earlier
        # attempt, or moved on to another pack since, is not this pack's to fail
        ids = [m.trial_id for m in store.unfinished_members(s, pack)]
        store.move_pack(s, pack, PackStatus.failed)
        store.move_trials(s, ids, TrialStatus.failed, error=error)

    # -- the loop ---------------------------------------------------------------------------

    def run(
        self,
        stop: threading.Event | None = None,
        until_study: int | None = None,
        on_tick: object = None,
    ) -> None:
        """Tick until ``stop`` is set (or, with ``until_study``, that study is finished)."""
        stop = stop or threading.Event()
        interval = self.settings.scheduler_interval
        while not stop.is_set():
            started = time.monotonic()
            # a job that ends from here on wakes the wait below, even if it ends mid-tick
            self.wake.clear()
            try:
                report = self.tick()
                self._queue_outage(report.queue_error)
                if self.store_outage:
                    log.warning("the database is back")
                    self.store_outage = False
            except QueueUnavailable as exc:  # one line per outage, not a traceback per tick
                self._queue_outage(str(exc))
                report = TickReport()
            except StoreUnavailable as exc:  # one line per outage, not two per tick
                self.connected_since = None
                if not self.store_outage:
                    reason = " ".join(str(exc).split())  # psycopg's message has line breaks
                    log.warning("the database is unavailable (%s); trying again", reason)
                self.store_outage = True
                report = TickReport()
            except Exception:
                log.exception("scheduler tick failed; trying again")
                report = TickReport()
            if callable(on_tick):
                on_tick(report)
            if until_study is not None and self._finished(until_study):
                return
            # look again at once only where that can do more: a plan that left ready units
            # beside an open device slot, a pack back to pending, a study's work cut short
            busy = report.more or report.requeued or report.deferred
            took = time.monotonic() - started
            wait = 0.0 if busy else idle_wait(interval, took, renew_within=self.lease_ttl / 2)
            if report.wakes:  # a waiting pack's claim turns better then: look at once
                wait = min(wait, max(MIN_WAKE_S, min(report.wakes) - took))
            self.wake.wait(wait)  # a finished pack (embedded runner, or RQ workers' notice)

    def _queue_outage(self, error: str | None) -> None:
        """Say once that the job queue is gone (``error``), and once that it is back."""
        if error is not None and not self.queue_outage:
            log.warning("the job queue is unavailable (%s); waiting for it", error)
        elif error is None and self.queue_outage:
            log.warning("the job queue is back")
        self.queue_outage = error is not None

    def _finished(self, study_id: int) -> bool:
        with session_scope(self.factory) as s:
            study = store.get_study(s, study_id)
            return study.status in (
                StudyStatus.completed,
                StudyStatus.failed,
                StudyStatus.cancelled,
            )

    def close(self) -> None:
        """Give the lease up, stopping the running studies' clocks if this scheduler led
        (until one leads again, nothing dispatches their packs; those queued on RQ workers
        train on, and :func:`service.store.resume_studies` counts them)."""
        try:
            with session_scope(self.factory) as s:
                if store.release_lease(s, LEASE, self.holder):
                    store.interrupt_studies(s, _now())
        finally:  # a database gone still lets its runners stop (serve's stop waited 30 s)
            self.dispatcher.close()
