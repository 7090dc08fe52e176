"""Rung decisions and planning read and write in bulk, with the same results on both databases.

The store's bulk helpers (:class:`~service.store.TrialBrief` rows, ``move_trials``,
``id_in``, many-row inserts, which go through ``unnest()`` arrays on PostgreSQL)
across SQLite's chunk size, and a whole study driven by the real scheduler whose
promotions and best trial must equal what ``hyperband.promote`` decides from the
same measurements.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from bench.scheduler_scale import RecordingDispatcher
from packtune.hyperband import promote
from packtune.rungs import rung_resource
from packtune.settings import Settings
from packtune.space import fusion_key
from packtune.spec import StoredSpec
from packtune.workloads import get_workload
from service import lifecycle, planning, store
from service import scheduler as scheduler_module
from service.db import make_engine, session_factory, session_scope, upgrade
from service.models import (
    Pack,
    PackMember,
    PackStatus,
    RungPromotion,
    StudyStatus,
    Trial,
    TrialStatus,
)
from service.scheduler import Scheduler

Factory = sessionmaker[Session]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest) -> str:
    name = "sqlite_url" if request.param == "sqlite" else "fresh_postgres"
    database: str = request.getfixturevalue(name)
    upgrade(database)
    return database


@pytest.fixture
def factory(url: str) -> Iterator[Factory]:
    engine = make_engine(url)
    yield session_factory(engine)
    engine.dispose()


# -- the store's bulk helpers --------------------------------------------------------------

N = store.UPDATE_CHUNK + 50  # SQLite's updates go in two chunks


def test_bulk_helpers_past_sqlite_chunk(factory: Factory) -> None:
    rows = [
        {"sample_index": i, "bracket": i % 3, "config": {"lr": i / N, "tag": f"é{i}"},
         "fusion_key": f"key-{i % 2}"}
        for i in range(N)
    ]  # fmt: skip
    with session_scope(factory) as s:
        study_id = store.create_study(s, name="bulk", workload="digits-mlp", spec={}, seed=0).id
        assert store.add_trials(s, study_id, rows) == N
        assert store.add_trials(s, study_id, rows[-10:] + [{**rows[0], "sample_index": N}]) == 1
    with session_scope(factory) as s:
        ids = list(s.scalars(select(Trial.id).order_by(Trial.sample_index)))
        assert ids == sorted(ids) and len(ids) == N + 1
        config = s.scalar(select(Trial.config).where(Trial.sample_index == 7))
        assert config == {"lr": 7 / N, "tag": "é7"}
        # pending -> queued -> running -> paused, each move in bulk past the SQLite chunk
        for to in (TrialStatus.queued, TrialStatus.running, TrialStatus.paused):
            assert store.move_trials(s, ids[1:], to) == N
        store.set_trials(s, ids[1:], rung=1)
        assert store.move_trials(s, ids[:1], TrialStatus.failed, error="e") == 1
        assert store.move_trials(s, [], TrialStatus.cancelled) == 0  # nothing to do
        assert store.move_trials(s, ids[:1], TrialStatus.completed) == 0  # failed is final
    with session_scope(factory) as s:
        counts = store.count_trials_by_status(s, study_id)
        assert counts[TrialStatus.paused] == N and counts[TrialStatus.failed] == 1
        assert counts[TrialStatus.cancelled] == 0
        summary = store.brackets_summary(s, study_id)
        # (iteration, s), in order of each bracket's first trial
        assert list(summary) == [(0, 0), (0, 1), (0, 2)]
        assert sum(summary[(0, 0)].values()) == len(range(0, N + 1, 3))
        assert summary[(0, 0)][TrialStatus.failed] == 1 and summary[(0, 1)][TrialStatus.failed] == 0
        briefs = store.trial_briefs(s, study_id, bracket=1, status=TrialStatus.paused)
        assert [b.id for b in briefs] == ids[1::3]
        assert {(b.rung, b.status, b.resource_done) for b in briefs} == {
            (1, TrialStatus.paused, 0.0)
        }
        assert briefs[0].fusion_key == "key-1"
        some = ids[5 : store.UPDATE_CHUNK + 20 : 2]
        found = s.scalars(select(Trial.id).where(store.id_in(s, Trial.id, some)))
        assert sorted(found) == some
        assert s.scalar(select(func.count()).where(store.id_in(s, Trial.id, []))) == 0

        items = [(tid, None if tid % 7 == 0 else tid / 3) for tid in ids]
        assert store.record_promotions(s, study_id, 1, 0, items) == N + 1
        assert store.record_promotions(s, study_id, 1, 0, items[:5]) == 0
        values = dict(s.execute(select(RungPromotion.trial_id, RungPromotion.value)).all())
        assert values == dict(items)

        members = [(tid, "key-0", 1.0, 3.0) for tid in ids[:300]]
        pack = store.create_pack(s, study_id=study_id, members=members, device="d")
        assert (
            sorted((m.trial_id, m.fusion_key, m.from_resource, m.to_resource) for m in pack.members)
            == members
        )
        assert s.scalar(select(func.count()).select_from(PackMember)) == 300


# -- a whole study -------------------------------------------------------------------------

MAX_RESOURCE = 27
SPEC: dict[str, Any] = {
    "name": "bulk-study",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {
        "lr": {"type": "loguniform", "low": 0.001, "high": 0.5},
        "hidden": {"type": "choice", "values": [64, 128]},
    },
    "hyperband": {"max_resource": MAX_RESOURCE, "min_resource": 1, "eta": 3},
    "packing": {"enabled": True, "max_pack_size": None},
    # every bracket sampled at once: this file is about bulk decisions, not samplers
    "sampler": "random",
    "seed": 0,
}
KIND = "test GPU"


def loss(sample_index: int, resource: float) -> float:
    """A fixed objective per (trial, resource): no ties, and the ranking changes with resource."""
    return ((sample_index * 7919 + int(resource) * 104729) % 1009) / 1009 + 1 / resource


def diverges(sample_index: int) -> bool:
    return sample_index % 11 == 4


def fleet(s: Session) -> None:
    gpus = [{"index": g, "name": KIND, "memory_total": 8 * 10**9, "memory_free": 8 * 10**9}
            for g in range(2)]  # fmt: skip
    store.heartbeat(s, name="w", host="h", device_kind=KIND, gpus=gpus)
    wl = get_workload("digits-mlp")
    for hidden in (64, 128):
        key = fusion_key(wl.name, wl.resolve({"hidden": hidden}), wl.structural_params())
        store.set_memory_model(s, wl.name, key, KIND, 2**28, 2**24)
        for k in (1, 2, 4, 8, 16):
            store.record_throughput(s, wl.name, key, KIND, k, 100.0 * k**0.7)


def finish_queued_packs(s: Session) -> int:
    """What the workers would do: measure each member at its to-resource, pause it at its
    rung (pending again after a segment short of it), or mark it diverged; complete the pack."""
    packs = list(s.scalars(select(Pack.id).where(Pack.status == PackStatus.queued)))
    index = {i: j for i, j in s.execute(select(Trial.id, Trial.sample_index))}
    place = {i: (b, r) for i, b, r in s.execute(select(Trial.id, Trial.bracket, Trial.rung))}
    for member in s.scalars(select(PackMember).where(PackMember.pack_id.in_(packs))):
        i, r = index[member.trial_id], member.to_resource
        store.record_measurement(s, member.trial_id, r, {"val_loss": math.nan if diverges(i)
                                                         else loss(i, r)})  # fmt: skip
        at_rung = r >= rung_resource(StoredSpec.of(SPEC), *place[member.trial_id])
        status = (
            TrialStatus.diverged
            if diverges(i)
            else TrialStatus.paused
            if at_rung
            else TrialStatus.pending
        )
        s.execute(update(Trial).where(Trial.id == member.trial_id)
                  .values(status=status, resource_done=r))  # fmt: skip
    s.execute(update(Pack).where(Pack.id.in_(packs)).values(status=PackStatus.completed))
    return len(packs)


def expected(brackets: dict[int, list[int]]) -> tuple[list[tuple[int, int, int]], int]:
    """(bracket, rung, sample index) of every promotion, and the best sample index, from
    ``promote`` over the same losses."""
    plan = StoredSpec.of(SPEC).brackets
    out, finals = [], []
    for bracket, members in sorted(brackets.items()):
        rungs = plan[len(plan) - 1 - bracket]
        alive = members
        for rung in range(bracket + 1):
            resource = rungs[rung].resource
            values = [(i, None if diverges(i) else loss(i, resource)) for i in alive]
            if rung == bracket:
                finals += [v for v in values if v[1] is not None]
                break
            chosen = promote(values, 3, "min")
            out += [(bracket, rung, i) for i in sorted(chosen)]
            alive = [i for i in alive if i in chosen and not diverges(i)]
    best = min(finals, key=lambda v: (v[1], v[0]))[0]
    return out, best


@pytest.mark.parametrize("bounded", [False, True], ids=["one-tick-each", "bounded-ticks"])
def test_study_decisions_equal_promote_over_the_measurements(
    url: str, factory: Factory, bounded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With small per-tick budgets too (sampling 10 trials, planning 8 units, deciding 5
    trials per tick), so that a study is sampled, planned and decided over many ticks."""
    if bounded:
        monkeypatch.setattr(lifecycle, "SAMPLE_CHUNK", 10)
        monkeypatch.setattr(scheduler_module, "TICK_SAMPLES", 10)
        monkeypatch.setattr(planning, "MAX_UNITS_PER_PLAN", 8)
        monkeypatch.setattr(scheduler_module, "PLAN_NEXT_TICK", 5)
    planned: list[int] = []
    real_plan = planning.plan_packs

    def plan_packs(units: Any, *args: Any, **kwargs: Any) -> Any:
        units = list(units)
        planned.append(len(units))
        return real_plan(units, *args, **kwargs)

    monkeypatch.setattr(planning, "plan_packs", plan_packs)
    with session_scope(factory) as s:
        fleet(s)
        study_id = store.create_study(
            s, name=SPEC["name"], workload=SPEC["workload"], spec=SPEC, seed=0
        ).id
    settings = Settings(database_url=url, heartbeat_timeout=10**6)
    scheduler = Scheduler(settings, factory=factory, dispatcher=RecordingDispatcher(), holder="t")  # type: ignore[arg-type]
    sampled = []
    try:
        for _ in range(200):
            report = scheduler.tick()
            with session_scope(factory) as s:
                sampled.append(sum(store.count_trials_by_status(s, study_id).values()))
                finish_queued_packs(s)
            if report.finished_studies:
                break
    finally:
        scheduler.close()
    if bounded:
        # at most 10 a tick, in chunks cut from each bracket's start (27, 12, 6, 4 trials)
        assert sampled[:6] == [10, 20, 27, 37, 45, 49]
        assert max(planned) <= 8
    else:
        assert sampled[0] == 49
    with session_scope(factory) as s:
        study = store.get_study(s, study_id)
        assert study.status == StudyStatus.completed
        index = {i: j for i, j in s.execute(select(Trial.id, Trial.sample_index))}
        brackets: dict[int, list[int]] = {}
        for i, b in s.execute(select(Trial.sample_index, Trial.bracket).order_by(Trial.id)):
            brackets.setdefault(b, []).append(i)
        got = [(p.bracket, p.rung, index[p.trial_id]) for p in store.promotions_of(s, study_id)]
        statuses = Counter(s.scalars(select(Trial.status)))
        assert study.best_trial_id is not None
        best = index[study.best_trial_id]
    want, want_best = expected(brackets)
    assert sum(len(v) for v in brackets.values()) == 49
    assert sorted(got) == want and len(want) > 10
    assert best == want_best
    assert statuses[TrialStatus.diverged] > 0 and statuses[TrialStatus.completed] > 0
    assert set(statuses) <= {TrialStatus.completed, TrialStatus.stopped, TrialStatus.diverged}


