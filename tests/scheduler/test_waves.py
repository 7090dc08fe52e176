"""Model-based sampling in the real scheduler: brackets start in waves, the configurations
do not depend on packing, timing or a restart, and budgets repeat or end the study.

Training is replaced by a known function of the config (``loss``), written as the workers
would write it, so that every study here runs in a fraction of a second per tick on
SQLite and PostgreSQL alike. With real processes, the same configurations come out packed
and unpacked (tests/e2e/test_pack_invariance.py) and on RQ workers through a killed
scheduler or worker (tests/faults/test_faults.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from bench.scheduler_scale import RecordingDispatcher
from packtune.rungs import rung_resource
from packtune.settings import Settings
from packtune.spec import StoredSpec, validate_spec
from service import store
from service.db import make_engine, session_factory, session_scope, upgrade
from service.lifecycle import ACTIVE
from service.models import Pack, PackMember, PackStatus, Study, StudyStatus, Trial, TrialStatus
from service.scheduler import Scheduler

Factory = sessionmaker[Session]

# R=9, eta=3: brackets s=2 (9 trials, rungs at 1, 3, 9), s=1 (5 at 3, 9), s=0 (3 at 9)
SPEC: dict[str, Any] = {
    "name": "waves",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {
        "lr": {"type": "loguniform", "low": 1e-4, "high": 1.0},
        "momentum": {"type": "uniform", "low": 0.0, "high": 0.95},
    },
    "hyperband": {"max_resource": 9, "min_resource": 1, "eta": 3},
    "seed": 5,
}


def loss(config: dict[str, Any], resource: float) -> float:
    """Best near lr = 0.01, momentum = 0.9; lower with more resource."""
    return (math.log10(config["lr"]) + 2) ** 2 + (config["momentum"] - 0.9) ** 2 + 1 / resource


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def factory(request: pytest.FixtureRequest) -> Iterator[Factory]:
    name = "sqlite_url" if request.param == "sqlite" else "fresh_postgres"
    url: str = request.getfixturevalue(name)
    upgrade(url)
    engine = make_engine(url)
    yield session_factory(engine)
    engine.dispose()


def train_queued(
    s: Session,
    limit: int | None = None,
    slow: Any = None,
    value: Any = None,
    profiled: bool = False,
) -> int:
    """What workers would do with up to ``limit`` queued packs: measure each member at its
    unit's end, pause it at its rung (pending again short of it); complete the pack. A pack
    holding a trial that ``slow(trial)`` says is slow is left queued (its worker is slow).
    ``value(trial, resource)``: the objective, instead of :func:`loss` of the config.
    ``profiled``: each fusion key's memory and throughput recorded first, as a worker's probe
    would (without, the planner plans the two shortest units of an unmeasured key a tick)."""
    packs = list(s.scalars(select(Pack).where(Pack.status == PackStatus.queued).order_by(Pack.id)))
    if profiled:
        queued = [p.id for p in packs]
        keys = s.scalars(select(PackMember.fusion_key).where(PackMember.pack_id.in_(queued)))
        for key in set(keys):
            if store.get_profile(s, "digits-mlp", key, "cpu") is None:
                store.set_memory_model(s, "digits-mlp", key, "cpu", 1000, 1000)
                for k in (1, 2, 4, 8, 16, 32):
                    store.record_throughput(s, "digits-mlp", key, "cpu", k, 100.0 * k)
    if slow is not None:
        packs = [
            pack for pack in packs
            if not any(slow(s.get(Trial, m.trial_id))
                       for m in s.scalars(select(PackMember).where(PackMember.pack_id == pack.id)))
        ]  # fmt: skip
    for pack in packs[:limit]:
        for member in s.scalars(select(PackMember).where(PackMember.pack_id == pack.id)):
            trial = s.get(Trial, member.trial_id)
            assert trial is not None
            spec = StoredSpec.of(trial.study.spec)
            r = member.to_resource
            got = loss(trial.config, r) if value is None else value(trial, r)
            store.record_measurement(s, trial.id, r, {"val_loss": got})
            at_rung = r >= rung_resource(spec, trial.bracket, trial.rung) - 1e-9
            status = TrialStatus.paused if at_rung else TrialStatus.pending
            s.execute(update(Trial).where(Trial.id == trial.id)
                      .values(status=status, resource_done=r))  # fmt: skip
        s.execute(update(Pack).where(Pack.id == pack.id).values(status=PackStatus.completed))
    return len(packs[:limit])


def new_scheduler(factory: Factory) -> Scheduler:
    settings = Settings(database_url="sqlite://", heartbeat_timeout=10**6)
    return Scheduler(settings, factory=factory, dispatcher=RecordingDispatcher(), holder="t")  # type: ignore[arg-type]


def run_study(
    factory: Factory,
    spec: dict[str, Any],
    *,
    packs_per_tick: int | None = None,
    restart_at: int | None = None,
    on_tick: Any = None,
    slow: Any = None,
    value: Any = None,
    workers: int = 1,
) -> int:
    """Create and drive a study to its end; returns its id. ``slow(tick, trial)``: the
    trial's packs wait at this tick (their worker is slow); ``value``: as train_queued's.
    More than one worker: the keys are profiled, so that every ready unit is planned."""
    spec = validate_spec(spec).model_dump(mode="json")  # as the API stores it
    with session_scope(factory) as s:
        study_id = store.create_study(
            s, name=spec["name"], workload=spec["workload"], spec=spec, seed=spec["seed"]
        ).id
        for w in range(workers):
            store.heartbeat(s, name=f"w{w or ''}", host="h", device_kind="cpu", gpus=[])
    scheduler = new_scheduler(factory)
    try:
        for tick in range(2000):
            if tick == restart_at:  # a scheduler killed and started again
                scheduler.close()
                scheduler = new_scheduler(factory)
            report = scheduler.tick()
            if on_tick is not None:
                on_tick(tick)
            with session_scope(factory) as s:
                late = None if slow is None else lambda trial, tick=tick: slow(tick, trial)
                train_queued(s, packs_per_tick, late, value, profiled=workers > 1)
            if study_id in report.finished_studies:
                return study_id
    finally:
        scheduler.close()
    raise AssertionError("the study did not finish in 2000 ticks")


def configs(factory: Factory, study_id: int) -> dict[int, tuple[int, int, dict[str, Any]]]:
    with session_scope(factory) as s:
        rows = s.execute(
            select(Trial.sample_index, Trial.iteration, Trial.bracket, Trial.config).where(
                Trial.study_id == study_id
            )
        )
        return {i: (it, b, dict(c)) for i, it, b, c in rows}


def study_row(factory: Factory, study_id: int) -> Study:
    with session_scope(factory) as s:
        study = store.get_study(s, study_id)
        s.expunge(study)
        return study


def test_brackets_start_in_waves_and_learn_from_the_settled_rungs(factory: Factory) -> None:
    """The first bracket is sampled in waves; the others at once, together, when its first
    rung is measured; the next iteration when every trial of the one before has started;
    the later draws favour the region the results point to."""
    spec = {**SPEC, "budget": {"max_iterations": 3}}
    seen: list[list[tuple[int, int]]] = []
    waiting = (TrialStatus.pending, TrialStatus.queued)

    def count_brackets(_: int) -> None:
        with session_scope(factory) as s:
            rows = s.execute(select(Trial.iteration, Trial.bracket, Trial.rung, Trial.status))
            rows = rows.all()
        now = sorted({(it, b) for it, b, _, _ in rows})
        for it in {it for it, _ in now} - {it for it, _ in (seen[-1] if seen else [])}:
            # an iteration starts once every trial of the one before has started training
            assert not [r for r in rows if r[0] == it - 1 and r[2] == 0 and r[3] in waiting]
        seen.append(now)

    study_id = run_study(factory, spec, on_tick=count_brackets)
    assert seen[0] == [(0, 2)]  # the first tick: part of bracket s=2 of iteration 0 alone
    assert [len(x) for x in seen] == sorted(len(x) for x in seen)  # one wave after another
    # the later brackets of an iteration start together, after its first bracket's waves
    assert [x for x in seen if (0, 1) in x][0][:3] == [(0, 0), (0, 1), (0, 2)]
    got = configs(factory, study_id)
    assert len(got) == 3 * 17
    assert [got[i][:2] for i in (0, 9, 14, 17, 34)] == [(0, 2), (0, 1), (0, 0), (1, 2), (2, 2)]
    study = study_row(factory, study_id)
    assert study.status == StudyStatus.completed and study.stop_reason is None
    # every bracket kept Hyperband's shape though drawn in waves: n_i trials reached rung i
    plan = StoredSpec.of(validate_spec(spec).model_dump(mode="json")).brackets
    with session_scope(factory) as s:
        rows = s.execute(select(Trial.iteration, Trial.bracket, Trial.rung)).all()
    for iteration in range(3):
        for j, rungs in enumerate(plan):
            bracket = len(plan) - 1 - j
            reached = [r for it, b, r in rows if (it, b) == (iteration, bracket)]
            assert [sum(r >= i for r in reached) for i in range(len(rungs))] == [
                rung.n for rung in rungs
            ], (iteration, bracket)
    # the later iterations, drawn from a model, sit nearer the optimum than the first
    first = [loss(c, 9) for i, (it, _, c) in got.items() if it == 0]
    last = [loss(c, 9) for i, (it, _, c) in got.items() if it == 2]
    assert sorted(last)[len(last) // 2] < sorted(first)[len(first) // 2]


def test_the_configs_do_not_depend_on_packing_timing_or_a_restart(factory: Factory) -> None:
    spec = {**SPEC, "budget": {"max_iterations": 2}}
    packed = configs(factory, run_study(factory, spec))
    one_by_one = {**spec, "packing": {"enabled": False}}
    slow = configs(factory, run_study(factory, one_by_one, packs_per_tick=1, restart_at=7))
    assert packed == slow
    assert len(packed) == 34


def test_random_sampling_starts_an_iterations_brackets_together(factory: Factory) -> None:
    spec = {**SPEC, "sampler": "random", "budget": {"max_iterations": 2}}
    firsts: list[int] = []

    def count(_: int) -> None:
        with session_scope(factory) as s:
            firsts.append(len(list(s.scalars(select(Trial.id)))))

    run_study(factory, spec, on_tick=count)
    assert firsts[0] == 17  # every bracket of the first iteration at once
    assert firsts[-1] == 34


def trained_units(factory: Factory, study_id: int) -> int:
    """Units of work the study's trials trained: each rung of its bracket a trial reached."""
    with session_scope(factory) as s:
        spec = StoredSpec.of(store.get_study(s, study_id).spec)
        trials = store.trials_of(s, study_id)
        return sum(
            sum(rung_resource(spec, t.bracket, i) <= t.resource_done + 1e-9
                for i in range(len(spec.brackets[len(spec.brackets) - 1 - t.bracket])))
            for t in trials
        )  # fmt: skip


