"""The scheduler against a real SQLite database, with packs really trained in this process.

``SyncDispatcher`` runs ``worker.jobs.run_pack`` at once when a pack is
enqueued (the job the embedded runner and RQ workers run); tests make it
lose jobs or fail them to exercise re-dispatch.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from packtune.dispatcher import JobState
from packtune.errors import QueueUnavailable
from packtune.hyperband import plan_brackets
from packtune.settings import get_settings
from service import lifecycle, planning, store
from service.db import get_sessionmaker, session_scope
from service.models import (
    Lease,
    Pack,
    PackStatus,
    StudyStatus,
    Trial,
    TrialStatus,
    Worker,
    WorkerStatus,
)
from service.runtime import run_scheduler
from service.scheduler import Scheduler

SPEC: dict[str, Any] = {
    "name": "sched",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.3}},
    "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3},
    "packing": {"enabled": True, "max_pack_size": None},
    "seed": 1,
}


class SyncDispatcher:
    """Runs each job at once, in this process; ``lose`` and ``fail`` simulate a broken queue."""

    def __init__(self, run: bool = True) -> None:
        self.embedded_workers = frozenset({"sync@test"})
        self.enqueued: list[str] = []
        self.states: dict[str, tuple[JobState, str | None]] = {}
        self.run = run
        self.fail = False

    def enqueue(self, pack_id: int, job_id: str) -> None:
        from worker.jobs import run_pack

        self._run(run_pack, pack_id, job_id)

    def enqueue_check(self, check_id: int, job_id: str) -> None:
        from worker.jobs import run_check

        self._run(run_check, check_id, job_id)

    def _run(self, job: Any, arg: int, job_id: str) -> None:
        self.enqueued.append(job_id)
        if self.fail:
            self.states[job_id] = (JobState.failed, "RuntimeError: broken worker")
            return
        if not self.run:
            self.states[job_id] = (JobState.queued, None)
            return
        job(arg)
        self.states[job_id] = (JobState.finished, None)

    def state(self, job_id: str) -> tuple[JobState, str | None]:
        return self.states.get(job_id, (JobState.missing, None))

    nudged = 0

    def nudge(self) -> None:  # as the embedded runner's: the watches of this process look now
        from worker.jobs import nudge_watches

        self.nudged += 1
        nudge_watches()

    def lose(self) -> None:
        self.states.clear()

    notify = None

    def start(self, workload: str | None = None) -> None:
        pass

    def runner_statuses(self) -> list[dict[str, Any]]:
        return [{
            "name": "sync@test",
            "device_kind": "cpu",
            "gpus": [],
            "memory_budget": get_settings().cpu_memory_budget,
            "busy": False,
        }]  # fmt: skip

    def close(self) -> None:
        pass


@pytest.fixture
def db(embedded_db: pytest.MonkeyPatch) -> None:
    embedded_db.setenv("PACKTUNE_WORKER_NAME", "sync@test")  # the name SyncDispatcher reports
    embedded_db.setenv("PACKTUNE_RETRY_BACKOFF", "0")  # retries at once, unless a test says
    get_settings.cache_clear()


def new_study(spec: dict[str, Any] = SPEC) -> int:
    with session_scope(get_sessionmaker()) as s:
        return store.create_study(
            s, name=spec["name"], workload=spec["workload"], spec=spec, seed=spec["seed"]
        ).id


def scheduler(dispatcher: SyncDispatcher, holder: str = "test") -> Scheduler:
    return Scheduler(get_settings(), get_sessionmaker(), dispatcher, holder=holder)  # type: ignore[arg-type]


def run_to_end(sched: Scheduler, study_id: int, ticks: int = 60) -> StudyStatus:
    for _ in range(ticks):
        sched.tick()
        with session_scope(get_sessionmaker()) as s:
            status = store.get_study(s, study_id).status
        if status in (StudyStatus.completed, StudyStatus.failed, StudyStatus.cancelled):
            return status
    raise AssertionError(f"study {study_id} still {status} after {ticks} ticks")


def packs(study_id: int) -> list[Pack]:
    with session_scope(get_sessionmaker()) as s:
        stmt = (
            select(Pack)
            .where(store.of_study(study_id))
            .options(selectinload(Pack.members))
            .order_by(Pack.id)
        )
        return list(s.scalars(stmt))


def trials(study_id: int) -> list[Trial]:
    with session_scope(get_sessionmaker()) as s:
        return store.trials_of(s, study_id)


def test_first_tick_samples_every_bracket_and_dispatches_packs(db: None) -> None:
    study_id = new_study()
    dispatcher = SyncDispatcher(run=False)
    report = scheduler(dispatcher).tick()
    assert report.leader and report.started == 1
    expected = sum(rungs[0].n for rungs in plan_brackets(3, eta=3))
    assert len(trials(study_id)) == expected == 5
    planned = packs(study_id)
    assert planned and all(p.status == PackStatus.queued and p.attempts == 1 for p in planned)
    assert dispatcher.enqueued == [f"pack-{p.id}-1" for p in planned]
    queued = {m.trial_id for p in planned for m in p.members}
    assert all(t.status == TrialStatus.queued for t in trials(study_id) if t.id in queued)


def test_study_runs_to_completion_with_its_best_trial(db: None) -> None:
    study_id = new_study()
    assert run_to_end(scheduler(SyncDispatcher()), study_id) == StudyStatus.completed
    with session_scope(get_sessionmaker()) as s:
        study = store.get_study(s, study_id)
        best = study.best_trial_id
        finals = {
            t.id: store.latest_measurement(s, t.id)
            for t in store.trials_of(s, study_id, status=TrialStatus.completed)
        }
    values = {tid: m.metrics["val_loss"] for tid, m in finals.items() if m and m.resource == 3}
    assert best == min(values, key=lambda tid: (values[tid], tid))
    assert all(p.status == PackStatus.completed for p in packs(study_id))


def test_the_rung_decisions_count_the_trials_that_sampling_goes_on_from(db: None) -> None:
    """A tick's sampling starts from the trial count of the decisions just before it
    (Advance.sampled), not a query of its own: the count must be every trial of the study,
    whatever the decisions moved."""
    study_id = new_study()
    sched = scheduler(SyncDispatcher())
    seen = []
    for _ in range(4):
        with session_scope(get_sessionmaker()) as s:
            study = store.get_study(s, study_id)
            advanced = lifecycle.advance_brackets(s, study)
            assert advanced.sampled == len(store.trials_of(s, study_id))
            seen.append((advanced.sampled, advanced.promoted + advanced.stopped))
        sched.tick()
    assert seen[0] == (0, 0) and seen[-1][0] == 5
    assert any(moved for _, moved in seen), seen  # some decisions moved trials


def test_a_study_is_found_done_from_the_decisions_counts_exactly_as_from_its_own(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a tick where no rung was decided and nothing sampled, finish_if_done takes the
    trial counts the decisions read (Advance.statuses) instead of counting again: they must
    be the study's counts, and the study must still end as before."""
    study_id = new_study()
    real = lifecycle.finish_if_done
    given: list[dict[TrialStatus, int]] = []

    def checked(s: Any, study: Any, more: bool = False, counts: Any = None) -> bool:
        if counts is not None:
            assert dict(counts) == store.count_trials_by_status(s, study.id)
            given.append(dict(counts))
        return real(s, study, more, counts=counts)

    monkeypatch.setattr(lifecycle, "finish_if_done", checked)
    assert run_to_end(scheduler(SyncDispatcher()), study_id) == StudyStatus.completed
    assert given, "no tick passed the decisions' counts on"
    with session_scope(get_sessionmaker()) as s:
        assert store.get_study(s, study_id).best_trial_id is not None


