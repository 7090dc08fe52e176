"""``run_pack`` on a real SQLite database: records, idempotency, crash recovery, OOM split."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import pytest

from packtune.packing import Device, MemoryModel, Unit, plan_packs
from packtune.settings import get_settings
from packtune.space import fusion_key
from packtune.tuning import HEADROOM
from packtune.workloads import get_workload
from service import store
from service.db import get_sessionmaker, session_scope
from service.models import PackStatus, TrialStatus
from worker.checkpoints import load_checkpoint
from worker.jobs import run_pack

SPEC: dict[str, Any] = {
    "name": "jobs",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {},
    "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3},
    "packing": {"enabled": True, "max_pack_size": None},
    "seed": 3,
}


@pytest.fixture
def db(embedded_db: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    return embedded_db


def make_pack(
    lrs: list[float],
    start: float = 0.0,
    end: float = 1.0,
    extra: list[dict[str, Any]] | None = None,
) -> tuple[int, list[int]]:
    """A queued pack of digits-mlp trials of learning rates ``lrs`` (and ``extra`` config
    each), in a study of its own."""
    workload = get_workload("digits-mlp")
    extra = extra or [{} for _ in lrs]
    with session_scope(get_sessionmaker()) as s:
        study = store.create_study(s, name="jobs", workload="digits-mlp", spec=SPEC, seed=3)
        rows = [
            {
                "sample_index": i,
                "bracket": 1,
                "rung": 0,
                "config": {"lr": lr, **more},
                "fusion_key": fusion_key(
                    "digits-mlp",
                    workload.resolve({"lr": lr, **more}),
                    workload.structural_params(),
                ),
            }
            for i, (lr, more) in enumerate(zip(lrs, extra, strict=True))
        ]
        store.add_trials(s, study.id, rows)
        trials = store.trials_of(s, study.id)
        for t in trials:
            t.status = TrialStatus.queued
        pack = store.create_pack(
            s,
            study_id=study.id,
            members=[(t.id, t.fusion_key, start, end) for t in trials],
        )
        pack.status = PackStatus.queued
        return pack.id, [t.id for t in trials]


def snapshot(trial_ids: list[int]) -> dict[int, Any]:
    with session_scope(get_sessionmaker()) as s:
        out = {}
        for tid in trial_ids:
            t = store.get_trial(s, tid)
            points = [(m.resource, m.metrics) for m in store.measurements_of(s, tid)]
            out[tid] = (t.status, t.resource_done, t.checkpoint_path, t.error, points)
        return out


def test_a_pack_trains_records_and_checkpoints_every_member(db: pytest.MonkeyPatch) -> None:
    pack_id, ids = make_pack([0.05, 0.1, 0.2])
    assert run_pack(pack_id) == "completed"
    state = snapshot(ids)
    for tid in ids:
        status, done, path, _, points = state[tid]
        assert (status, done) == (TrialStatus.paused, 1.0)
        assert [r for r, _ in points] == [1.0]
        metrics = points[0][1]
        assert {"train_loss", "val_loss", "val_accuracy"} <= set(metrics)
        assert math.isfinite(metrics["val_loss"])
        ckpt = load_checkpoint(path)
        assert ckpt is not None and ckpt["steps_done"] == get_workload(
            "digits-mlp"
        ).steps_per_epoch({})
    with session_scope(get_sessionmaker()) as s:
        pack = store.get_pack(s, pack_id)
        assert pack.status == PackStatus.completed and pack.train_seconds
        key = pack.members[0].fusion_key
        profile = store.get_profile(s, "digits-mlp", key, "cpu")
        assert profile is not None and profile.base_bytes and profile.per_trial_bytes
        assert "3" in profile.throughput  # this array's size was measured


def test_running_a_finished_pack_again_changes_nothing(db: pytest.MonkeyPatch) -> None:
    pack_id, ids = make_pack([0.05, 0.1])
    run_pack(pack_id)
    before = snapshot(ids)
    assert run_pack(pack_id) == "skipped"
    assert snapshot(ids) == before


def test_a_stale_job_of_an_earlier_attempt_does_not_claim_the_pack(
    db: pytest.MonkeyPatch, redis_url: str
) -> None:
    """A real RQ worker runs the job of a pack's attempt 1 after the pack was dispatched
    again as attempt 2 (an operator's ``rq requeue`` of failed jobs; a job the scheduler
    had given up as lost): it must not train the pack. It claimed it, the attempt's own job
    found the pack running and ended, and the scheduler, seeing that job end with the pack
    unfinished, dispatched it a third time while the stale job still trained it."""
    import uuid

    from redis import Redis
    from rq import Queue
    from sqlalchemy import update

    from packtune.dispatcher import JOB_FUNC, job_id_for
    from service.models import Pack
    from worker.main import PackWorker

    pack_id, ids = make_pack([0.05, 0.1])
    with session_scope(get_sessionmaker()) as s:
        s.execute(update(Pack).where(Pack.id == pack_id)
                  .values(attempts=2, job_id=job_id_for(pack_id, 2)))  # fmt: skip
    redis = Redis.from_url(redis_url)
    queue = Queue(f"test-stale-{uuid.uuid4().hex[:8]}", connection=redis)
    try:
        stale = queue.enqueue_call(JOB_FUNC, args=(pack_id,), job_id=job_id_for(pack_id, 1))
        PackWorker([queue], connection=redis).work(burst=True, with_scheduler=False)
        assert stale.get_status(refresh=True) == "finished"
        assert stale.return_value() == "skipped"
        with session_scope(get_sessionmaker()) as s:
            pack = store.get_pack(s, pack_id)
            assert (pack.status, pack.worker_name) == (PackStatus.queued, None)
        assert all(t[0] == TrialStatus.queued for t in snapshot(ids).values())
        # the attempt's own job trains it
        current = queue.enqueue_call(JOB_FUNC, args=(pack_id,), job_id=job_id_for(pack_id, 2))
        PackWorker([queue], connection=redis).work(burst=True, with_scheduler=False)
        assert current.return_value() == "completed"
    finally:
        queue.delete(delete_jobs=True)
        redis.close()


def test_only_the_trials_whose_objective_is_never_reported_fail(
    db: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """One array may hold trials of several studies of one workload (packs across studies).
    Of a workload that does not declare its metrics, a trial of a study naming ``val_f1``
    (never reported) fails saying so; its array-mate of a study naming ``val_loss`` trains
    and is measured as alone."""
    from tests.support.plugins import HERE, install_plugin, registered

    root = install_plugin(tmp_path / "dist", "trap_workloads",
                          {"undeclared": "trap_workloads:UndeclaredMLP"})  # fmt: skip
    db.syspath_prepend(str(HERE))
    with registered(db, root, ("trap_workloads",)):
        workload = get_workload("undeclared-mlp")
        config = {"lr": 0.05}
        key = fusion_key("undeclared-mlp", workload.resolve(config), workload.structural_params())
        trials = {}
        with session_scope(get_sessionmaker()) as s:
            for metric in ("val_loss", "val_f1"):
                spec = {**SPEC, "name": metric, "workload": "undeclared-mlp",
                        "objective": {"metric": metric, "mode": "min"}}  # fmt: skip
                study = store.create_study(s, name=metric, workload="undeclared-mlp",
                                           spec=spec, seed=3)  # fmt: skip
                row = {"sample_index": 0, "bracket": 1, "rung": 0, "config": config,
                       "fusion_key": key}  # fmt: skip
                store.add_trials(s, study.id, [row])
                (trial,) = store.trials_of(s, study.id)
                trial.status = TrialStatus.queued
                trials[metric] = trial.id
            members = [(i, key, 0.0, 1.0) for i in trials.values()]
            pack = store.create_pack(s, study_id=study.id, members=members)
            pack.status = PackStatus.queued
            pack_id = pack.id
        assert run_pack(pack_id) == "completed"
    got = snapshot(list(trials.values()))
    status, _, _, error, _ = got[trials["val_f1"]]
    assert status == TrialStatus.failed
    assert "did not report the study's objective metric 'val_f1'" in error
    status, done, _, error, points = got[trials["val_loss"]]
    assert (status, done, error) == (TrialStatus.paused, 1.0, None)
    assert [r for r, m in points if math.isfinite(m["val_loss"])] == [1.0]


def test_a_pack_whose_units_an_earlier_attempt_finished_is_completed_not_cancelled(
    db: pytest.MonkeyPatch,
) -> None:
    """Issue (seen in CI's fault test of a worker restarted under its name): the worker was
    killed after writing its units' ends but before closing the pack; the restart put the
    pack back in the queue, and its next attempt, finding nothing left to train, marked it
    cancelled with "study ended" while the study ran on. A pack dispatched again with every
    unit already trained (here: re-queued while a slow attempt still ran, which then
    finished them) is completed, the earlier note kept, and nothing is trained again."""
    pack_id, ids = make_pack([0.05, 0.1])
    assert run_pack(pack_id) == "completed"
    done = snapshot(ids)
    note = "worker w1 stopped heartbeating"
    with session_scope(get_sessionmaker()) as s:  # re-queued, then dispatched again
        pack = store.get_pack(s, pack_id)
        pack.status = PackStatus.pending
        assert store.move_pack(s, pack, PackStatus.queued, attempts=2, error=note)
    run_pack(pack_id)
    with session_scope(get_sessionmaker()) as s:
        pack = store.get_pack(s, pack_id)
        assert (pack.status, pack.attempts, pack.error) == (PackStatus.completed, 2, note)
        assert store.get_study(s, pack.study_id).status.value not in ("cancelled", "failed")
    assert snapshot(ids) == done


def test_a_pack_requeued_after_its_units_ended_is_completed_at_once(
    db: pytest.MonkeyPatch,
) -> None:
    """Issue: a worker killed after writing its units' ends but before closing the pack
    left, once re-queued (its restart, or the heartbeat timeout), a pending pack with
    nothing to train: it waited for a dispatch to find that out, and stayed pending if its
    study ended first. Every unit trained, the attempt's work is the pack's: completed at
    the re-queue, with the reason kept; the members are left as they are."""
    pack_id, ids = make_pack([0.05, 0.1])
    assert run_pack(pack_id) == "completed"
    done = snapshot(ids)
    note = "worker w1 restarted while training it"
    for requeue in (
        lambda s: store.requeue_packs_of(s, "w1", note),  # the worker's restart
        lambda s: store.retry_pack(
            s, store.get_pack(s, pack_id), error=note, fault=True, backoff=0.0
        ),  # the scheduler's timeout  # fmt: skip
    ):
        with session_scope(get_sessionmaker()) as s:  # as the killed attempt left it
            pack = store.get_pack(s, pack_id)
            pack.status, pack.worker_name, pack.error = PackStatus.running, "w1", None
        with session_scope(get_sessionmaker()) as s:
            assert not requeue(s)  # nothing re-queued
        with session_scope(get_sessionmaker()) as s:
            pack = store.get_pack(s, pack_id)
            assert (pack.status, pack.error) == (PackStatus.completed, note)
        assert snapshot(ids) == done


def test_a_unit_checkpointed_but_not_recorded_is_not_trained_twice(
    db: pytest.MonkeyPatch,
) -> None:
    """A job killed between writing checkpoints and recording them: the retry sees the
    checkpoint's step count and only records."""
    pack_id, ids = make_pack([0.05, 0.1])
    run_pack(pack_id)
    done = snapshot(ids)
    with session_scope(get_sessionmaker()) as s:  # roll the database back, keep the files
        pack = store.get_pack(s, pack_id)
        pack.status = PackStatus.queued
        for tid in ids:
            t = store.get_trial(s, tid)
            t.status, t.resource_done = TrialStatus.queued, 0.0
    assert run_pack(pack_id) == "completed"
    assert snapshot(ids) == done


def test_the_halves_of_a_split_pack_keep_the_arrays_the_planner_cut(
    db: pytest.MonkeyPatch,
) -> None:
    """A pack of two arrays of 3 (the planner's cut by measurement) runs out of memory: each
    half keeps its members' array numbers, so its arrays are parts of those two, not one
    array of every member of the key (which would train at a size nobody measured)."""
    db.setenv("PACKTUNE_OOM_ABOVE", "3")
    get_settings.cache_clear()
    pack_id, ids = make_pack([0.05, 0.1, 0.2, 0.3, 0.02, 0.04])
    with session_scope(get_sessionmaker()) as s:
        for m in store.get_pack(s, pack_id).members:
            m.array_no = ids.index(m.trial_id) % 2  # arrays 0: trials 0, 2, 4; 1: 1, 3, 5
    assert run_pack(pack_id) == "split"
    with session_scope(get_sessionmaker()) as s:
        study_id = store.get_pack(s, pack_id).study_id
        halves = [p for p in store.packs_of(s, study_id) if p.parent_id == pack_id]
        numbers = {m.trial_id: m.array_no for p in halves for m in p.members}
        half_ids = [p.id for p in halves]
    assert numbers == {t: i % 2 for i, t in enumerate(ids)}
    for hid in half_ids:
        with session_scope(get_sessionmaker()) as s:
            store.get_pack(s, hid).status = PackStatus.queued
        assert run_pack(hid) == "completed"
    with session_scope(get_sessionmaker()) as s:
        trained = [
            sorted(a["trials"]) for hid in half_ids for a in store.get_pack(s, hid).arrays or []
        ]
    expected = [[t for t in half if numbers[t] == n] for half in ([ids[0], ids[1], ids[2]],
                                                                  [ids[3], ids[4], ids[5]])
                for n in (0, 1)]  # fmt: skip
    assert sorted(trained) == sorted(sorted(e) for e in expected if e), trained


def test_resuming_from_a_checkpoint_matches_one_longer_run(db: pytest.MonkeyPatch) -> None:
    first, ids = make_pack([0.1])
    run_pack(first)
    with session_scope(get_sessionmaker()) as s:
        trial = store.get_trial(s, ids[0])
        trial.status = TrialStatus.queued
        pack = store.create_pack(
            s, study_id=trial.study_id, members=[(trial.id, trial.fusion_key, 1.0, 3.0)]
        )
        pack.status = PackStatus.queued
        second = pack.id
    run_pack(second)
    resumed = snapshot(ids)[ids[0]][4]
    whole, other = make_pack([0.1], 0.0, 3.0)
    run_pack(whole)
    straight = snapshot(other)[other[0]][4]
    assert [r for r, _ in resumed] == [r for r, _ in straight] == [1.0, 2.0, 3.0]
    for (_, a), (_, b) in zip(resumed[1:], straight[1:], strict=True):
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-6)


