"""Decoupled segments as units of work (issue 19 §2, ``training.units: segment``): each
segment of a trial's span is planned, fused and run on its own, and the trial is finished
by whichever of its segments ends last. The study's results are those of the same study
whose trials train their segments together (``units: trial``), at every rung."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from packtune.spec import validate_spec
from service import queries
from service.api.schemas import PackPublic
from service.db import make_engine, session_factory, session_scope
from service.models import Pack, PackMember, Worker
from tests.e2e.test_decoupled_study import SPEC, run_study
from tests.faults.test_faults import STUDY_TIMEOUT, cluster, database, redis_server, start_all
from tests.support.cluster import (
    Outcome,
    Services,
    assert_same_outcome,
    outcome,
    submit,
    wait_for,
    wait_study,
)

__all__ = ["cluster", "database", "redis_server"]  # fixtures, used by name

RUNGS = (1.0, 3.0, 9.0)


def _spec(units: str) -> dict[str, Any]:
    return {**SPEC, "sampler": {"name": "random"},
            "training": {"mode": "decoupled", "segments": 2, "units": units}}  # fmt: skip


def test_segment_units_give_the_results_of_segments_trained_together(tmp_path: Path) -> None:
    got, packs = run_study(tmp_path / "segments", _spec("segment"))
    want, _ = run_study(tmp_path / "trials", _spec("trial"))
    assert got.status == want.status == "completed"
    members = [m for p in packs for m in p]
    assert {segment for _, segment in members} == {0, 1}  # every member one segment
    trials = {t for t, _ in members}
    # every trial's every span was two units, and an array fused a segment of several trials
    assert all(sum(t == trial for t, _ in members) % 2 == 0 for trial in trials)
    assert any(sum(seg == 0 for _, seg in p) > 1 for p in packs)
    compared = 0
    for trial, curve in want.curves.items():
        theirs = got.curves[trial]
        # segment units record a point per rung (no per-epoch evaluation of one segment)
        assert set(theirs) <= set(RUNGS) and set(theirs) == {r for r in RUNGS if r in curve}
        for resource, value in theirs.items():
            assert value is not None and math.isfinite(value)
            assert math.isclose(value, curve[resource], rel_tol=1e-4, abs_tol=1e-6), (
                trial, resource, value, curve[resource])  # fmt: skip
            compared += 1
    assert compared >= len(want.curves)
    assert got.best == want.best


def test_a_model_larger_than_the_device_trains_as_segment_units(tmp_path: Path) -> None:
    """A decoupled model whose whole does not fit the device (a 5 MB CPU budget), whose
    segments do: with segment units the study completes, every array planned and probed as
    a segment; trained as whole trials it cannot (decoupled training does not spill)."""
    from packtune.tuning import HEADROOM
    from packtune.workloads import get_workload
    from worker.memory import probe

    budget = 5_000_000
    space = {**SPEC["space"], "hidden": {"type": "choice", "values": [256]},
             "layers": {"type": "choice", "values": [5]}}  # fmt: skip
    spec = {**_spec("segment"), "space": space,
            "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3}}  # fmt: skip
    config = {"hidden": 256, "layers": 5, "optimizer": "adam"}
    training = validate_spec(spec).training
    whole = probe(get_workload("digits-mlp"), config, training=training)
    assert whole.bytes_for(1) > budget * HEADROOM  # the model does not fit whole
    got, packs = run_study(tmp_path / "segments", spec, cpu_memory_budget=budget)
    assert got.status == "completed" and got.best is not None
    assert {segment for p in packs for _, segment in p} == {0, 1}
    failed, _ = run_study(tmp_path / "trials", {**spec, "training": {**spec["training"],
                          "units": "trial"}}, exit_code=1, cpu_memory_budget=budget)  # fmt: skip
    errors = {t["error"] for t in failed.trials.values()}
    assert failed.status == "failed" and all("do not combine" in str(e) for e in errors), errors


# -- on RQ: two workers, a trial's segments on both at once; a worker killed mid-segment --

RQ_SPEC: dict[str, Any] = {
    **_spec("segment"),
    "name": "segments-rq",
    # wider, so that a 6-epoch segment unit lasts long enough to be caught running
    "space": {**SPEC["space"], "hidden": {"type": "choice", "values": [256]}},
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """The same study embedded (``packtune run``: one device, a pack at a time)."""
    tmp = tmp_path_factory.mktemp("segments-reference")
    return run_study(tmp / "run", RQ_SPEC)[0]


def segment_packs(engine: sa.Engine) -> list[tuple[int, str, str, int, int, float]]:
    """(pack, status, worker, trial, segment, from_resource) of every segment member."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(Pack.id, Pack.status, Pack.worker_name, PackMember.trial_id,
                      PackMember.segment, PackMember.from_resource)
            .join(PackMember, PackMember.pack_id == Pack.id)
            .where(PackMember.segment >= 0)
        )  # fmt: skip
        return [(int(p), str(getattr(st, "value", st)), str(w), int(t), int(seg), float(a))
                for p, st, w, t, seg, a in rows]  # fmt: skip