def progress(factory: Factory, study_id: int | None = None) -> dict[str, int]:
    """The study's progress in its summary (default: the database's only study)."""
    from service.queries import study_summary

    with session_scope(factory) as s:
        if study_id is None:
            study_id = s.scalars(select(Study.id)).one()
        return dict(study_summary(s, study_id)["progress"])


def test_max_trials_stops_before_a_bracket_that_does_not_fit(factory: Factory) -> None:
    spec = {**SPEC, "budget": {"max_trials": 30}}  # 17, then 9 of iteration 1 (26); 5 more: 31
    seen: list[dict[str, int]] = []
    study_id = run_study(factory, spec, on_tick=lambda _: seen.append(progress(factory)))
    got = configs(factory, study_id)
    assert len(got) == 26
    assert {got[i][:2] for i in range(17, 26)} == {(1, 2)}
    # the bar's total is the units of the brackets that start: 22 + 13, not two whole
    # iterations' 44 (it stood at 35 of 44, then jumped to full)
    assert {p["total"] for p in seen} == {35}
    assert (
        progress(factory, study_id)
        == {"done": 35, "total": 35, "failed": 0}
        == {"done": trained_units(factory, study_id), "total": 35, "failed": 0}
    )


def test_a_target_reached_ends_the_study_with_its_best_trial(factory: Factory) -> None:
    # reached by some trial at max_resource within the first iterations
    spec = {**SPEC, "budget": {"target": 0.6}}
    study_id = run_study(factory, spec)
    study = study_row(factory, study_id)
    assert (study.status, study.stop_reason) == (StudyStatus.completed, "target")
    # the units trained, not the plan's (which the study stopped short of)
    done = trained_units(factory, study_id)
    assert progress(factory, study_id) == {"done": done, "total": done, "failed": 0}
    with session_scope(factory) as s:
        best = store.get_trial(s, study.best_trial_id or 0)
        assert loss(best.config, 9) <= 0.6
        left = store.count_trials_by_status(s, study_id)
        assert left[TrialStatus.pending] == left[TrialStatus.queued] == 0
        assert not s.scalars(
            select(Pack.id).where(store.of_study(study_id), Pack.status == PackStatus.queued)
        ).all()