def test_a_diverging_member_is_marked_and_the_others_finish(db: pytest.MonkeyPatch) -> None:
    pack_id, ids = make_pack([0.05, 1e6, 0.1])
    assert run_pack(pack_id) == "completed"
    state = snapshot(ids)
    assert state[ids[1]][0] == TrialStatus.diverged
    assert "non-finite" in (state[ids[1]][3] or "")
    assert {state[i][0] for i in (ids[0], ids[2])} == {TrialStatus.paused}


def test_out_of_memory_splits_the_pack_and_raises_the_memory_model(
    db: pytest.MonkeyPatch,
) -> None:
    db.setenv("PACKTUNE_OOM_ABOVE", "2")
    get_settings.cache_clear()
    pack_id, ids = make_pack([0.05, 0.1, 0.2, 0.3])
    assert run_pack(pack_id) == "split"
    with session_scope(get_sessionmaker()) as s:
        pack = store.get_pack(s, pack_id)
        assert pack.status == PackStatus.split and "OutOfMemory" in (pack.error or "")
        halves = [p for p in store.packs_of(s, pack.study_id) if p.parent_id == pack_id]
        assert sorted(len(p.members) for p in halves) == [2, 2]
        assert {m.trial_id for p in halves for m in p.members} == set(ids)
        assert {store.get_trial(s, t).status for t in ids} == {TrialStatus.queued}
        profile = store.get_profile(s, "digits-mlp", pack.members[0].fusion_key, "cpu")
        assert profile is not None
        capacity = get_settings().cpu_memory_budget
        assert profile.base_bytes + 4 * profile.per_trial_bytes > capacity
        half_ids = [p.id for p in halves]
    for hid in half_ids:
        with session_scope(get_sessionmaker()) as s:
            store.get_pack(s, hid).status = PackStatus.queued
        assert run_pack(hid) == "completed"
    assert {v[0] for v in snapshot(ids).values()} == {TrialStatus.paused}


