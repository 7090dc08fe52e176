"""A study whose trials train decoupled (issue 19 §2): from the spec through ``packtune
run`` (SQLite, packs trained by the embedded runner's child process) to a best trial; its
trials learn (the same study end to end is the yardstick) and its packs fuse them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from packtune.errors import SpecError
from packtune.spec import TrainingSettings, validate_spec
from packtune.workloads import get_workload
from service.db import make_engine, session_factory, session_scope
from service.models import Pack
from tests.support.cluster import outcome
from tests.support.processes import packtune_env, start
from worker.check import check
from worker.fused import FusedArray

SPEC: dict[str, Any] = {
    "name": "decoupled",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {
        "lr": {"type": "loguniform", "low": 0.003, "high": 0.03},
        "optimizer": {"type": "choice", "values": ["adam"]},
        "hidden": {"type": "choice", "values": [64]},
        "layers": {"type": "choice", "values": [3]},
    },
    "hyperband": {"max_resource": 9, "min_resource": 1, "eta": 3},
    "seed": 4,
}


def run_study(
    tmp: Path, spec: dict[str, Any], exit_code: int = 0, **settings: Any
) -> tuple[Any, list[list[tuple[int, int]]]]:
    """``packtune run`` of ``spec`` (with extra ``settings``; it must exit with
    ``exit_code``: 1 for a failed study): the study's outcome, and each pack's (trial,
    segment) members (segment -1: the whole trial)."""
    tmp.mkdir()
    (tmp / "spec.json").write_text(json.dumps(spec))
    url = f"sqlite:///{tmp / 'packtune.db'}"
    env = packtune_env(database_url=url, checkpoint_dir=tmp / "ckpt", torch_threads=1,
                       **settings)  # fmt: skip
    proc = start(["run", str(tmp / "spec.json")], env, tmp / "run.log")
    assert proc.wait(120) == exit_code, (tmp / "run.log").read_text()[-4000:]
    engine = make_engine(url)
    try:
        with session_scope(session_factory(engine)) as s:
            packs = [sorted((m.trial_id, m.segment) for m in p.members)
                     for p in s.scalars(sa.select(Pack).order_by(Pack.id))]  # fmt: skip
    finally:
        engine.dispose()
    return outcome(url, 1), packs


def test_a_decoupled_study_runs_to_a_best_trial_that_learned(tmp_path: Path) -> None:
    decoupled = {**SPEC, "training": {"mode": "decoupled", "segments": 2}}
    got, packs = run_study(tmp_path / "decoupled", decoupled)
    want, _ = run_study(tmp_path / "end_to_end", SPEC)
    largest = max(len(p) for p in packs)
    assert got.status == want.status == "completed"
    assert largest > 1  # its trials fused
    finals = [c[9.0] for c in got.curves.values() if 9.0 in c]
    assert finals and all(v is not None and math.isfinite(v) for v in finals)
    best = min(finals)
    best_e2e = min(c[9.0] for c in want.curves.values() if 9.0 in c)
    print(f"best val_loss: decoupled {best:.4f}, end to end {best_e2e:.4f}")
    assert best < 0.5 and best != best_e2e  # it learned (chance is 2.3), and not end to end


def test_decoupled_training_of_a_regression_is_refused_in_one_line(tmp_path: Path) -> None:
    """Float targets failed every trial with IndexError ("tensors used as indices must be
    long"), and `packtune check` said decoupled training was possible. Such a study is
    refused at submission now (synthetic-mlp declares its targets: ``class_targets``), and
    the worker still refuses the array, for a workload that declares nothing."""
    space = {"lr": {"type": "loguniform", "low": 0.001, "high": 0.01},
             "task": {"type": "choice", "values": ["regression"]},
             "n_train": {"type": "choice", "values": [512]}}  # fmt: skip
    spec = {**SPEC, "workload": "synthetic-mlp", "space": space,
            "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3},
            "objective": {"metric": "val_loss", "mode": "min"},
            "training": {"mode": "decoupled", "segments": 2}}  # fmt: skip
    with pytest.raises(SpecError, match="not class labels at task='regression'") as refused:
        validate_spec(spec)
    assert refused.value.field == "training.mode"
    members = [(i, {"seed": i, "data_seed": 0, "task": "regression", "n_train": 512})
               for i in range(2)]  # fmt: skip
    with pytest.raises(ValueError, match="cannot train decoupled: .* not class labels"):
        FusedArray(get_workload("synthetic-mlp"), members,
                   training=TrainingSettings(mode="decoupled", segments=2))  # fmt: skip
    report = check("synthetic-mlp", space, members=2, steps=2, ks=(1,))
    assert report.decoupled_problem is not None and "not class labels" in report.decoupled_problem
