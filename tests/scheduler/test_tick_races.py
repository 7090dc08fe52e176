"""A cancel that lands while a scheduler tick runs, on PostgreSQL (where the API's cancel
commits while the tick's transaction is open): the tick picks it up, it does not fail.

The cancel is committed from another connection, as the API commits it, at a chosen point
of the tick: after the tick has read the study, before the write that moves it on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sqlalchemy import text

from packtune.settings import get_settings
from service import lifecycle, store
from service.db import dispose_engines, get_sessionmaker, session_scope, upgrade
from service.models import PackStatus, StudyStatus, TrialStatus
from tests.scheduler.test_scheduler import SPEC, SyncDispatcher, new_study, packs, scheduler, trials

pytestmark = pytest.mark.postgres

#: one bracket of one trial trained for one epoch: done at the second tick
ONE_TRIAL: dict[str, Any] = {**SPEC, "hyperband": {"max_resource": 1, "min_resource": 1}}


@pytest.fixture
def pg(clean_env: pytest.MonkeyPatch, fresh_postgres: str, tmp_path: Path) -> Iterator[None]:
    """Settings for a scheduler over a migrated PostgreSQL database of the test's own."""
    clean_env.setenv("PACKTUNE_DATABASE_URL", fresh_postgres)
    clean_env.setenv("PACKTUNE_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    clean_env.setenv("PACKTUNE_DEVICE", "cpu")
    clean_env.setenv("PACKTUNE_WORKER_NAME", "sync@test")  # the name SyncDispatcher reports
    get_settings.cache_clear()
    dispose_engines()
    upgrade(fresh_postgres)
    yield
    dispose_engines()


def cancel_elsewhere(study_id: int) -> None:
    """What ``POST /cancel`` does, committed on a connection of its own."""
    with session_scope(get_sessionmaker()) as s:
        s.execute(text("set local lock_timeout = '10s'"))  # a wait on the tick fails, not hangs
        store.move_study(s, store.lock_study(s, study_id), StudyStatus.cancelled)


def cancel_in(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str, study_id: int, *, after: bool
) -> None:
    """At the tick's first call of ``module.name``: cancel the study elsewhere, just before
    the call or just ``after`` it."""
    real: Callable[..., Any] = getattr(module, name)
    done: list[bool] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not done and not after:
            done.append(True)
            cancel_elsewhere(study_id)
        out = real(*args, **kwargs)
        if not done:
            done.append(True)
            cancel_elsewhere(study_id)
        return out

    monkeypatch.setattr(module, name, call)


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def assert_cancelled(study_id: int) -> None:
    with session_scope(get_sessionmaker()) as s:
        assert store.get_study(s, study_id).status is StudyStatus.cancelled
    assert {t.status for t in trials(study_id)} <= {TrialStatus.cancelled}
    unfinished = {PackStatus.pending, PackStatus.queued, PackStatus.running}
    assert not {p.status for p in packs(study_id)} & unfinished


def test_a_study_cancelled_after_the_tick_read_it_has_the_rest_cancelled(
    pg: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The tick still held the study as running when it cancelled the trials of cancelled
    studies: 'scheduler tick failed', Conflict: study N is cancelled; it cannot become
    cancelled (and nothing of the study was cancelled)."""
    study_id = new_study(ONE_TRIAL)
    sched = scheduler(SyncDispatcher(run=False))
    sched.tick()  # sampled, planned, its pack queued
    cancel_in(monkeypatch, store, "studies_with_status", study_id, after=True)
    with caplog.at_level(logging.INFO, logger="service.scheduler"):
        sched.tick()
    assert errors(caplog) == []
    assert_cancelled(study_id)
    assert trials(study_id) and packs(study_id)


def test_a_pending_study_cancelled_while_the_tick_samples_it_is_left_cancelled(
    pg: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """'study N could not advance this tick' with the traceback of Conflict: study N is
    cancelled; it cannot become running."""
    study_id = new_study(ONE_TRIAL)
    cancel_in(monkeypatch, store, "studies_with_status", study_id, after=True)
    with caplog.at_level(logging.INFO, logger="service.scheduler"):
        scheduler(SyncDispatcher(run=False)).tick()
    assert errors(caplog) == []
    assert_cancelled(study_id)


def test_a_study_cancelled_as_the_tick_completes_it_is_left_cancelled(
    pg: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """'study N could not advance this tick' with the traceback of Conflict: study N is
    cancelled; it cannot become completed. The cancel came first: the study stays
    cancelled, and its trial too."""
    study_id = new_study(ONE_TRIAL)
    sched = scheduler(SyncDispatcher())
    sched.tick()  # its one trial trained to its last rung
    assert {t.status for t in trials(study_id)} == {TrialStatus.paused}
    cancel_in(monkeypatch, lifecycle, "finish_if_done", study_id, after=False)
    with caplog.at_level(logging.INFO, logger="service.scheduler"):
        sched.tick()
    assert errors(caplog) == []
    assert_cancelled(study_id)