@pytest.mark.parametrize("spill", [True, False])
def test_a_trial_out_of_memory_alone_is_planned_again_to_train_spilled(
    db: pytest.MonkeyPatch, spill: bool
) -> None:
    """A GPU's way to a model larger than the device: the probe or the first step of a
    lone trial runs out of memory. With spilling on, the trial is pending again and its
    memory model exceeds the device alone, so the planner gives it a device of its own and
    the next pack trains it spilled; with it off, the trial fails as before."""
    db.setenv("PACKTUNE_OOM_ABOVE", "0")
    db.setenv("PACKTUNE_SPILL", str(spill).lower())
    get_settings.cache_clear()
    pack_id, (trial_id,) = make_pack([0.05])
    assert run_pack(pack_id) == "split"
    capacity = int(get_settings().cpu_memory_budget * HEADROOM)
    with session_scope(get_sessionmaker()) as s:
        pack, trial = store.get_pack(s, pack_id), store.get_trial(s, trial_id)
        profile = store.get_profile(s, "digits-mlp", trial.fusion_key, "cpu")
        assert profile is not None and profile.base_bytes is not None
        model = MemoryModel(int(profile.base_bytes), int(profile.per_trial_bytes or 0))
        key, status, error = trial.fusion_key, trial.status, trial.error
    assert model.bytes(1) > capacity
    if not spill:
        assert pack.status == PackStatus.failed and status == TrialStatus.failed
        assert "out of memory even alone" in (error or "")
        return
    assert pack.status == PackStatus.split and "train spilled" in (pack.error or "")
    assert status == TrialStatus.pending
    unit = Unit(trial_id, key, 0.0, 1.0)
    plan = plan_packs([unit], [Device("cpu", get_settings().cpu_memory_budget)], {key: model},
                      {key: 2}, default_memory=model, spill=True)  # fmt: skip
    assert [p.spilled for p in plan.packs] == [True]
    db.delenv("PACKTUNE_OOM_ABOVE")  # the device holds a shard at a time
    get_settings.cache_clear()
    with session_scope(get_sessionmaker()) as s:
        store.move_trials(s, [trial_id], TrialStatus.queued)
    spilled = _pack_for(trial_id, 0.0, 1.0)
    assert run_pack(spilled) == "completed"
    assert snapshot([trial_id])[trial_id][:2] == (TrialStatus.paused, 1.0)
    with session_scope(get_sessionmaker()) as s:
        notes = [n for run in store.get_pack(s, spilled).arrays or [] for n in run["notes"]]
    assert any(n.startswith("spilled:") for n in notes), notes