@pytest.mark.slow
def test_on_two_workers_a_trials_segments_train_on_both(
    cluster: Services, database: str, reference: Outcome
) -> None:
    """On RQ with two workers the scheduler spreads a span's segments over both devices;
    the study ends as it does embedded, on one device."""
    start_all(cluster)
    engine = make_engine(database)
    try:
        # both devices known before the first plan, which then spreads the segments
        count = sa.select(sa.func.count()).select_from(Worker)

        def both() -> bool:
            with engine.connect() as conn:
                return conn.execute(count).scalar_one() == 2

        wait_for(both, 60, "two workers")
        study_id = submit(engine, RQ_SPEC)
        assert wait_study(engine, study_id, STUDY_TIMEOUT, cluster) == "completed"
        rows = segment_packs(engine)
        with session_scope(session_factory(engine)) as s:  # as GET .../packs serves them
            public = [PackPublic.model_validate(row) for row in queries.packs(s, study_id)[0]]
            profiles = queries.profiles(s, study_id)
    finally:
        engine.dispose()
    # each segment probed on its own, under its own key: the first smaller than the whole
    probed = {p["fusion_key"].rsplit("|", 1)[-1]: p for p in profiles if p["per_trial_bytes"]}
    assert {"segment 0 of 2", "segment 1 of 2"} <= set(probed), list(probed)
    assert all(m.segment in (0, 1) for p in public for m in p.members)
    assert {a.segment for p in public for a in p.arrays or []} == {0, 1}
    where: dict[tuple[int, float], set[str]] = {}
    packs: dict[tuple[int, float], set[int]] = {}
    for pack, _, worker, trial, _, start in rows:
        where.setdefault((trial, start), set()).add(worker)
        packs.setdefault((trial, start), set()).add(pack)
    spread = [span for span, workers in where.items() if len(workers) == 2]
    assert spread, where
    engine = make_engine(database)
    try:
        with engine.connect() as conn:
            times = {int(i): (a, b) for i, a, b in conn.execute(
                sa.select(Pack.id, Pack.started_at, Pack.finished_at))}  # fmt: skip
    finally:
        engine.dispose()
    at_once = sum(
        max(times[p][0] for p in packs[span]) < min(times[p][1] for p in packs[span])
        for span in spread
    )
    print(f"{len(spread)} of {len(where)} spans on both workers, {at_once} of them at once")
    assert at_once > 0
    print(f"largest difference: {assert_same_outcome(outcome(database, study_id), reference):.3g}")


@pytest.mark.slow
def test_a_worker_killed_mid_segment(cluster: Services, database: str, reference: Outcome) -> None:
    """kill -9 of a worker training a segment unit of resumed trials: the scheduler re-queues
    that unit alone, the other worker trains it, and the trials are finished once (by
    whichever of their units ends last) with the values of the undisturbed study."""
    start_all(cluster)
    engine = make_engine(database)
    try:
        study_id = submit(engine, RQ_SPEC)

        def running() -> tuple[int, str] | None:
            for pack, status, worker, _, _, start in segment_packs(engine):
                if status == "running" and start > 0:
                    return pack, worker
            return None

        pack_id, victim = wait_for(running, 90, "a running segment unit", every=0.05)
        cluster.kill(victim)
        assert wait_study(engine, study_id, STUDY_TIMEOUT, cluster) == "completed"
    finally:
        engine.dispose()
    got = outcome(database, study_id)
    print(f"largest difference: {assert_same_outcome(got, reference):.3g}")
    pack = next(p for p in got.packs if p.id == pack_id)
    assert (pack.status, pack.attempts) == ("completed", 2), pack
    assert pack.error is not None and f"worker {victim} stopped sending heartbeats" in pack.error


def _failed_with(tmp: Path, spec: dict[str, Any], words: str, **settings: Any) -> None:
    failed, _ = run_study(tmp, spec, exit_code=1, **settings)
    errors = {str(t["error"]) for t in failed.trials.values() if t["error"]}
    assert failed.status == "failed" and errors and all(words in e for e in errors), errors


def test_a_model_that_draws_random_numbers_is_refused_as_segment_units(tmp_path: Path) -> None:
    """With dropout, a segment unit started from the trial's random state at the span's
    start, where units: trial draws segment 1's masks after segment 0's: every metric
    differed from units: trial's (which the README says segment units give)."""
    space = {**SPEC["space"], "dropout": {"type": "choice", "values": [0.1]}}
    spec = {**_spec("segment"), "space": space,
            "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3}}  # fmt: skip
    _failed_with(tmp_path / "dropout", spec, "draws random numbers (dropout): a segment unit")


def test_a_segment_larger_than_the_device_is_refused_as_a_trial_unit_is(tmp_path: Path) -> None:
    """Each segment over the budget trained in device memory (planned as spilled, run as
    not), where units: trial refuses: decoupled training does not spill."""
    space = {**SPEC["space"], "hidden": {"type": "choice", "values": [128]},
             "layers": {"type": "choice", "values": [5]}}  # fmt: skip
    spec = {**_spec("segment"), "space": space,
            "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3}}  # fmt: skip
    _failed_with(tmp_path / "big", spec, "needs more memory than the device has",
                 cpu_memory_budget=600_000)  # fmt: skip