def test_max_seconds_ends_the_study(factory: Factory) -> None:
    spec = {**SPEC, "budget": {"max_seconds": 3600}}

    def an_hour_later(tick: int) -> None:
        if tick == 3:
            with session_scope(factory) as s:
                study = s.scalars(select(Study)).one()
                assert study.started_at is not None
                study.started_at -= timedelta(hours=1)

    seen: list[int] = []

    def tick(n: int) -> None:
        an_hour_later(n)
        seen.append(progress(factory)["done"])

    study_id = run_study(factory, spec, on_tick=tick)
    study = study_row(factory, study_id)
    assert study.stop_reason == "max_seconds"
    assert study.status in (StudyStatus.completed, StudyStatus.failed)
    with session_scope(factory) as s:
        counts = store.count_trials_by_status(s, study_id)
    assert counts[TrialStatus.cancelled] > 0
    # the units its trials trained, those stopped by the budget (cancelled) too: the bar
    # went backwards at the stop (17 -> 12 in a real run)
    final = progress(factory, study_id)
    assert final["done"] == trained_units(factory, study_id) >= max(seen)


# -- ASHA ---------------------------------------------------------------------------------


def test_asha_promotions_do_not_depend_on_which_worker_is_slow(factory: Factory) -> None:
    """Rung 1 read in sample-index order: a trial promoted into it late (a slow worker held
    back the rung-0 results before its promotion) came before results already decided on,
    and the same spec and seed promoted other trials to the top rung. Read in the order
    of promotion, every timing promotes the same trials."""
    spec = {**SPEC, "scheduler": "asha", "sampler": "random", "packing": {"enabled": False}}
    # by sample index: rung 0 promotes 2, 5, 8, 3, 12 in that order (the best of the first
    # 3, 6, 9, 12, 15); at rung 1, 3 is the best, then 8; at 9 epochs, 8 beats 3
    rung0 = [50, 51, 10, 14, 52, 11, 53, 54, 12, 55, 56, 57, 13, 58, 59, 60, 61]
    rung1 = {3: 1.0, 12: 6.0, 8: 3.0, 2: 4.0, 5: 5.0}

    def value(trial: Trial, resource: float) -> float:
        if resource <= 1:
            return float(rung0[trial.sample_index])
        if resource <= 3:
            return rung1.get(trial.sample_index, 100.0)
        return 0.5 if trial.sample_index == 8 else float(trial.sample_index)

    runs = []
    for held in (range(0), range(3, 9), range(9, 17)):

        def slow(tick: int, trial: Trial, held: range = held) -> bool:
            return tick < 8 and trial.rung == 0 and trial.sample_index in held

        study_id = run_study(factory, spec, slow=slow, value=value, workers=20)
        with session_scope(factory) as s:
            index = dict(s.execute(select(Trial.id, Trial.sample_index)).all())
            promoted = sorted((p.rung, index[p.trial_id]) for p in store.promotions_of(s, study_id))
        runs.append((promoted, study_row(factory, study_id).best_trial_id and index[
            study_row(factory, study_id).best_trial_id]))  # fmt: skip
    assert runs[0][0] and any(r >= 1 for r, _ in runs[0][0]), runs[0]
    assert runs[1] == runs[0] and runs[2] == runs[0], runs