@pytest.mark.parametrize(
    ("budget", "alternating"),
    [
        (8_000_000, 2),  # ~10 MB a trial, 3.6 MB a share: both alternate
        # a share is too small for the 512-wide trial's layers: it runs after the other,
        # the device to itself, one shard at a time (half would be too small too)
        (6_700_000, 1),
    ],
)
def test_spilled_arrays_of_one_pack_alternate_on_the_device_with_in_memory_results(
    db: pytest.MonkeyPatch, budget: int, alternating: int
) -> None:
    """Two trials of different structure, each larger than the device, in one pack (as the
    planner puts them when no device is free): they train at once in two threads, each in
    half the device one shard at a time, and end as they do in memory."""
    db.setenv("PACKTUNE_ARRAY_THREADS", "2")
    get_settings.cache_clear()
    shapes = [{"hidden": 512, "layers": 4}, {"hidden": 448, "layers": 4}]
    reference, ref_ids = make_pack([0.05, 0.1], extra=shapes)
    assert run_pack(reference) == "completed"  # in memory (4 GiB); probes both keys
    db.setenv("PACKTUNE_CPU_MEMORY_BUDGET", str(budget))
    get_settings.cache_clear()
    pack_id, ids = make_pack([0.05, 0.1], extra=shapes)
    assert run_pack(pack_id) == "completed"
    with session_scope(get_sessionmaker()) as s:
        notes = [n for run in store.get_pack(s, pack_id).arrays or [] for n in run["notes"]]
    assert len([n for n in notes if n.startswith("spilled:")]) == 2, notes
    assert len([n for n in notes if "alternating" in n]) == alternating, notes
    want, got = snapshot(ref_ids), snapshot(ids)
    for a, b in zip(ref_ids, ids, strict=True):
        assert got[b][:2] == want[a][:2] == (TrialStatus.paused, 1.0), got[b]
        (_, mine), (_, theirs) = got[b][4][-1], want[a][4][-1]
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)


