"""The store's contract, run against SQLite and PostgreSQL alike.

Every test gets an empty, migrated database: a fresh SQLite file, or a private
PostgreSQL schema (created once per session, truncated between tests) so these
tests never touch tables other test modules use.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

from packtune.errors import Conflict, NotFound, StoreUnavailable
from service import store
from service.db import (
    dispose_engines,
    get_engine,
    get_sessionmaker,
    make_engine,
    normalise_url,
    session_factory,
    session_scope,
    upgrade,
)
from service.models import (
    Base,
    Lease,
    Measurement,
    Pack,
    PackMember,
    PackStatus,
    RungPromotion,
    Study,
    StudyStatus,
    Trial,
    TrialStatus,
    Worker,
    WorkerStatus,
    utcnow,
)

PG_SCHEMA = "packtune_test_store"
T = TypeVar("T")
Factory = sessionmaker[Session]


def schema_url(base: str, schema: str) -> URL:
    """``base`` with every connection's search_path set to ``schema``."""
    return make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})


@pytest.fixture(scope="session")
def pg_factory(postgres_url: str) -> Iterator[Factory]:
    admin = make_engine(postgres_url)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {PG_SCHEMA} CASCADE")
        conn.exec_driver_sql(f"CREATE SCHEMA {PG_SCHEMA}")
    url = schema_url(postgres_url, PG_SCHEMA)
    upgrade(url)
    engine = make_engine(url)
    yield session_factory(engine)
    engine.dispose()
    with admin.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {PG_SCHEMA} CASCADE")
    admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def factory(request: pytest.FixtureRequest) -> Factory:
    if request.param == "sqlite":
        url = request.getfixturevalue("sqlite_url")
        upgrade(url)
        engine = make_engine(url)
        request.addfinalizer(engine.dispose)
        return session_factory(engine)
    pg: Factory = request.getfixturevalue("pg_factory")
    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with pg.begin() as s:
        s.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    return pg