def test_asha_promotes_as_results_come_and_ends_deterministically(factory: Factory) -> None:
    """scheduler: asha: 17 trials (one Hyperband iteration's worth) climb bracket s=2's
    ladder (1, 3, 9); a rung's results promote as they arrive, in sample-index order, so a
    promotion happens before the rung is full, the study completes with a trial at
    max_resource, and packing or a restart changes nothing."""
    spec = {**SPEC, "scheduler": "asha", "budget": {"max_iterations": 2}}
    early: list[bool] = []

    def promoted_before_full(_: int) -> None:
        with session_scope(factory) as s:
            rows = s.execute(select(Trial.rung, Trial.status)).all()
        at_rung0_training = any(r == 0 and st in ACTIVE for r, st in rows)
        early.append(at_rung0_training and any(r >= 1 for r, _ in rows))

    packed = run_study(factory, spec, on_tick=promoted_before_full)
    got = configs(factory, packed)
    assert len(got) == 34 and {(it, b) for it, b, _ in got.values()} == {(0, 2), (1, 2)}
    study = study_row(factory, packed)
    assert study.status == StudyStatus.completed and study.best_trial_id is not None
    with session_scope(factory) as s:
        rows = s.execute(
            select(Trial.sample_index, Trial.rung, Trial.status).where(Trial.study_id == packed)
        ).all()
        promoted = [(p.rung, p.trial_id) for p in store.promotions_of(s, packed)]
        # one ladder for both iterations' trials; each promotion names its trial's iteration
        own = dict(s.execute(select(Trial.id, Trial.iteration)).all())
        said = [(p.iteration, own[p.trial_id]) for p in store.promotions_of(s, packed)]
    assert {i for i, _ in said} == {0, 1} and all(a == b for a, b in said), said
    assert any(early), "no promotion happened while rung 0 was still training"
    reached = [sum(r >= i for _, r, _ in rows) for i in range(3)]
    assert reached[0] == 34 and reached[1] >= 34 // 3 and reached[2] >= 34 // 9 >= 1
    assert {st for _, r, st in rows if r == 2} <= {TrialStatus.completed}
    assert {st for _, r, st in rows if r < 2} <= {TrialStatus.stopped}
    # the same promotions unpacked, one pack per tick, with a restart half way
    slow = run_study(factory, {**spec, "packing": {"enabled": False}}, packs_per_tick=1,
                     restart_at=9)  # fmt: skip
    assert configs(factory, slow) == got
    with session_scope(factory) as s:
        index = dict(s.execute(select(Trial.id, Trial.sample_index)).all())
        again = [(p.rung, p.trial_id) for p in store.promotions_of(s, slow)]
    assert sorted((r, index[t]) for r, t in again) == sorted((r, index[t]) for r, t in promoted)


def test_the_brackets_view_shows_an_asha_batch_cut_by_max_trials_at_its_size(
    factory: Factory,
) -> None:
    """max_trials 20 of ASHA batches of 17: the second batch holds 3 trials; the view
    planned it as a whole batch (17, 5, 1)."""
    from service.queries import brackets

    spec = {**SPEC, "scheduler": "asha", "sampler": "random", "budget": {"max_trials": 20}}
    study_id = run_study(factory, spec)
    with session_scope(factory) as s:
        shown = brackets(s, study_id)
    sizes = [(b["iteration"], [r["n"] for r in b["rungs"]]) for b in shown]
    assert sizes == [(0, [17, 5, 1]), (1, [3, 1, 0])], sizes
    assert [len(b["rungs"][0]["trials"]) for b in shown] == [17, 3]