def _pack_for(trial_id: int, start: float, end: float) -> int:
    """A pack of one member, queued, as the scheduler would plan the trial's next unit."""
    with session_scope(get_sessionmaker()) as s:
        trial = store.get_trial(s, trial_id)
        pack = store.create_pack(
            s, study_id=trial.study_id, members=[(trial_id, trial.fusion_key, start, end)]
        )
        return pack.id


def test_a_retried_pack_leaves_alone_a_trial_that_moved_on(db: pytest.MonkeyPatch) -> None:
    """Issue: a pack failed after one of its arrays had finished; the finished trial went
    on (trained 1 -> 3 in another pack, then claimed by a third); the retry of the first
    pack claimed it again, found its checkpoint at step 3 x spe instead of 0 and failed it.
    The retry must train only the members still at its unit's start, and touch no other."""
    pack_id, (moved, stayed) = make_pack([0.05, 0.1])
    assert run_pack(_pack_for(moved, 0.0, 1.0)) == "completed"  # its first unit, elsewhere
    with session_scope(get_sessionmaker()) as s:
        store.move_trials(s, [moved], TrialStatus.pending, rung=1)  # promoted
        store.move_trials(s, [moved], TrialStatus.queued)
    assert run_pack(_pack_for(moved, 1.0, 3.0)) == "completed"
    with session_scope(get_sessionmaker()) as s:  # and now a third pack trains it
        store.move_trials(s, [moved], TrialStatus.pending)
        store.move_trials(s, [moved], TrialStatus.queued)
        store.move_trials(s, [moved], TrialStatus.running)
    before = snapshot([moved])[moved]
    assert before[:2] == (TrialStatus.running, 3.0)

    assert run_pack(pack_id) == "completed"  # the retry of the first pack
    assert snapshot([moved])[moved] == before  # not trained, not failed, not re-marked
    status, done, _, error, points = snapshot([stayed])[stayed]
    assert (status, done, error) == (TrialStatus.paused, 1.0, None)
    assert [r for r, _ in points] == [1.0]