def race(factory: Factory, n: int, work: Callable[[Session, int], T]) -> list[T]:
    """Run ``work(session, i)`` in ``n`` threads released together, each in its own session."""
    barrier = threading.Barrier(n)

    def one(i: int) -> T:
        barrier.wait()
        with session_scope(factory) as s:
            return work(s, i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def new_study(s: Session, name: str = "s") -> Study:
    return store.create_study(s, name=name, workload="digits-mlp", spec={"k": 1}, seed=7)


def trial_rows(indexes: range, *, bracket: int = 0, tag: str = "a") -> list[dict[str, Any]]:
    config = {"lr": 0.1, "tag": tag}
    return [
        {"sample_index": i, "bracket": bracket, "config": config, "fusion_key": "f"}
        for i in indexes
    ]


def study_with_trials(factory: Factory, n: int = 3) -> tuple[int, list[int]]:
    with session_scope(factory) as s:
        study = new_study(s)
        store.add_trials(s, study.id, trial_rows(range(n)))
        return study.id, [t.id for t in store.trials_of(s, study.id)]


# -- studies ------------------------------------------------------------------


def test_studies_create_get_list(factory: Factory) -> None:
    with session_scope(factory) as s:
        ids = [new_study(s, f"s{i}").id for i in range(3)]
    with session_scope(factory) as s:
        page, total = store.list_studies(s, limit=2)
        assert total == 3
        assert [st.id for st in page] == [ids[2], ids[1]]  # newest first
        rest, _ = store.list_studies(s, limit=2, offset=2)
        assert [st.id for st in rest] == [ids[0]]
        study = store.get_study(s, ids[0])
        assert (study.name, study.spec, study.seed) == ("s0", {"k": 1}, 7)
        assert study.status is StudyStatus.pending
        assert study.created_at.tzinfo is not None
        assert study.created_at.utcoffset() == timedelta(0)
        assert abs(utcnow() - study.created_at) < timedelta(minutes=1)
        with pytest.raises(NotFound):
            store.get_study(s, 9999)


def test_study_status_times(factory: Factory) -> None:
    with session_scope(factory) as s:
        study = new_study(s)
        store.move_study(s, study, StudyStatus.running)
        started = study.started_at
        assert started is not None and study.finished_at is None
        with pytest.raises(Conflict):  # running is not a move from running
            store.move_study(s, study, StudyStatus.running)
        assert study.started_at == started
        store.move_study(s, study, StudyStatus.failed, error="boom")
        with pytest.raises(Conflict):  # finished studies are not modified
            store.move_study(s, study, StudyStatus.cancelled)
        study_id = study.id
    with session_scope(factory) as s:
        study = store.get_study(s, study_id)
        assert study.status is StudyStatus.failed and study.error == "boom"
        assert study.started_at == started
        assert study.finished_at is not None and study.finished_at >= started


def test_delete_study_cascades(factory: Factory) -> None:
    study_id, trial_ids = study_with_trials(factory)
    keep_id, keep_trials = study_with_trials(factory)
    with session_scope(factory) as s:
        study = store.get_study(s, study_id)
        study.best_trial_id = trial_ids[0]
        store.record_measurement(s, trial_ids[0], 1, {"val_loss": 0.5})
        store.record_promotions(s, study_id, 0, 0, [(trial_ids[0], 0.5)])
        parent = store.create_pack(s, study_id=study_id, members=[(trial_ids[0], "f", 0, 1)])
        store.create_pack(
            s, study_id=study_id, members=[(trial_ids[1], "f", 0, 1)], parent_id=parent.id
        )
        store.create_pack(s, study_id=keep_id, members=[(keep_trials[0], "f", 0, 1)])
    with session_scope(factory) as s:
        store.delete_study(s, study_id)
    with session_scope(factory) as s:
        with pytest.raises(NotFound):
            store.get_study(s, study_id)
        assert s.scalar(select(func.count()).select_from(Trial)) == len(keep_trials)
        for model in (Measurement, RungPromotion):
            assert s.scalar(select(func.count()).select_from(model)) == 0
        assert s.scalar(select(func.count()).select_from(Pack)) == 1
        assert s.scalar(select(func.count()).select_from(PackMember)) == 1
        with pytest.raises(NotFound):
            store.delete_study(s, study_id)


def test_deleting_best_trial_clears_it(factory: Factory) -> None:
    study_id, trial_ids = study_with_trials(factory)
    with session_scope(factory) as s:
        store.get_study(s, study_id).best_trial_id = trial_ids[1]
    with session_scope(factory) as s:
        s.delete(store.get_trial(s, trial_ids[1]))
    with session_scope(factory) as s:
        assert store.get_study(s, study_id).best_trial_id is None


def test_promotions_of_several_rungs_and_brackets_in_one_insert(factory: Factory) -> None:
    study_id, (a, b, c) = study_with_trials(factory)
    P = store.Promotion
    with session_scope(factory) as s:
        records = [P(b, 0.2, 0, 2, 0), P(a, None, 0, 1, 0), P(c, 0.1, 1, 2, 1)]
        assert store.record_promotions_of(s, study_id, records) == 3
        assert (
            store.record_promotions_of(s, study_id, [P(b, 0.9, 0, 2, 0), P(b, 0.4, 0, 2, 1)]) == 1
        )
        assert store.record_promotions_of(s, study_id, []) == 0
    with session_scope(factory) as s:
        rows = store.promotions_of(s, study_id)
        assert [(p.trial_id, p.value, p.iteration, p.bracket, p.rung) for p in rows] == [
            (a, None, 0, 1, 0), (b, 0.2, 0, 2, 0), (b, 0.4, 0, 2, 1), (c, 0.1, 1, 2, 1),
        ]  # fmt: skip


def test_bracket_briefs_reads_exactly_the_brackets_asked_for(factory: Factory) -> None:
    with session_scope(factory) as s:
        study_id = new_study(s).id
        rows = [
            {**row, "iteration": iteration, "sample_index": 10 * iteration + row["sample_index"]}
            for iteration in (0, 1)
            for bracket in (0, 1, 2)
            for row in trial_rows(range(3 * bracket, 3 * bracket + 2), bracket=bracket)
        ]
        assert store.add_trials(s, study_id, rows) == 12
        other = new_study(s, "other").id
        store.add_trials(s, other, trial_rows(range(2), bracket=1))
    with session_scope(factory) as s:
        # (0, 2) and (1, 1): not their cross product, (0, 1) and (1, 2)
        got = store.bracket_briefs(s, study_id, [(0, 2), (1, 1)])
        assert list(got) == [(0, 2), (1, 1)]
        assert [t.sample_index for t in got[0, 2]] == [6, 7]
        assert [t.sample_index for t in got[1, 1]] == [13, 14]
        assert all(isinstance(t, store.TrialBrief) for t in got[0, 2] + got[1, 1])
        assert got[0, 2] == [t for t in store.trial_briefs(s, study_id, iteration=0, bracket=2)]
        assert store.bracket_briefs(s, study_id, [(2, 0)]) == {(2, 0): []}
        assert store.bracket_briefs(s, study_id, []) == {}


def test_studies_briefs_reads_the_studies_and_statuses_asked_for(factory: Factory) -> None:
    with session_scope(factory) as s:
        ids = [new_study(s, name).id for name in ("a", "b", "c")]
        for study_id in ids:
            assert store.add_trials(s, study_id, trial_rows(range(4))) == 4
        a_trials = store.trials_of(s, ids[0])
        assert store.move_trials(s, [a_trials[1].id, a_trials[2].id], TrialStatus.queued) == 2
        assert store.move_trials(s, [a_trials[2].id], TrialStatus.running) == 1
    with session_scope(factory) as s:
        got = store.studies_briefs(s, [ids[1], ids[0]], [TrialStatus.pending])
        assert list(got) == [ids[1], ids[0]]  # the third study is not read
        assert [t.sample_index for t in got[ids[0]]] == [0, 3]
        assert got[ids[1]] == store.trial_briefs(s, ids[1], status=TrialStatus.pending)
        both = store.studies_briefs(s, ids[:1], [TrialStatus.pending, TrialStatus.queued])
        assert [(t.sample_index, t.status) for t in both[ids[0]]] == [
            (0, TrialStatus.pending), (1, TrialStatus.queued), (3, TrialStatus.pending),
        ]  # fmt: skip
        assert store.studies_briefs(s, [], [TrialStatus.pending]) == {}


def test_trial_briefs_of_checkpointed_trials_only(factory: Factory) -> None:
    """What a study's end prunes: its stopped trials that still have a checkpoint."""
    with session_scope(factory) as s:
        study_id = new_study(s).id
        store.add_trials(s, study_id, trial_rows(range(4)))
        trials = store.trials_of(s, study_id)
        for t, path in zip(trials, ["a.pt", None, "", "d.pt"], strict=True):
            t.checkpoint_path = path
    with session_scope(factory) as s:
        got = store.trial_briefs(s, study_id, checkpointed=True)
        assert [t.sample_index for t in got] == [0, 3]
        store.forget_checkpoints(s, [got[0].id])
    with session_scope(factory) as s:
        assert [t.sample_index for t in store.trial_briefs(s, study_id, checkpointed=True)] == [3]
        assert len(store.trial_briefs(s, study_id)) == 4


# -- trials -------------------------------------------------------------------


def test_add_trials_is_idempotent(factory: Factory) -> None:
    with session_scope(factory) as s:
        study_id = new_study(s).id
        assert store.add_trials(s, study_id, trial_rows(range(3))) == 3
    with session_scope(factory) as s:
        # Two sample indexes again (with other values) and one new.
        assert store.add_trials(s, study_id, trial_rows(range(1, 4), tag="b")) == 1
        assert store.add_trials(s, study_id, []) == 0
    with session_scope(factory) as s:
        trials = store.trials_of(s, study_id)
        assert [t.sample_index for t in trials] == [0, 1, 2, 3]
        assert [t.config["tag"] for t in trials] == ["a", "a", "a", "b"]
        first = trials[0]
        assert (first.rung, first.status, first.resource_done) == (0, TrialStatus.pending, 0.0)
        assert store.get_trial(s, first.id).study_id == study_id
        with pytest.raises(NotFound):
            store.get_trial(s, 9999)


def test_trials_filters_and_counts(factory: Factory) -> None:
    with session_scope(factory) as s:
        study_id = new_study(s).id
        other_id = new_study(s, "other").id
        store.add_trials(s, study_id, trial_rows(range(4), bracket=1))
        store.add_trials(s, study_id, trial_rows(range(4, 6), bracket=0))
        store.add_trials(s, other_id, trial_rows(range(2)))
        trials = store.trials_of(s, study_id)
        trials[0].status = TrialStatus.running
        trials[1].status = TrialStatus.paused
        trials[1].rung = 1
        s.flush()
        assert len(store.trials_of(s, study_id, bracket=1)) == 4
        assert [t.id for t in store.trials_of(s, study_id, rung=1)] == [trials[1].id]
        running = store.trials_of(s, study_id, status=TrialStatus.running)
        assert [t.id for t in running] == [trials[0].id]
        either = store.trials_of(s, study_id, status=[TrialStatus.running, TrialStatus.paused])
        assert len(either) == 2
        assert (
            store.trials_of(s, study_id, status=TrialStatus.pending, bracket=0, rung=0)
            == (trials[4:])
        )
        counts = store.count_trials_by_status(s, study_id)
        assert counts[TrialStatus.pending] == 4 and counts[TrialStatus.running] == 1
        assert counts[TrialStatus.failed] == 0 and set(counts) == set(TrialStatus)
        assert store.count_trials_by_status(s)[TrialStatus.pending] == 6


# -- measurements -------------------------------------------------------------


def test_measurement_upsert_updates_not_duplicates(factory: Factory) -> None:
    _, (trial_id, other, _) = study_with_trials(factory)
    with session_scope(factory) as s:
        assert store.latest_measurement(s, trial_id) is None
        store.record_measurement(s, trial_id, 1, {"val_loss": 0.9})
        assert store.measurements_of(s, trial_id)[0].metrics == {"val_loss": 0.9}
        store.record_measurement(s, trial_id, 1.0, {"val_loss": 0.8})
        store.record_measurement(s, trial_id, 3, {"val_loss": 0.5})
        store.record_measurement(s, other, 1, {"val_loss": 0.1})
        # Read back in the same session: the upsert is visible, not the stale object.
        rows = store.measurements_of(s, trial_id)
        assert [(m.resource, m.metrics["val_loss"]) for m in rows] == [(1.0, 0.8), (3.0, 0.5)]
    with session_scope(factory) as s:
        store.record_measurement(s, trial_id, 3, {"val_loss": 0.4, "acc": 0.7})
    with session_scope(factory) as s:
        latest = store.latest_measurement(s, trial_id)
        assert latest is not None
        assert (latest.resource, latest.metrics) == (3.0, {"val_loss": 0.4, "acc": 0.7})
        count = select(func.count()).select_from(Measurement)
        assert s.scalar(count.where(Measurement.trial_id == trial_id)) == 2


def test_non_finite_metrics_read_back_as_null(factory: Factory) -> None:
    _, (trial_id, *_) = study_with_trials(factory)
    with session_scope(factory) as s:
        store.record_measurement(s, trial_id, 1, {"val_loss": math.nan, "loss": [1.0, math.inf]})
    with session_scope(factory) as s:
        latest = store.latest_measurement(s, trial_id)
        assert latest is not None and latest.metrics == {"val_loss": None, "loss": [1.0, None]}


# -- promotions ---------------------------------------------------------------


def test_promotions_are_idempotent(factory: Factory) -> None:
    study_id, (a, b, c) = study_with_trials(factory)
    with session_scope(factory) as s:
        assert store.record_promotions(s, study_id, 2, 0, [(a, 0.5), (b, None)]) == 2
    with session_scope(factory) as s:
        assert store.record_promotions(s, study_id, 2, 0, [(a, 0.9), (c, 0.7)]) == 1
        assert store.record_promotions(s, study_id, 2, 1, [(a, 0.3)]) == 1
        assert store.record_promotions(s, study_id, 2, 1, []) == 0
    with session_scope(factory) as s:
        rows = store.promotions_of(s, study_id)
        assert [(p.trial_id, p.rung, p.value) for p in rows] == [
            (a, 0, 0.5),
            (b, 0, None),
            (c, 0, 0.7),
            (a, 1, 0.3),
        ]
        assert {p.bracket for p in rows} == {2}


# -- packs --------------------------------------------------------------------


def test_pack_life_cycle(factory: Factory) -> None:
    study_id, (a, b, _) = study_with_trials(factory)
    with session_scope(factory) as s:
        pack = store.create_pack(
            s, study_id=study_id, members=[(b, "f", 0, 1), (a, "f", 0, 1)], estimated_bytes=10
        )
        pack_id = pack.id
        assert pack.status is PackStatus.pending and pack.attempts == 0
        with pytest.raises(ValueError):
            store.create_pack(s, study_id=study_id, members=[])
    with session_scope(factory) as s:
        pack = store.get_pack(s, pack_id)
        assert [(m.trial_id, m.from_resource, m.to_resource) for m in pack.members] == [
            (a, 0.0, 1.0),
            (b, 0.0, 1.0),
        ]
        assert store.queue_pack(s, pack_id, job_id="job-1")
        assert not store.queue_pack(s, pack_id, job_id="job-2")
        [queued] = store.packs_of(s, study_id, status=PackStatus.queued)
        assert queued.job_id == "job-1" and queued.enqueued_at is not None
        assert store.packs_of(s, study_id, status=PackStatus.pending) == []
        with pytest.raises(NotFound):
            store.get_pack(s, 9999)
    with session_scope(factory) as s:
        claimed = store.claim_pack(s, pack_id, worker_name="w1", device="w1/cuda:0")
        assert claimed is not None
        assert (claimed.status, claimed.worker_name, claimed.attempts) == (
            PackStatus.running,
            "w1",
            0,  # attempts are counted by the scheduler when it dispatches
        )
        with pytest.raises(ValueError):
            store.finish_pack(s, claimed, PackStatus.running)
        assert store.finish_pack(s, claimed, PackStatus.completed, peak_bytes=99, train_seconds=1.5)
        assert not store.finish_pack(s, claimed, PackStatus.failed)  # closed already
    with session_scope(factory) as s:
        done = store.get_pack(s, pack_id)
        assert (done.status, done.peak_bytes, done.train_seconds) == (
            PackStatus.completed,
            99,
            1.5,
        )
        assert done.started_at is not None and done.finished_at is not None
        assert store.claim_pack(s, pack_id, worker_name="w2", device="cpu") is None
        multi = store.packs_of(s, study_id, status=[PackStatus.completed, PackStatus.failed])
        assert [p.id for p in multi] == [pack_id]


def test_packs_added_together_keep_their_order_and_members(factory: Factory) -> None:
    """A plan's packs in one call (what a scheduler tick writes): ids in the order given,
    each with its own members, and dispatch order's view of them: each member's trial's
    place, one query for every pack."""
    study_id, (a, b, c) = study_with_trials(factory)
    with session_scope(factory) as s:
        store.set_trials(s, [c], bracket=2, rung=1)
        first, second = store.add_packs(s, [
            store.NewPack(study_id, [(b, "f", 0, 1), (a, "f", 0, 1, -1, 1)], device="d0",
                          estimated_bytes=10),
            store.NewPack(study_id, [(c, "g", 3, 9, 0)]),
        ])  # fmt: skip
        assert first < second
        with pytest.raises(ValueError, match="at least one member"):
            store.add_packs(s, [store.NewPack(study_id, [])])
        assert store.add_packs(s, []) == []
    with session_scope(factory) as s:
        one, two = store.get_pack(s, first), store.get_pack(s, second)
        assert (one.status, one.device, one.estimated_bytes, one.attempts) == (
            PackStatus.pending, "d0", 10, 0,
        )  # fmt: skip
        assert [(m.trial_id, m.segment, m.array_no) for m in one.members] == [
            (a, -1, 1), (b, -1, 0),
        ]  # fmt: skip
        assert [(m.trial_id, m.fusion_key, m.to_resource, m.segment) for m in two.members] == [
            (c, "g", 9.0, 0),
        ]
        places = store.member_places(s, [second, first, 9999])
        assert places[first] == [
            store.MemberPlace(a, 0.0, study_id, 0, 0), store.MemberPlace(b, 0.0, study_id, 0, 0),
        ]  # fmt: skip
        assert places[second] == [store.MemberPlace(c, 3.0, study_id, 2, 1)]
        assert places[9999] == [] and store.member_places(s, []) == {}


def test_a_yield_is_asked_of_running_packs_once_and_releases_what_had_not_begun(
    factory: Factory,
) -> None:
    study_id, (a, b, c) = study_with_trials(factory)
    with session_scope(factory) as s:
        running = store.create_pack(s, study_id=study_id, members=[(a, "f", 0, 3), (b, "f", 0, 3)])
        waiting = store.create_pack(s, study_id=study_id, members=[(c, "f", 0, 1)])
        ids = (running.id, waiting.id)
        store.move_trials(s, [a, b, c], TrialStatus.queued)
    with session_scope(factory) as s:
        assert store.claim_pack(s, ids[0], worker_name="w1", device="cpu") is not None
        store.move_trials(s, [a, b], TrialStatus.running)
    with session_scope(factory) as s:
        assert store.request_yield(s, ids) == [ids[0]]  # only a running pack is asked
        assert store.request_yield(s, ids) == []  # and only once
        assert store.yield_requested(s, ids[0]) and not store.yield_requested(s, ids[1])
    with session_scope(factory) as s:  # a trained on to epoch 1.5; b's array had not begun
        store.move_trials(s, [a], TrialStatus.pending, resource_done=1.5)
        assert store.release_members(s, store.get_pack(s, ids[0])) == [b]
        statuses = {t.id: (t.status, t.resource_done) for t in store.trials_by_id(s, [a, b])}
        assert statuses == {a: (TrialStatus.pending, 1.5), b: (TrialStatus.pending, 0.0)}


def test_claim_pack_only_once_across_sessions(factory: Factory) -> None:
    study_id, (a, *_) = study_with_trials(factory)
    with session_scope(factory) as s:
        pack_id = store.create_pack(s, study_id=study_id, members=[(a, "f", 0, 1)]).id
    with session_scope(factory) as first:
        assert store.claim_pack(first, pack_id, worker_name="w1", device="cpu") is not None
    with session_scope(factory) as second:
        assert store.claim_pack(second, pack_id, worker_name="w2", device="cpu") is None
        assert store.get_pack(second, pack_id).worker_name == "w1"


def test_claim_pack_race_has_one_winner(factory: Factory) -> None:
    study_id, (a, *_) = study_with_trials(factory)
    with session_scope(factory) as s:
        pack_id = store.create_pack(s, study_id=study_id, members=[(a, "f", 0, 1)]).id

    def claim(s: Session, i: int) -> str | None:
        pack = store.claim_pack(s, pack_id, worker_name=f"w{i}", device="cpu")
        return None if pack is None else pack.worker_name

    winners = [w for w in race(factory, 4, claim) if w is not None]
    assert len(winners) == 1
    with session_scope(factory) as s:
        pack = store.get_pack(s, pack_id)
        assert (pack.worker_name, pack.attempts) == (winners[0], 0)


# -- workers ------------------------------------------------------------------


def age_heartbeat(factory: Factory, name: str, seconds: float) -> None:
    with session_scope(factory) as s:
        stmt = update(Worker).where(Worker.name == name)
        s.execute(stmt.values(last_heartbeat=utcnow() - timedelta(seconds=seconds)))


@pytest.mark.postgres
def test_a_session_idle_inside_a_transaction_is_ended_by_the_server_past_the_limit(
    postgres_url: str,
) -> None:
    """A worker's engine (``idle_transaction_limit``: its heartbeat timeout) has the server end
    a session left inside a transaction, its locks with it: the row it locked is free again
    for another session. An engine without the limit keeps the server's default."""
    import time

    limited = make_engine(postgres_url, idle_transaction_limit=0.5)
    plain = make_engine(postgres_url)
    try:
        with plain.connect() as conn:
            assert conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar() == "0"
            conn.execute(text("CREATE TEMP TABLE t (x int)"))
            time.sleep(1.0)  # idle inside a transaction: kept
            conn.execute(text("SELECT 1"))
        with limited.connect() as conn:
            setting = conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar()
            assert setting == "500ms"
        # what the ended session's owner sees: the store unavailable (a worker's writes retry)
        with pytest.raises(StoreUnavailable, match="idle-in-transaction"):
            with session_scope(session_factory(limited)) as s:
                s.execute(text("SELECT pg_advisory_xact_lock(4242)"))  # held to the commit
                time.sleep(1.5)
                s.execute(text("SELECT 1"))
        with plain.connect() as other:  # the ended session's lock went with it
            assert other.execute(text("SELECT pg_try_advisory_xact_lock(4242)")).scalar()
        # the settings take heartbeat timeouts up to 10^9 s; PostgreSQL up to 2^31 - 1 ms
        longest = make_engine(postgres_url, idle_transaction_limit=1e9)
        try:
            with longest.connect() as conn:
                setting = conn.execute(text("SHOW idle_in_transaction_session_timeout"))
                assert setting.scalar() == "2147483647ms"
        finally:
            longest.dispose()
    finally:
        limited.dispose()
        plain.dispose()


def test_heartbeat_upserts_by_name(factory: Factory) -> None:
    gpu = {"name": "H100", "free": 10}
    with session_scope(factory) as s:
        w = store.heartbeat(s, name="w1", host="h", device_kind="cpu", gpus=[], memory_budget=5)
        started, first_beat = w.started_at, w.last_heartbeat
    with session_scope(factory) as s:
        w = store.heartbeat(
            s, name="w1", host="h2", device_kind="H100", gpus=[gpu], status=WorkerStatus.busy
        )
        assert (w.host, w.device_kind, w.gpus, w.status) == ("h2", "H100", [gpu], "busy")
        assert w.memory_budget is None
        assert w.started_at == started and w.last_heartbeat >= first_beat
        assert s.scalar(select(func.count()).select_from(Worker)) == 1


def test_liveness_and_dead_workers(factory: Factory) -> None:
    with session_scope(factory) as s:
        for name in ("w1", "w2"):
            store.heartbeat(s, name=name, host="h", device_kind="cpu", gpus=[])
    age_heartbeat(factory, "w2", 120)
    with session_scope(factory) as s:
        assert [w.name for w in store.live_workers(s, 30)] == ["w1"]
        assert [w.name for w in store.live_workers(s, 600)] == ["w1", "w2"]
        assert store.mark_dead_workers(s, 30) == ["w2"]
    with session_scope(factory) as s:
        assert store.mark_dead_workers(s, 30) == []
        dead = s.scalars(select(Worker).where(Worker.name == "w2")).one()
        assert dead.status is WorkerStatus.dead
        old_start = dead.started_at
    with session_scope(factory) as s:
        back = store.heartbeat(s, name="w2", host="h", device_kind="cpu", gpus=[])
        assert back.status is WorkerStatus.idle and back.started_at > old_start
        assert [w.name for w in store.live_workers(s, 30)] == ["w1", "w2"]


# -- profiles -----------------------------------------------------------------


def test_profile_get_or_create_and_throughput(factory: Factory) -> None:
    key = ("digits-mlp", "digits-mlp|hidden=64", "cpu")
    with session_scope(factory) as s:
        assert store.get_profile(s, *key) is None
        assert store.record_throughput(s, *key, 1, 100.0) == 100.0
    with session_scope(factory) as s:
        assert store.record_throughput(s, *key, 1, 200.0) == 150.0  # moving average
        store.record_throughput(s, *key, 4, 300.0)
        store.set_memory_model(s, *key, 1000, 250)
    with session_scope(factory) as s:
        store.set_memory_model(s, *key, 1200, 260)
        assert store.get_profile(s, "digits-mlp", "other", "cpu") is None
    with session_scope(factory) as s:
        profile = store.get_profile(s, *key)
        assert profile is not None
        assert profile.throughput == {"1": 150.0, "4": 300.0}
        assert (profile.base_bytes, profile.per_trial_bytes) == (1200, 260)
        with pytest.raises(ValueError):
            store.record_throughput(s, *key, 0, 1.0)
        with pytest.raises(ValueError):
            store.record_throughput(s, *key, 2, math.nan)


def test_readings_of_arrays_at_once_have_a_curve_of_their_own(factory: Factory) -> None:
    key = ("digits-mlp", "digits-mlp|hidden=64", "cpu")
    with session_scope(factory) as s:
        assert store.measured_curve(store.get_profile(s, *key)) == ({}, {})
        store.record_throughput(s, *key, 8, 100.0)
        assert store.record_throughput(s, *key, 8, 300.0, concurrent=True) == 300.0
    with session_scope(factory) as s:
        assert store.record_throughput(s, *key, 8, 500.0, concurrent=True) == 400.0  # averaged
        store.record_throughput(s, *key, 1, 40.0, concurrent=True)
    with session_scope(factory) as s:
        profile = store.get_profile(s, *key)
        assert profile is not None
        assert profile.throughput == {"8": 100.0}
        assert profile.concurrent == {"8": 400.0, "1": 40.0}
        assert store.measured_curve(profile) == ({8: 100.0}, {8: 400.0, 1: 40.0})


def test_concurrent_throughput_updates_are_not_lost(factory: Factory) -> None:
    key = ("digits-mlp", "f", "cpu")

    def record(s: Session, i: int) -> float:
        return store.record_throughput(s, *key, i + 1, 10.0 * (i + 1))

    race(factory, 4, record)
    with session_scope(factory) as s:
        profile = store.get_profile(s, *key)
        assert profile is not None
        assert profile.throughput == {"1": 10.0, "2": 20.0, "3": 30.0, "4": 40.0}


# -- leases -------------------------------------------------------------------


def test_lease_exclusive_renewable_and_expiring(factory: Factory) -> None:
    with session_scope(factory) as s:
        assert store.acquire_lease(s, "scheduler", "a", 60)
    with session_scope(factory) as s:
        assert not store.acquire_lease(s, "scheduler", "b", 60)
        assert store.acquire_lease(s, "other", "b", 60)
    with session_scope(factory) as s:
        assert store.acquire_lease(s, "scheduler", "a", 60)
        assert not store.release_lease(s, "scheduler", "b")
    with session_scope(factory) as s:  # a stops renewing
        past = utcnow() - timedelta(seconds=1)
        s.execute(update(Lease).where(Lease.name == "scheduler").values(expires_at=past))
    with session_scope(factory) as s:
        assert store.acquire_lease(s, "scheduler", "b", 60)
    with session_scope(factory) as s:
        assert not store.acquire_lease(s, "scheduler", "a", 60)
        lease = s.get(Lease, "scheduler")
        assert lease is not None and lease.holder == "b"
        assert lease.expires_at.tzinfo is not None and lease.expires_at > utcnow()
        assert store.release_lease(s, "scheduler", "b")
    with session_scope(factory) as s:
        assert store.acquire_lease(s, "scheduler", "a", 60)


def test_lease_race_has_one_winner(factory: Factory) -> None:
    results = race(factory, 4, lambda s, i: store.acquire_lease(s, "scheduler", f"h{i}", 60))
    assert results.count(True) == 1


# -- sessions and engines -----------------------------------------------------


def test_session_scope_rolls_back_on_error(factory: Factory) -> None:
    with pytest.raises(RuntimeError), session_scope(factory) as s:
        new_study(s)
        raise RuntimeError("abandon")
    with session_scope(factory) as s:
        assert store.list_studies(s) == ([], 0)


def test_unreachable_database_is_store_unavailable(tmp_path: Any) -> None:
    urls = [
        f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}",
        "postgresql://postgres@127.0.0.1:1/test?connect_timeout=2",
    ]
    for url in urls:
        engine = make_engine(url)
        with pytest.raises(StoreUnavailable), session_scope(session_factory(engine)) as s:
            store.list_studies(s)
        engine.dispose()