def test_two_schedulers_do_not_both_dispatch(db: None) -> None:
    study_id = new_study()
    one, two = SyncDispatcher(run=False), SyncDispatcher(run=False)
    reports = [scheduler(one, "a").tick(), scheduler(two, "b").tick()]
    assert [r.leader for r in reports] == [True, False]
    assert two.enqueued == []
    assert len(one.enqueued) == len(packs(study_id))


def test_a_restarted_scheduler_dispatches_nothing_twice(db: None) -> None:
    study_id = new_study()
    first = SyncDispatcher(run=False)
    scheduler(first, "same-host").tick()
    dispatched = len(first.enqueued)
    # a new process (same holder after restart); the queue still has the jobs
    again = SyncDispatcher(run=False)
    again.states = dict(first.states)
    scheduler(again, "same-host").tick()
    assert again.enqueued == []
    assert all(p.attempts == 1 for p in packs(study_id))
    assert len(packs(study_id)) == dispatched


def test_vanished_jobs_are_dispatched_again_as_a_new_attempt(db: None) -> None:
    study_id = new_study()
    dispatcher = SyncDispatcher(run=False)
    sched = scheduler(dispatcher)
    sched.tick()
    first = list(dispatcher.enqueued)
    dispatcher.lose()  # e.g. Redis restarted
    report = sched.tick()
    assert report.requeued == len(first)
    assert dispatcher.enqueued[len(first) :] == [j.rsplit("-", 1)[0] + "-2" for j in first]
    dispatcher.lose()  # once more; the third attempt runs
    dispatcher.run = True
    assert run_to_end(sched, study_id) == StudyStatus.completed
    assert all(p.attempts <= 3 for p in packs(study_id))


def test_a_pack_out_of_attempts_fails_its_trials_with_the_error(db: None) -> None:
    study_id = new_study()
    dispatcher = SyncDispatcher()
    dispatcher.fail = True
    status = run_to_end(scheduler(dispatcher), study_id)
    assert status == StudyStatus.failed
    failed = [t for t in trials(study_id) if t.status == TrialStatus.failed]
    assert failed and all("broken worker" in (t.error or "") for t in failed)
    assert all(p.attempts == get_settings().max_attempts for p in packs(study_id))


def test_cancel_stops_dispatch_and_cancels_the_rest(db: None) -> None:
    study_id = new_study()
    dispatcher = SyncDispatcher(run=False)
    sched = scheduler(dispatcher)
    sched.tick()
    with session_scope(get_sessionmaker()) as s:
        store.move_study(s, store.get_study(s, study_id), StudyStatus.cancelled)
    sent = len(dispatcher.enqueued)
    sched.tick()
    assert len(dispatcher.enqueued) == sent
    assert {t.status for t in trials(study_id)} == {TrialStatus.cancelled}
    assert {p.status for p in packs(study_id)} == {PackStatus.cancelled}


ALIGNED: dict[str, Any] = {**SPEC, "name": "aligned", "hyperband": {"max_resource": 9, "eta": 3}}


def test_units_are_cut_at_every_rung_so_brackets_share_arrays(db: None) -> None:
    study_id = new_study(ALIGNED)
    scheduler(SyncDispatcher(run=False)).tick()
    spans = {(m.from_resource, m.to_resource) for p in packs(study_id) for m in p.members}
    assert spans == {(0.0, 1.0)}  # bracket 2 (-> 1), bracket 1 (-> 3), bracket 0 (-> 9)
    assert {t.bracket for t in trials(study_id)} == {0, 1, 2}