def test_a_failed_pack_fails_only_the_members_still_at_its_unit(db: pytest.MonkeyPatch) -> None:
    """A pack out of attempts fails its unfinished members, not one that moved on."""
    from bench.scheduler_scale import RecordingDispatcher
    from service.scheduler import Scheduler, TickReport

    pack_id, (moved, stayed) = make_pack([0.05, 0.1])
    assert run_pack(_pack_for(moved, 0.0, 1.0)) == "completed"
    with session_scope(get_sessionmaker()) as s:  # promoted, and training in another pack
        for to in (TrialStatus.pending, TrialStatus.queued, TrialStatus.running):
            store.move_trials(s, [moved], to, rung=1)
        pack = store.get_pack(s, pack_id)
        store.move_pack(s, pack, PackStatus.pending, attempts=get_settings().max_attempts)

    scheduler = Scheduler(get_settings(), get_sessionmaker(), RecordingDispatcher(), holder="t")
    with session_scope(get_sessionmaker()) as s:
        report = TickReport()
        assert scheduler._dispatch(s, datetime.now(UTC), report) == []
        assert report.failed_packs == 1
    assert snapshot([stayed])[stayed][0] == TrialStatus.failed
    assert snapshot([moved])[moved][:2] == (TrialStatus.running, 1.0)