def studies_to_sample(
    factory: Factory,
    url: str,
    monkeypatch: pytest.MonkeyPatch,
    n: int,
    *,
    chunk: int,
    per_tick: int,
) -> tuple[list[int], Scheduler]:
    """``n`` new studies of SPEC and a scheduler that draws chunks of ``chunk`` trials and
    samples ``per_tick`` trials a tick."""
    monkeypatch.setattr(lifecycle, "SAMPLE_CHUNK", chunk)
    monkeypatch.setattr(scheduler_module, "TICK_SAMPLES", per_tick)
    with session_scope(factory) as s:
        fleet(s)
        ids = [
            store.create_study(s, name=f"bulk-{i}", workload="digits-mlp", spec=SPEC, seed=0).id
            for i in range(n)
        ]
    settings = Settings(database_url=url, heartbeat_timeout=10**6)
    scheduler = Scheduler(settings, factory=factory, dispatcher=RecordingDispatcher(), holder="t")  # type: ignore[arg-type]
    return ids, scheduler


def test_a_tick_samples_a_bounded_number_of_trials_over_all_studies(
    factory: Factory, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty studies sampled in one tick would make that tick twenty times as long: a tick's
    studies share one budget of TICK_SAMPLES trials, and the next ticks go on at once."""
    ids, scheduler = studies_to_sample(factory, url, monkeypatch, 3, chunk=10, per_tick=10)
    total = 3 * sum(bracket[0].n for bracket in StoredSpec.of(SPEC).brackets)
    counts = []
    try:
        for _ in range(200):
            report = scheduler.tick()
            with session_scope(factory) as s:
                counts.append(sum(sum(store.count_trials_by_status(s, i).values()) for i in ids))
            assert counts[-1] - (counts[-2] if len(counts) > 1 else 0) == report.sampled <= 10
            if counts[-1] == total:
                break
            assert report.deferred, "a tick that left trials to sample says so"
    finally:
        scheduler.close()
    assert counts[-1] == total and len(counts) >= total // 10


def test_a_chunk_above_the_tick_budget_is_drawn_whole_by_a_tick_that_drew_nothing_yet(
    factory: Factory, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk is drawn as one batch (a model's draws must not depend on the ticks), so a tick
    budget (TICK_SAMPLES) below the chunk size would never draw it: the tick's first draw
    takes one whole chunk above the budget, and nothing is drawn after it in that tick."""
    ids, scheduler = studies_to_sample(factory, url, monkeypatch, 2, chunk=20, per_tick=8)
    per_tick = []
    try:
        for _ in range(12):
            per_tick.append(scheduler.tick().sampled)
    finally:
        scheduler.close()
    # brackets of 27 (chunks of 20 and 7), 12, 6 and 4 trials; the first study first
    assert per_tick[:11] == [20, 7, 12, 6, 4, 20, 7, 12, 6, 4, 0]
    with session_scope(factory) as s:
        assert [sum(store.count_trials_by_status(s, i).values()) for i in ids] == [49, 49]