def final_values(study_id: int) -> tuple[dict[int, tuple[float, str]], dict[int, float]]:
    """Per sample: (last resource, status), and the last validation loss."""
    with session_scope(get_sessionmaker()) as s:
        where, values = {}, {}
        for t in store.trials_of(s, study_id):
            m = store.latest_measurement(s, t.id)
            assert m is not None
            where[t.sample_index] = (m.resource, str(t.status))
            values[t.sample_index] = m.metrics["val_loss"]
        return where, values


def test_cut_units_train_exactly_as_whole_ones(db: None) -> None:
    """Resuming at every rung resource changes no trial's result, nor the study's decisions."""
    # one after the other: run side by side, the two would share packs
    aligned = new_study(ALIGNED)
    assert run_to_end(scheduler(SyncDispatcher()), aligned) == StudyStatus.completed
    whole = new_study(
        {**ALIGNED, "name": "whole", "packing": {"enabled": True, "align_rungs": False}}
    )
    assert run_to_end(scheduler(SyncDispatcher()), whole) == StudyStatus.completed
    where_cut, values_cut = final_values(aligned)
    where_whole, values_whole = final_values(whole)
    assert where_cut == where_whole
    assert values_cut == pytest.approx(values_whole, rel=1e-5)
    cut = [(m.from_resource, m.to_resource) for p in packs(aligned) for m in p.members]
    uncut = [(m.from_resource, m.to_resource) for p in packs(whole) for m in p.members]
    assert (0.0, 9.0) in uncut and (0.0, 9.0) not in cut
    assert max(b - a for a, b in cut) == 6.0  # 3 -> 9, the longest span between two rungs
    assert array_epochs(aligned) < array_epochs(whole)


def array_epochs(study_id: int) -> float:
    """Epochs of fused-array training one device runs in sequence for the study."""
    arrays = {
        (p.id, m.fusion_key, m.from_resource, m.to_resource)
        for p in packs(study_id)
        for m in p.members
    }
    return sum(b - a for _, _, a, b in arrays)


def test_a_study_that_can_never_run_fails_and_the_others_go_on(db: None) -> None:
    """A stored study whose workload is gone fails with the reason, in the same tick in
    which a healthy study is sampled and dispatched."""
    gone = new_study({**SPEC, "name": "gone", "workload": "uninstalled-plugin"})
    healthy = new_study()
    dispatcher = SyncDispatcher(run=False)
    scheduler(dispatcher).tick()
    with session_scope(get_sessionmaker()) as s:
        failed = store.get_study(s, gone)
        assert failed.status is StudyStatus.failed
        assert "uninstalled-plugin" in (failed.error or "")
        assert store.get_study(s, healthy).status is StudyStatus.running
    assert dispatcher.enqueued, "the healthy study was not dispatched"