@pytest.mark.parametrize(("every", "written"), [(60.0, [1, 2]), (0.0, [1, 1, 1])])
def test_short_epochs_are_recorded_together_and_all_before_the_unit_ends(
    db: pytest.MonkeyPatch, every: float, written: list[int]
) -> None:
    """An array's epochs are written at most ``RECORD_EVERY_S`` apart, in one transaction
    each time (a round trip to PostgreSQL per write), the first epoch at once: three
    sub-second epochs of a unit make two writes (the first, then the other two), and every
    epoch is there when the unit ends; with no interval, one per epoch.

    The first at once: the fault tests kill a worker once a pack has recorded an epoch
    strictly inside its unit; with every epoch written just before the unit's end, the kill
    often landed after it (a flaky failure of test_a_worker_killed_mid_pack)."""
    from worker import execute

    db.setattr(execute, "RECORD_EVERY_S", every, raising=False)
    epochs: list[int] = []  # per transaction, the epochs it recorded
    real_retrying, real_record = execute.retrying, store.record_measurements

    def counted(work: Any, **kwargs: Any) -> Any:
        epochs.append(0)
        return real_retrying(work, **kwargs)

    def record(*args: Any, **kwargs: Any) -> Any:
        epochs[-1] += 1
        return real_record(*args, **kwargs)

    db.setattr(execute, "retrying", counted)
    db.setattr(store, "record_measurements", record)
    pack_id, ids = make_pack([0.05, 0.1], start=0.0, end=3.0)
    assert run_pack(pack_id) == "completed"
    assert [n for n in epochs if n] == written
    for _, done, _, _, points in snapshot(ids).values():
        assert done == 3.0 and [r for r, _ in points] == [1.0, 2.0, 3.0]


def test_a_pack_with_compiled_steps_records_what_the_eager_pack_records(
    db: pytest.MonkeyPatch,
) -> None:
    """The setting reaches the pack's arrays. Traced by torch's ``aot_eager`` backend (no code
    generated: ~14 s less here); inductor's steps are compared with eager ones, to float
    rounding, in tests/worker/test_compiled.py."""
    from worker import compiled

    db.setattr(compiled, "BACKEND", "aot_eager")
    lrs = [0.05, 0.1, 0.2]
    eager_pack, eager_ids = make_pack(lrs)
    assert run_pack(eager_pack) == "completed"
    db.setenv("PACKTUNE_COMPILE_STEP", "on")
    get_settings.cache_clear()
    compiled.reset()
    try:
        pack_id, ids = make_pack(lrs)
        assert run_pack(pack_id) == "completed"
        assert compiled._STEPS and not compiled._FAILED  # the worker's arrays compiled
    finally:
        compiled.reset()
    eager, got = snapshot(eager_ids), snapshot(ids)
    for a, b in zip(eager_ids, ids, strict=True):
        assert got[b][0] == eager[a][0] == TrialStatus.paused
        [(_, want)], [(_, have)] = eager[a][4], got[b][4]  # one epoch's metrics each
        assert have == pytest.approx(want, rel=1e-5)


def test_a_compiled_packs_throughput_leaves_its_compilations_out(
    db: pytest.MonkeyPatch,
) -> None:
    """The planner sizes arrays from their measured trial-steps/s: a reading that counted a
    compilation (seconds, once per size) would make every newly compiled size look slow.
    The pack records its stacks as compiled, and a throughput of its steady steps."""
    import time

    from worker import compiled

    pause = 2.0

    def slow(graph: Any, inputs: Any) -> Any:
        time.sleep(pause)  # a compilation that takes its time
        return graph.forward

    db.setattr(compiled, "BACKEND", slow)
    db.setenv("PACKTUNE_COMPILE_STEP", "on")
    get_settings.cache_clear()
    compiled.reset()
    try:
        pack_id, _ = make_pack([0.05, 0.1, 0.2])
        assert run_pack(pack_id) == "completed"
    finally:
        compiled.reset()
    steps = get_workload("digits-mlp").steps_per_epoch({})
    with session_scope(get_sessionmaker()) as s:
        pack = store.get_pack(s, pack_id)
        assert [stack["compiled"] for a in pack.arrays for stack in a["stacks"]] == [True]
        profile = store.get_profile(s, "digits-mlp", pack.members[0].fusion_key, "cpu")
        assert profile is not None
        # with a compilation's pause counted, the reading would be under this
        assert profile.throughput["3"] > 3 * steps / pause