def test_default_engine_follows_settings(clean_env: pytest.MonkeyPatch, sqlite_url: str) -> None:
    clean_env.setenv("PACKTUNE_DATABASE_URL", sqlite_url)
    upgrade()
    try:
        with session_scope() as s:
            new_study(s, "default")
        assert get_engine() is get_engine() and get_sessionmaker() is get_sessionmaker()
        assert str(get_engine().url) == sqlite_url
        with session_scope(session_factory(make_engine(sqlite_url))) as s:
            assert [st.name for st in store.list_studies(s)[0]] == ["default"]
    finally:
        dispose_engines()


def test_engine_settings() -> None:
    assert normalise_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert normalise_url("postgresql+psycopg://u@h/db").drivername == "postgresql+psycopg"
    engine = make_engine("sqlite://")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()


def test_sqlite_file_uses_wal(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    engine.dispose()


def test_timestamps_are_utc(factory: Factory) -> None:
    with session_scope(factory) as s:
        w = store.heartbeat(s, name="w", host="h", device_kind="cpu", gpus=[])
        assert w.last_heartbeat.tzinfo is not None
    with session_scope(factory) as s:
        beat = s.scalars(select(Worker.last_heartbeat)).one()
        assert beat.utcoffset() == timedelta(0) and beat.tzinfo is not None
        assert beat.astimezone(UTC) <= utcnow()


# -- status transitions ---------------------------------------------------------------------


def test_final_statuses_never_move() -> None:
    """Finished trials, packs and studies are not modified (no move leads out of them)."""
    tables = ((store.TRIAL_FROM, TrialStatus), (store.PACK_FROM, PackStatus),
              (store.STUDY_FROM, StudyStatus))  # fmt: skip
    for table, enum in tables:
        sources = set().union(*table.values())
        final = {status for status in enum if status not in sources}
        assert final, enum
        for status in final:
            assert all(status not in froms for froms in table.values()), status
    assert {TrialStatus.completed, TrialStatus.stopped, TrialStatus.failed,
            TrialStatus.diverged, TrialStatus.cancelled} <= {
        st for st in TrialStatus if st not in set().union(*store.TRIAL_FROM.values())
    }  # fmt: skip
    assert store.FINISHED_PACK == {
        st for st in PackStatus if st not in set().union(*store.PACK_FROM.values())
    }


def test_moves_touch_only_trials_that_may_make_them(factory: Factory) -> None:
    """A worker's late write does not revive a trial cancelled meanwhile, and a guard can be
    narrowed by the caller."""
    with session_scope(factory) as s:
        study = new_study(s)
        store.add_trials(s, study.id, trial_rows(range(4)))
        ids = [t.id for t in store.trials_of(s, study.id)]
        assert store.move_trials(s, ids, TrialStatus.queued) == 4
        assert store.move_trials(s, ids, TrialStatus.running) == 4
        assert store.move_trials(s, ids[:1], TrialStatus.cancelled) == 1
        # the unit ends: only running trials pause; the cancelled one stays cancelled
        assert store.move_trials(s, ids, TrialStatus.paused, resource_done=1.0) == 3
        assert store.move_trials(s, ids[1:2], TrialStatus.failed) == 0  # paused cannot fail
        assert store.move_trials(s, ids, TrialStatus.pending, only_from=[TrialStatus.running]) == 0
        assert store.move_trials(s, ids[1:2], TrialStatus.pending, rung=1) == 1  # promoted
        study_id = study.id
    with session_scope(factory) as s:
        got = {t.id: (t.status, t.resource_done, t.rung) for t in store.trials_of(s, study_id)}
    assert got == {
        ids[0]: (TrialStatus.cancelled, 0.0, 0),
        ids[1]: (TrialStatus.pending, 1.0, 1),
        ids[2]: (TrialStatus.paused, 1.0, 0),
        ids[3]: (TrialStatus.paused, 1.0, 0),
    }


def test_a_finished_pack_is_not_finished_again(factory: Factory) -> None:
    with session_scope(factory) as s:
        study = new_study(s)
        store.add_trials(s, study.id, trial_rows(range(1)))
        trial = store.trials_of(s, study.id)[0]
        pack = store.create_pack(s, study_id=study.id, members=[(trial.id, "f", 0.0, 1.0)])
        assert not store.finish_pack(s, pack, PackStatus.completed)  # never claimed
        assert store.claim_pack(s, pack.id, worker_name="w", device="w/cpu") is not None
        assert store.finish_pack(s, pack, PackStatus.split, error="oom")
        assert not store.move_pack(s, pack, PackStatus.pending)  # a late retry: refused
        assert not store.claim_pack(s, pack.id, worker_name="w2", device="w2/cpu")
        assert (pack.status, pack.error) == (PackStatus.split, "oom")


def test_only_the_transitions_module_writes_a_status() -> None:
    """One owner for every status change: no other module assigns or updates ``status``."""
    root = Path(__file__).resolve().parents[2]
    owner = root / "service" / "store" / "transitions.py"
    assigned = re.compile(r"\.status\s*=(?!=)|\.values\([^)]*\bstatus\s*=")
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for folder in ("packtune", "service", "worker")
        for path in (root / folder).rglob("*.py")
        if path != owner
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if assigned.search(line) and "Worker" not in line and "worker" not in line.split("=")[0]
    ]
    assert not offenders, offenders


def test_a_deleted_studys_ids_are_not_given_again(factory: Factory) -> None:
    """The newest study, deleted: the next study, trial and pack get new ids. Before, SQLite
    gave them the deleted ones' (a script or a dashboard tab holding the id then acted on
    an unrelated study)."""
    study_with_trials(factory)
    gone, gone_trials = study_with_trials(factory)
    with session_scope(factory) as s:
        gone_pack = store.create_pack(s, study_id=gone, members=[(gone_trials[0], "f", 0, 1)]).id
    with session_scope(factory) as s:
        store.delete_study(s, gone)
    new, new_trials = study_with_trials(factory)
    with session_scope(factory) as s:
        new_pack = store.create_pack(s, study_id=new, members=[(new_trials[0], "f", 0, 1)]).id
    assert new > gone and min(new_trials) > max(gone_trials) and new_pack > gone_pack
