"""A unit that reports a trial late must leave it alone once the trial is on a later unit.

With segment units (``training.units: segment``) two units of a trial may both find all of
its segments done and both finish it; the second to report may do so after the trial was
promoted and claimed for its next span (running again). Its report must not move the trial
back to the span it finished (status, resource and checkpoint are the next unit's)."""

from __future__ import annotations

import dataclasses

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