def test_an_unexpected_error_in_one_study_is_logged_and_undone(
    db: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug met while advancing one study (here: after sampling it) is logged with its
    traceback, that study's writes of the tick are rolled back, and the others advance."""
    broken, healthy = new_study({**SPEC, "name": "broken"}), new_study()
    real = lifecycle.sample_due

    def sample_due(s: Any, study: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(s, study, *args, **kwargs)
        if study.id == broken:
            store.move_trials(s, [t.id for t in store.trials_of(s, broken)], TrialStatus.failed)
            raise AttributeError("a bug in a plugin")
        return out

    monkeypatch.setattr(lifecycle, "sample_due", sample_due)
    with caplog.at_level(logging.ERROR, logger="service.scheduler"):
        scheduler(SyncDispatcher(run=False)).tick()
    assert f"study {broken} could not advance" in caplog.text
    assert "AttributeError: a bug in a plugin" in caplog.text  # the traceback
    with session_scope(get_sessionmaker()) as s:
        # undone: the broken study is back where the tick found it (not yet sampled)
        assert store.get_study(s, broken).status is StudyStatus.pending
        assert sum(store.count_trials_by_status(s, broken).values()) == 0
        assert store.get_study(s, healthy).status is StudyStatus.running
    assert packs(healthy) and not packs(broken)


def test_an_unexpected_error_in_planning_is_logged_and_undone(
    db: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug met while planning packs is logged with its traceback and undone; the studies
    were still sampled, and the next tick plans them."""
    study_id = new_study()
    real = planning.plan_fleet

    def plan_fleet(s: Any, *args: Any, **kwargs: Any) -> Any:
        store.create_pack(s, study_id=study_id, members=[(first_trial(s), "k", 0.0, 1.0)])
        raise AttributeError("a bug in the planner")

    monkeypatch.setattr(planning, "plan_fleet", plan_fleet)
    sched = scheduler(SyncDispatcher(run=False))
    with caplog.at_level(logging.ERROR, logger="service.scheduler"):
        sched.tick()
    assert "planning failed this tick" in caplog.text
    assert "AttributeError: a bug in the planner" in caplog.text
    with session_scope(get_sessionmaker()) as s:
        assert store.get_study(s, study_id).status is StudyStatus.running
        assert sum(store.count_trials_by_status(s, study_id).values()) > 0
    assert not packs(study_id)
    monkeypatch.setattr(planning, "plan_fleet", real)
    sched.tick()
    assert packs(study_id)


def first_trial(s: Any) -> int:
    return min(t.id for study in store.studies_with_status(s, (StudyStatus.running,))
               for t in store.trials_of(s, study.id))  # fmt: skip


def test_a_failed_pack_waits_before_its_retry_and_faults_do_not_count(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job lost with Redis is retried after a backoff, not at the next tick, and its
    attempt is a fault, not the trials'; a job that failed is an attempt that counts."""
    monkeypatch.setenv("PACKTUNE_RETRY_BACKOFF", "30")
    get_settings.cache_clear()
    study_id = new_study()
    dispatcher = SyncDispatcher(run=False)
    sched = scheduler(dispatcher)
    sched.tick()
    sent = len(dispatcher.enqueued)
    dispatcher.lose()
    assert sched.tick().requeued == sent
    assert sched.tick().dispatched == 0  # backing off: 15-30 s for the first retry
    waiting = packs(study_id)
    assert all(p.status == PackStatus.pending and p.faults == 1 for p in waiting)
    now = datetime.now(UTC)
    assert all(
        timedelta(seconds=14) < p.retry_after - now <= timedelta(seconds=30)  # type: ignore[operator]
        for p in waiting
    )
    with session_scope(get_sessionmaker()) as s:  # time passes
        for p in store.packs_of(s, study_id):
            p.retry_after = None
    assert sched.tick().dispatched == sent  # attempt 2; the lost one did not count
    assert all(p.attempts - p.faults == 1 for p in packs(study_id))


def _check(workload: str = "digits-mlp") -> int:
    with session_scope(get_sessionmaker()) as s:
        return store.create_check(s, workload, {"members": 2, "steps": 1}).id


def _check_row(check_id: int) -> tuple[str, str | None, dict[str, Any] | None]:
    with session_scope(get_sessionmaker()) as s:
        row = store.get_check(s, check_id)
        return row.status.value, row.error, row.report


def test_a_check_is_dispatched_once_and_its_report_stored(db: None) -> None:
    dispatcher = SyncDispatcher()
    sched = scheduler(dispatcher)
    check_id = _check()
    sched.tick()
    sched.tick()
    assert dispatcher.enqueued == [f"check-{check_id}"]
    status, error, report = _check_row(check_id)
    assert (status, error) == ("passed", None)
    assert report is not None and report["stacks"] == [[[0, 1], "bmm"]]


@pytest.mark.parametrize("how", ["failed", "lost"])
def test_a_check_whose_job_failed_or_vanished_is_closed_as_an_error(db: None, how: str) -> None:
    dispatcher = SyncDispatcher(run=False)
    dispatcher.fail = how == "failed"
    sched = scheduler(dispatcher)
    check_id = _check()
    sched.tick()  # dispatched: the job fails, or stays queued and is then lost
    if how == "lost":
        assert _check_row(check_id)[0] == "queued"
        dispatcher.lose()  # e.g. the embedded runner's scheduler restarted
    sched.tick()
    status, error, _ = _check_row(check_id)
    assert status == "error"
    assert error is not None
    assert ("broken worker" if how == "failed" else "vanished") in error
    sched.tick()
    assert dispatcher.enqueued == [f"check-{check_id}"]  # closed, not dispatched again


SLOWER_PAST_4 = {1: 100.0, 2: 180.0, 4: 300.0, 8: 250.0}


@pytest.mark.parametrize(
    ("alone", "at_once", "largest"),
    [
        (SLOWER_PAST_4, {}, 4),
        (SLOWER_PAST_4, {2: 500.0, 4: 420.0}, 2),
        ({1: 100.0, 2: 180.0, 4: 300.0, 8: 400.0}, {}, 17),
    ],
)
def test_arrays_take_the_size_measured_fastest_alone_or_several_at_once(
    db: None, alone: dict[int, float], at_once: dict[int, float], largest: int
) -> None:
    """Alone, arrays of 4 are the best (8 was slower); where two-trial arrays trained at
    once were measured faster than any array alone (and fours at once slower), the planner
    cuts arrays of 2; where the curve still rises, the 17 units are one array."""
    from packtune.space import fusion_key
    from packtune.workloads import get_workload

    workload = get_workload("digits-mlp")
    key = fusion_key("digits-mlp", workload.resolve({}), workload.structural_params())
    with session_scope(get_sessionmaker()) as s:
        store.set_memory_model(s, "digits-mlp", key, "cpu", 2**20, 2**20)
        for k, value in alone.items():
            store.record_throughput(s, "digits-mlp", key, "cpu", k, value)
        for k, value in at_once.items():
            store.record_throughput(s, "digits-mlp", key, "cpu", k, value, concurrent=True)
    study_id = new_study(ALIGNED)
    scheduler(SyncDispatcher()).tick()  # plans and trains the first rung's packs
    assert {t.fusion_key for t in trials(study_id)} == {key} and len(trials(study_id)) == 17
    planned = packs(study_id)
    arrays = Counter((p.id, m.array_no) for p in planned for m in p.members)
    assert max(arrays.values()) == largest, arrays
    # and the worker trained those arrays, not one array of each key and span per pack
    trained = [len(a["trials"]) for p in planned for a in p.arrays or []]
    assert sorted(trained) == sorted(arrays.values()), (trained, arrays)


def test_the_scheduler_process_freezes_its_long_lived_heap_before_it_ticks(db: None) -> None:
    """``run_scheduler`` (``packtune scheduler``, the scheduler process of ``serve``) collects
    and freezes what is alive before its loop: left to the collector, each full collection
    walked every import in the middle of a tick (bench d, 20 studies: 50-90 ms each)."""
    gc.unfreeze()  # what an earlier test's app froze in this process
    stop = threading.Event()
    stop.set()  # the loop ends at once: what matters is what came before it
    try:
        run_scheduler(stop, SyncDispatcher())
        assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()
    finally:
        gc.unfreeze()


def test_a_rung_left_short_by_diverged_trials_keeps_its_planned_survivors(db: None) -> None:
    """R=9, eta=3, bracket 2 plans 9 -> 3 -> 1. Seven of its nine diverge at rung 0, so
    rung 1 holds the two finite ones, not three: it still promotes the plan's one to
    R. Before, it kept floor(2 / 3) = 0, the bracket ended with no trial at R, and a study
    where that happened everywhere failed for want of a result at R."""
    spec = {**SPEC, "hyperband": {"max_resource": 9, "min_resource": 1, "eta": 3}}
    study_id = new_study(spec)
    factory = get_sessionmaker()
    with session_scope(factory) as s:
        lifecycle.sample_due(s, store.get_study(s, study_id))
    with session_scope(factory) as s:
        briefs = store.trial_briefs(s, study_id)
        others = [t.id for t in briefs if t.bracket != 2]
        store.move_trials(s, others, TrialStatus.cancelled)  # only bracket 2 counts
        ids = [t.id for t in briefs if t.bracket == 2]
        assert len(ids) == 9
        store.move_trials(s, ids, TrialStatus.queued)
        store.move_trials(s, ids, TrialStatus.running)
        store.move_trials(s, ids[:7], TrialStatus.diverged)
        for j, trial_id in enumerate(ids[7:]):
            store.record_measurement(s, trial_id, 1.0, {"val_loss": 0.5 + j}, metric="val_loss")
        store.move_trials(s, ids[7:], TrialStatus.paused, resource_done=1.0)
    with session_scope(factory) as s:
        assert lifecycle.advance_brackets(s, store.get_study(s, study_id)).promoted == 2
    with session_scope(factory) as s:
        up = [t.id for t in store.trial_briefs(s, study_id, status=TrialStatus.pending)]
        assert sorted(up) == sorted(ids[7:])
        store.move_trials(s, up, TrialStatus.queued)
        store.move_trials(s, up, TrialStatus.running)
        for j, trial_id in enumerate(sorted(up)):
            store.record_measurement(
                s, trial_id, 3.0, {"val_loss": 0.3 - j / 10}, metric="val_loss"
            )
        store.move_trials(s, up, TrialStatus.paused, resource_done=3.0)
    with session_scope(factory) as s:
        decided = lifecycle.advance_brackets(s, store.get_study(s, study_id))
        assert (decided.promoted, decided.stopped) == (1, 1)
    with session_scope(factory) as s:
        (last,) = store.trial_briefs(s, study_id, status=TrialStatus.pending)
        assert (last.id, last.rung) == (max(up), 2)  # the better one (0.2) goes on to R


def test_a_worker_back_from_a_stall_does_not_overwrite_newer_checkpoints(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker w1 claims the first pack and stalls past the heartbeat timeout (a SIGSTOP, a
    paused VM); the scheduler takes it for dead, the pack trains again elsewhere and the
    study runs to its end. Then w1 goes on with its stale unit: its trials are no longer
    running there, so it moves none of them and every trial's checkpoint stays the one
    its row names (its measurements are upserted with the same values). Before, w1 wrote
    its checkpoints over the newer ones (a completed trial's checkpoint went back to an
    earlier epoch: the best model download handed out the wrong model)."""
    import torch

    from worker import jobs
    from worker.checkpoints import load_checkpoint

    monkeypatch.setenv("PACKTUNE_HEARTBEAT_TIMEOUT", "1")
    get_settings.cache_clear()
    study_id = new_study()
    dispatcher = SyncDispatcher(run=False)
    sched = scheduler(dispatcher)
    sched.tick()
    first = min(p.id for p in packs(study_id))
    with session_scope(get_sessionmaker()) as s:
        store.heartbeat(s, name="w1@host", host="host", device_kind="cpu", gpus=[],
                        memory_budget=get_settings().cpu_memory_budget)  # fmt: skip
    stale = jobs._load(first, "w1@host", torch.device("cpu"))
    assert stale
    time.sleep(1.5)  # w1 misses its heartbeats
    dispatcher.run = True
    assert run_to_end(sched, study_id) == StudyStatus.completed

    def checkpoints() -> dict[int, tuple[float, int | None]]:
        out = {}
        for t in trials(study_id):
            state = load_checkpoint(t.checkpoint_path) if t.checkpoint_path else None
            steps = int(state["steps_done"]) if state else None
            out[t.id] = (t.resource_done, steps)
        return out

    before = checkpoints()
    jobs._run_arrays(stale, torch.device("cpu"), "cpu", get_settings().checkpoint_dir)
    assert checkpoints() == before


@pytest.mark.parametrize(
    "training", [None, {"mode": "decoupled", "segments": 2, "units": "segment"}],
    ids=["end-to-end", "segment-units"],
)  # fmt: skip
def test_a_fusible_parameter_the_data_reads_does_not_share_batches(
    db: None, monkeypatch: pytest.MonkeyPatch, training: dict[str, Any] | None
) -> None:
    """``input_scale`` is declared fusible, but data() scales the inputs with it: members of
    an array train on the first member's batches, so trials with different scales must not
    share one. Packed, every trial ends as it does alone (max_pack_size 1), and the packs
    say why they were cut. Before, every member trained on the first one's scaled data
    (val_loss apart by far more than rounding), with no warning; segment units skipped the
    check until later (trial 3: 1.09 packed, 2.37 alone)."""
    from packtune.workloads import registry
    from tests.support.plugins.trap_workloads import DataScaledMLP

    monkeypatch.setitem(registry(), DataScaledMLP.name, DataScaledMLP())
    space = {"lr": SPEC["space"]["lr"], "input_scale": {"type": "uniform", "low": 0.2, "high": 3}}
    results, notes = {}, []
    for packed in (True, False):
        spec = {**SPEC, "name": f"scaled-{packed}", "workload": DataScaledMLP.name,
                "space": space, "sampler": "random",
                "packing": {"enabled": True, "max_pack_size": None if packed else 1},
                **({"training": training} if training else {})}  # fmt: skip
        study_id = new_study(spec)
        done = run_to_end(scheduler(SyncDispatcher()), study_id, ticks=100)
        assert done == StudyStatus.completed
        results[packed] = {t.sample_index: t.objective for t in trials(study_id)}
        if packed:
            notes = [n for p in packs(study_id) for a in p.arrays or [] for n in a["notes"]]
    assert results[True].keys() == results[False].keys()
    for index, value in results[True].items():
        assert value == pytest.approx(results[False][index], rel=1e-5), index
    assert any("reads input_scale" in n for n in notes), notes


def test_a_target_reached_at_max_resource_stops_the_study_with_that_trial(db: None) -> None:
    """``budget.target`` counts a trial measured at max_resource as soon as it is (paused
    there for its bracket, not yet completed): the study stops at the next tick with that
    trial as its best. Before, only completed trials counted: the rest of the bracket went
    on training to R after the target was met, and the trial that met it was cancelled with
    the rest, so another became the best."""
    from service.models import Measurement

    spec = {**SPEC, "hyperband": {"max_resource": 9, "min_resource": 1, "eta": 3},
            "packing": {"enabled": True, "max_pack_size": 1}, "sampler": "random",
            "budget": {"target": 100.0}}  # fmt: skip  # any val_loss reaches it
    study_id = new_study(spec)
    sched = scheduler(SyncDispatcher())
    first = None
    for _ in range(100):
        sched.tick()
        with session_scope(get_sessionmaker()) as s:
            study = store.get_study(s, study_id)
            at_max = s.scalars(select(Measurement.trial_id).where(Measurement.resource == 9)).all()
            if first is None and at_max:
                first = sorted(at_max)
            if study.status is not StudyStatus.running:
                break
    assert first is not None
    assert (study.status, study.stop_reason) == (StudyStatus.completed, "target")
    assert study.best_trial_id in first  # a trial that met the target, not a later one
    assert sorted(at_max) == first  # nothing else trained to R after it


def test_a_worker_dead_for_a_day_is_forgotten(db: None) -> None:
    """A worker started without a name is ``host-pid``, a new row at each start: dead rows
    were kept for ever (``/api/workers`` and ``/metrics`` listed every one). A tick deletes
    those dead and silent for a day; a worker dead for an hour stays listed."""
    from service.models import Worker, WorkerStatus

    with session_scope(get_sessionmaker()) as s:
        for name in ("host-101", "host-202"):
            store.heartbeat(s, name=name, host="host", device_kind="cpu", gpus=[],
                            memory_budget=2**30)  # fmt: skip
        ages = {"host-101": timedelta(days=2), "host-202": timedelta(hours=1)}
        for worker in s.scalars(select(Worker)):
            if worker.name in ages:
                worker.status = WorkerStatus.dead
                worker.last_heartbeat = datetime.now(UTC) - ages[worker.name]
    scheduler(SyncDispatcher()).tick()
    with session_scope(get_sessionmaker()) as s:
        names = set(s.scalars(select(Worker.name)))
    assert "host-101" not in names and "host-202" in names


def test_a_cancelled_studys_progress_keeps_the_units_it_trained(db: None) -> None:
    """Trials paused at rung 0 when their study is cancelled had finished a unit each; the
    summary counted units by status, and a cancelled trial's said nothing, so the study read
    0 of N done (9/69 in the cancel's answer, 0/69 just after)."""
    from service.queries import study_summary

    study_id = new_study({**SPEC, "sampler": "random"})
    sched = scheduler(SyncDispatcher())
    for _ in range(20):  # until the first rung's trials are trained, none promoted yet
        sched.tick()
        with session_scope(get_sessionmaker()) as s:
            statuses = [t.status for t in store.trials_of(s, study_id)]
            if statuses.count(TrialStatus.paused) >= 3:
                break
    with session_scope(get_sessionmaker()) as s:
        before = study_summary(s, study_id)["progress"]["done"]
        assert before >= 3
        store.move_study(s, store.get_study(s, study_id), StudyStatus.cancelled)
    sched.tick()  # cancels the trials
    with session_scope(get_sessionmaker()) as s:
        assert {t.status for t in store.trials_of(s, study_id)} <= {
            TrialStatus.cancelled, TrialStatus.completed, TrialStatus.stopped}  # fmt: skip
        assert study_summary(s, study_id)["progress"]["done"] == before


class ClosingDispatcher(SyncDispatcher):
    closed = False

    def close(self) -> None:
        self.closed = True


def test_the_time_with_no_scheduler_is_not_a_studys_running_time(db: None) -> None:
    """The leader that stops stamps its running studies; a standby that stops does not;
    the next leader counts the time since as idle (the budget's clock stood still)."""
    study_id = new_study({**SPEC, "budget": {"max_seconds": 3600}})
    first, standby = scheduler(SyncDispatcher(run=False)), scheduler(SyncDispatcher(), "b")
    first.tick()
    with session_scope(get_sessionmaker()) as s:  # a slow first tick (a loaded machine) can
        later = datetime.now(UTC) + timedelta(hours=1)  # outlast its 10 s lease
        s.execute(Lease.__table__.update().values(expires_at=later))
    assert standby.tick().leader is False
    standby.close()
    with session_scope(get_sessionmaker()) as s:
        assert store.get_study(s, study_id).interrupted_at is None  # it did not lead
    first.close()
    with session_scope(get_sessionmaker()) as s:
        study = store.get_study(s, study_id)
        assert study.status is StudyStatus.running and study.interrupted_at is not None
        stopped = store.run_seconds(study, study.interrupted_at + timedelta(hours=2))
        study.interrupted_at -= timedelta(hours=2)  # as if it had sat two hours
        study.started_at -= timedelta(hours=2)
    assert stopped is not None and stopped < 60  # its clock stands while it sits
    scheduler(SyncDispatcher(run=False), "c").tick()
    with session_scope(get_sessionmaker()) as s:
        study = store.get_study(s, study_id)
        assert study.interrupted_at is None and 7200 <= study.idle_seconds < 7260
        ran = store.run_seconds(study, datetime.now(UTC))
        assert ran is not None and ran < 60, ran
        assert lifecycle.budget_spent(s, study, datetime.now(UTC)) is None


def test_a_scheduler_whose_database_is_gone_still_closes_its_runners(
    db: None, sqlite_url: str
) -> None:
    """serve's stop waited 30 s for its scheduler child when the database failed at the
    release of the lease: the exception skipped closing the runner, which held it up."""
    import sqlalchemy as sa

    dispatcher = ClosingDispatcher(run=False)
    sched = scheduler(dispatcher)
    sched.tick()
    with sa.create_engine(sqlite_url).begin() as conn:
        conn.execute(sa.text("DROP TABLE leases"))
    with pytest.raises(Exception, match="leases"):
        sched.close()
    assert dispatcher.closed


def _stopped(study_id: int, ran: timedelta, sat: timedelta) -> None:
    """As if the study had run ``ran`` before its scheduler stopped ``sat`` ago."""
    with session_scope(get_sessionmaker()) as s:
        study = store.get_study(s, study_id)
        assert study.interrupted_at is not None
        study.interrupted_at -= sat
        study.started_at = study.interrupted_at - ran


class QueueDown(SyncDispatcher):
    down = True

    def state(self, job_id: str) -> tuple[JobState, str | None]:
        if self.down:
            raise QueueUnavailable("redis down")
        return super().state(job_id)


def test_a_failed_first_tick_does_not_leave_a_studys_clock_stopped(db: None) -> None:
    """The next leader's first tick took the stopped time off, then failed (its queue down
    as an RQ deployment restarts) and rolled it back; its later ticks never did it again:
    the study's clock stood still for good and max_seconds never ended it."""
    study_id = new_study({**SPEC, "budget": {"max_seconds": 60}})
    first = scheduler(SyncDispatcher(run=False))
    first.tick()
    first.close()
    _stopped(study_id, timedelta(seconds=30), timedelta(hours=1))
    queue = QueueDown(run=False)
    second = scheduler(queue, "second")  # type: ignore[arg-type]
    with pytest.raises(QueueUnavailable):
        second.tick()
    queue.down = False
    second.tick()
    with session_scope(get_sessionmaker()) as s:
        study = store.get_study(s, study_id)
        assert study.interrupted_at is None
        later = datetime.now(UTC) + timedelta(minutes=5)
        assert lifecycle.budget_spent(s, study, later) == "max_seconds"


def test_a_leader_whose_lease_lapsed_takes_the_stopped_time_off_when_it_leads_again(
    db: None,
) -> None:
    study_id = new_study({**SPEC, "budget": {"max_seconds": 60}})
    a, b = scheduler(SyncDispatcher(run=False), "a"), scheduler(SyncDispatcher(run=False), "b")
    a.tick()
    with session_scope(get_sessionmaker()) as s:  # a stalls past its lease; b takes over
        s.execute(Lease.__table__.update().values(expires_at=datetime.now(UTC) - timedelta(1)))
    assert b.tick().leader
    b.close()  # b stops: the study's clock with it
    _stopped(study_id, timedelta(seconds=30), timedelta(hours=1))
    assert a.tick().leader
    with session_scope(get_sessionmaker()) as s:
        study = store.get_study(s, study_id)
        assert study.interrupted_at is None and study.idle_seconds >= 3600


def test_a_study_cancelled_while_no_scheduler_ran_keeps_its_running_time(db: None) -> None:
    study_id = new_study({**SPEC, "budget": {"max_seconds": 36_000}})
    first = scheduler(SyncDispatcher(run=False))
    first.tick()
    first.close()
    _stopped(study_id, timedelta(hours=2), timedelta(hours=1))
    with session_scope(get_sessionmaker()) as s:  # POST /cancel on serve --no-scheduler
        store.move_study(s, store.get_study(s, study_id), StudyStatus.cancelled)
    with session_scope(get_sessionmaker()) as s:  # ... five hours before a scheduler leads
        study = store.get_study(s, study_id)
        for stamp in ("started_at", "interrupted_at", "finished_at"):
            setattr(study, stamp, getattr(study, stamp) - timedelta(hours=5))
    scheduler(SyncDispatcher(run=False), "next").tick()
    with session_scope(get_sessionmaker()) as s:
        ran = store.run_seconds(store.get_study(s, study_id), datetime.now(UTC))
    assert ran is not None and 7190 <= ran <= 7210, ran


def _ran_10_minutes_then_sat_an_hour() -> int:
    """A study with a budget whose scheduler, having planned its packs, stopped: as if it
    had run 10 minutes, then sat an hour with no scheduler."""
    study_id = new_study({**SPEC, "budget": {"max_seconds": 36_000}})
    first = scheduler(SyncDispatcher(run=False))
    first.tick()
    first.close()
    _stopped(study_id, timedelta(minutes=10), timedelta(hours=1))
    return study_id


def test_packs_that_trained_on_without_a_scheduler_count_as_running_time(db: None) -> None:
    """Packs queued on RQ workers train on while no scheduler runs: that is the study's
    running time, up to the last of them to finish."""
    study_id = _ran_10_minutes_then_sat_an_hour()
    with session_scope(get_sessionmaker()) as s:
        pack = s.scalars(select(Pack).where(Pack.study_id == study_id)).first()
        assert pack is not None
        pack.status, pack.started_at = PackStatus.completed, datetime.now(UTC) - timedelta(hours=1)
        pack.finished_at = datetime.now(UTC) - timedelta(minutes=20)  # 40 min after the stop
    scheduler(SyncDispatcher(run=False), "next").tick()
    with session_scope(get_sessionmaker()) as s:
        ran = store.run_seconds(store.get_study(s, study_id), datetime.now(UTC))
    assert ran is not None and 50 * 60 - 10 <= ran <= 50 * 60 + 10, ran


@pytest.mark.parametrize("alive", [True, False])
def test_a_pack_still_training_when_a_scheduler_leads_again_counts_as_running_time(
    db: None, alive: bool
) -> None:
    """A pack a worker took while no scheduler ran, and still trains when one leads again:
    the whole gap was the study's running time, not idle (it counted only packs that had
    finished by then, so a max_seconds budget ran that much past its time). Not where its
    worker died meanwhile (its heartbeats stopped): that pack trains nothing."""
    study_id = _ran_10_minutes_then_sat_an_hour()
    with session_scope(get_sessionmaker()) as s:
        pack = s.scalars(select(Pack).where(Pack.study_id == study_id)).first()
        assert pack is not None
        pack.status, pack.started_at = PackStatus.running, datetime.now(UTC) - timedelta(hours=1)
        pack.worker_name = "w1@host"
        store.heartbeat(s, name="w1@host", host="host", device_kind="cpu", gpus=[],
                        memory_budget=2**30, status=WorkerStatus.busy)  # fmt: skip
        if not alive:
            worker = s.scalars(select(Worker).where(Worker.name == "w1@host")).one()
            worker.last_heartbeat = datetime.now(UTC) - timedelta(minutes=30)
    scheduler(SyncDispatcher(run=False), "next").tick()
    with session_scope(get_sessionmaker()) as s:
        study = store.get_study(s, study_id)
        ran = store.run_seconds(study, datetime.now(UTC))
    if alive:
        assert study.idle_seconds < 10, study.idle_seconds
        assert ran is not None and 70 * 60 - 10 <= ran <= 70 * 60 + 10, ran
    else:
        assert study.idle_seconds >= 3600, study.idle_seconds


def test_a_lease_held_by_a_process_of_this_host_that_is_gone_is_taken_at_once(db: None) -> None:
    """`packtune run` killed with kill -9 left its lease: the next run waited it out (10 s)
    before it scheduled anything. A process of another host, or one alive, keeps it."""
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    later = datetime.now(UTC) + timedelta(minutes=1)
    for holder, taken in (
        (f"{socket.gethostname()}:{dead.pid}:abc", True),
        (f"{socket.gethostname()}:{os.getpid()}:abc", False),  # alive
        (f"another-host:{dead.pid}:abc", False),  # nothing known of it: its lease lapses
    ):
        with session_scope(get_sessionmaker()) as s:
            s.execute(Lease.__table__.delete())
            s.add(Lease(name="scheduler", holder=holder, expires_at=later))
        assert scheduler(SyncDispatcher(run=False), "me").tick().leader is taken, holder


def test_a_database_outage_is_one_line_and_its_end_another(
    db: None, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """While the database was down the scheduler logged two lines a tick (psycopg's
    message has a line break): ~120 a minute. One when it goes, one when it is back."""
    from pathlib import Path

    file = Path(sqlite_url.removeprefix("sqlite:///"))
    sched = scheduler(SyncDispatcher(run=False))
    engine = get_sessionmaker().kw["bind"]
    stop, ticks = threading.Event(), []

    def on_tick(report: Any) -> None:
        ticks.append(report)
        if len(ticks) == 2:  # gone: a directory where the file was cannot be opened
            file.rename(file.with_suffix(".away"))
            file.mkdir()
            engine.dispose()  # no connection kept open to the file moved away
        elif len(ticks) == 6:
            file.rmdir()
            file.with_suffix(".away").rename(file)
        elif len(ticks) == 8:
            stop.set()

    with caplog.at_level(logging.WARNING, logger="service.scheduler"):
        sched.run(stop=stop, on_tick=on_tick)
    said = [r.getMessage() for r in caplog.records if "database" in r.getMessage()]
    assert len(said) == 2 and said[1] == "the database is back", said
    assert said[0].startswith("the database is unavailable (") and "\n" not in said[0]
