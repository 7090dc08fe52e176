"""A unit that reports a trial late must leave it alone once the trial is on a later unit.

With segment units (``training.units: segment``) two units of a trial may both find all of
its segments done and both finish it; the second to report may do so after the trial was
promoted and claimed for its next span (running again). Its report must not move the trial
back to the span it finished (status, resource and checkpoint are the next unit's)."""

from __future__ import annotations

import dataclasses

import pytest
from sqlalchemy import update

from packtune.spec import validate_spec
from service import store
from service.db import get_sessionmaker, session_scope
from service.models import StudyStatus, Trial, TrialStatus
from tests.scheduler.test_scheduler import (
    SPEC,
    SyncDispatcher,
    db,
    new_study,
    run_to_end,
    scheduler,
)
from worker.execute import ArrayJob, MemberJob, mark_done

__all__ = ["db"]  # the fixture, used by name

SEGMENTS = {**SPEC, "name": "segments", "space": {**SPEC["space"],
            "layers": {"type": "choice", "values": [3]}},
            "training": {"mode": "decoupled", "segments": 2, "units": "segment"}}  # fmt: skip


def test_a_late_report_leaves_a_trial_on_its_next_span_alone(db: None) -> None:
    spec = validate_spec(SEGMENTS)
    study_id = new_study(spec.model_dump(mode="json"))
    assert run_to_end(scheduler(SyncDispatcher()), study_id) == StudyStatus.completed
    with session_scope(get_sessionmaker()) as s:
        trials = store.trials_of(s, study_id)
        assert {t.status for t in trials} <= {TrialStatus.completed, TrialStatus.stopped}
        trial = next(t for t in trials if t.resource_done == 3.0)  # promoted to R
        # as if claimed for a next unit: running at 3 epochs (a completed trial may not move
        # back by the store's rules; the test sets it)
        s.execute(update(Trial).where(Trial.id == trial.id).values(status=TrialStatus.running))
        trial_id, path = trial.id, trial.checkpoint_path
        seed, index, config = store.get_study(s, study_id).seed, trial.sample_index, trial.config
    member = MemberJob(
        trial_id=trial_id, sample_index=index, config=dict(config), resource_done=0.0,
        checkpoint_path=None, rung_resource=1.0, study_id=study_id, study_seed=seed,
        metric="val_loss", horizon=3.0,
    )  # fmt: skip
    late = ArrayJob(pack_id=0, data_seed=seed, workload="digits-mlp",
                    fusion_key="k", from_resource=0.0, to_resource=1.0, members=[member],
                    training=spec.training, segment=1)  # fmt: skip
    mark_done(late, {trial_id: "late-checkpoint.pt"})  # its first span's late report
    with session_scope(get_sessionmaker()) as s:
        (after,) = store.trials_by_id(s, [trial_id])
        assert (after.status, after.resource_done, after.checkpoint_path) == (
            TrialStatus.running, 3.0, path)  # fmt: skip
    on_time = dataclasses.replace(late, from_resource=3.0, to_resource=3.0)
    mark_done(on_time, {trial_id: str(path)})  # a report at the trial's unit moves it
    with session_scope(get_sessionmaker()) as s:
        (after,) = store.trials_by_id(s, [trial_id])
        assert after.status == TrialStatus.paused


def _one_pack_per_segment(study_id: int, dispatcher: SyncDispatcher) -> dict[int, int]:
    """The study's first pack replaced by one pack per segment (as two devices would train
    them), both queued with jobs the dispatcher knows: segment -> pack id."""
    from sqlalchemy import delete

    from packtune.dispatcher import JobState
    from service.models import Pack, PackMember, PackStatus

    with session_scope(get_sessionmaker()) as s:
        (first,) = store.packs_of(s, study_id)
        rows = [(m.trial_id, m.fusion_key, m.from_resource, m.to_resource, m.segment, m.array_no)
                for m in first.members]  # fmt: skip
        s.execute(delete(PackMember).where(PackMember.pack_id == first.id))
        s.execute(delete(Pack).where(Pack.id == first.id))
        out = {}
        for segment in (0, 1):
            pack = store.create_pack(s, study_id=study_id, device="sync@test:cpu",
                                     members=[r for r in rows if r[4] == segment])  # fmt: skip
            job = f"pack-{pack.id}-1"
            s.execute(update(Pack).where(Pack.id == pack.id)
                      .values(status=PackStatus.queued, attempts=1, job_id=job))  # fmt: skip
            dispatcher.states[job] = (JobState.queued, None)
            out[segment] = pack.id
    return out


class _Killed(BaseException):
    """The worker process dies here."""


def test_a_unit_requeued_while_its_trials_other_unit_trains_lets_that_one_finish_them(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two devices train a span's two segment units. Worker A dies after saving its
    segment's parts and restarts: its pack goes back to pending. Its trials were queued
    again too, under worker B's unit still training them, so B's end (every segment done:
    merged, measured) could not move them (only from running) and deleted the parts; A's
    retry could then neither find its part nor finish them, and the study stayed running
    for ever with every pack completed. Now they stay running for B to finish."""
    import worker.jobs as jobs
    import worker.segment_units as units
    from packtune.dispatcher import JobState
    from packtune.settings import get_settings
    from service.models import PackStatus

    study_id = new_study(validate_spec(SEGMENTS).model_dump(mode="json"))
    dispatcher = SyncDispatcher(run=False)
    sched = scheduler(dispatcher)
    sched.tick()
    packs = _one_pack_per_segment(study_id, dispatcher)
    device = jobs.pick_device()
    arrays_b = jobs._load(packs[1], "worker-B", device)  # B claims segment 1 and trains
    assert arrays_b

    def dies(*args: object, **kwargs: object) -> None:
        raise _Killed

    finish = units.finish_spans
    monkeypatch.setattr(units, "finish_spans", dies)  # A dies after saving its parts
    monkeypatch.setenv("PACKTUNE_WORKER_NAME", "worker-A")
    with pytest.raises(_Killed):
        jobs.run_pack(packs[0])
    monkeypatch.setattr(units, "finish_spans", finish)
    monkeypatch.setenv("PACKTUNE_WORKER_NAME", "sync@test")
    with session_scope(get_sessionmaker()) as s:  # A starts again under its name
        assert store.requeue_packs_of(s, "worker-A", "worker restarted") == [packs[0]]
        assert {t.status for t in store.trials_of(s, study_id)} == {TrialStatus.running}
    runs = jobs._run_arrays(arrays_b, device, "cpu", get_settings().checkpoint_dir)
    with session_scope(get_sessionmaker()) as s:  # B's end finishes the trials
        store.finish_pack(s, store.get_pack(s, packs[1]), PackStatus.completed, arrays=runs)
        assert {t.status for t in store.trials_of(s, study_id)} <= {TrialStatus.paused}
    dispatcher.run = True
    for job in list(dispatcher.states):
        dispatcher.states[job] = (JobState.finished, None)
    assert run_to_end(sched, study_id, ticks=40) == StudyStatus.completed
    folder = get_settings().checkpoint_dir / f"study-{study_id}"
    assert not list(folder.glob("*.segment*"))  # no part left once the study has ended
