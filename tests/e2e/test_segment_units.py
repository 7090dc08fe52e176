"""Decoupled segments as units of work (issue 19 §2, ``training.units: segment``): each
segment of a trial's span is planned, fused and run on its own, and the trial is finished
by whichever of its segments ends last. The study's results are those of the same study
whose trials train their segments together (``units: trial``), at every rung."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from service.db import make_engine, session_factory, session_scope
from service.models import Pack
from tests.e2e.test_decoupled_study import SPEC
from tests.support.cluster import Services, outcome
from tests.support.processes import packtune_env

RUNGS = (1.0, 3.0, 9.0)


def _spec(units: str) -> dict[str, Any]:
    return {**SPEC, "sampler": {"name": "random"},
            "training": {"mode": "decoupled", "segments": 2, "units": units}}  # fmt: skip


def run_study(tmp: Path, spec: dict[str, Any]) -> tuple[Any, list[list[tuple[int, int]]]]:
    """The study's outcome, and each pack's (trial, segment) members."""
    import json

    tmp.mkdir()
    (tmp / "spec.json").write_text(json.dumps(spec))
    url = f"sqlite:///{tmp / 'packtune.db'}"
    env = packtune_env(database_url=url, checkpoint_dir=tmp / "ckpt", torch_threads=1)
    Services(env, tmp / "run.log").run("run", str(tmp / "spec.json"))
    engine = make_engine(url)
    try:
        with session_scope(session_factory(engine)) as s:
            packs = [sorted((m.trial_id, m.segment) for m in p.members)
                     for p in s.scalars(sa.select(Pack).order_by(Pack.id))]  # fmt: skip
    finally:
        engine.dispose()
    return outcome(url, 1), packs


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
