"""A study whose model is larger than the device: its trials train spilled (shard by shard
through a small simulated CPU budget) and end exactly as the same study in memory.

Two real ``packtune run`` studies (SQLite, packs trained by the embedded runner's child
process): one with the default CPU budget (4 GiB), one with 10 MB (0.3 MB of it the data
set), which a trial of this model (~10 MB of weights, gradients and momentum) exceeds, and
one of its 640x640 layers (~3.9 MB with its gradient and activations) fits half of.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from service.db import make_engine, session_factory, session_scope
from service.models import Pack
from tests.support.cluster import Services, assert_same_outcome, outcome
from tests.support.processes import packtune_env

SPEC: dict[str, Any] = {
    "name": "spilled",
    "workload": "synthetic-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {
        "lr": {"type": "loguniform", "low": 0.01, "high": 0.3},
        "hidden": {"type": "choice", "values": [640]},
        "layers": {"type": "choice", "values": [3]},
        "n_train": {"type": "choice", "values": [1024]},
        "n_val": {"type": "choice", "values": [256]},
    },
    "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3},
    "seed": 5,
}
SMALL_BUDGET = 10_000_000


def run_study(tmp: Path, budget: int) -> tuple[str, list[Any]]:
    tmp.mkdir()
    (tmp / "spec.json").write_text(json.dumps(SPEC))
    url = f"sqlite:///{tmp / 'packtune.db'}"
    env = packtune_env(database_url=url, checkpoint_dir=tmp / "ckpt", torch_threads=1,
                       cpu_memory_budget=budget)  # fmt: skip
    Services(env, tmp / "run.log").run("run", str(tmp / "spec.json"))
    engine = make_engine(url)
    try:
        with session_scope(session_factory(engine)) as s:
            arrays = [run for p in s.scalars(sa.select(Pack)) for run in (p.arrays or [])]
    finally:
        engine.dispose()
    return url, arrays


def test_a_model_larger_than_the_device_trains_spilled_with_the_same_results(
    tmp_path: Path,
) -> None:
    reference_url, in_memory = run_study(tmp_path / "memory", 4 * 2**30)
    spilled_url, spilled = run_study(tmp_path / "spilled", SMALL_BUDGET)
    reference, got = outcome(reference_url, 1), outcome(spilled_url, 1)
    print(f"largest difference: {assert_same_outcome(got, reference):.3g}")
    assert all(t["status"] != "failed" for t in got.trials.values()), got.trials
    notes = [note for run in spilled for note in run.get("notes", [])]
    assert spilled and all(
        any("spilled" in note for note in run.get("notes", [])) for run in spilled
    ), notes
    assert not any("spilled" in n for run in in_memory for n in run.get("notes", []))
    print(notes[0])
