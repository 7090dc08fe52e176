"""examples/plugin, the template for bringing a model, works end to end as a user's plugin:
registered through its entry point, it fuses exactly and a study runs to the end."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.plugins import HERE as PLUGIN_MODULES
from tests.support.plugins import install_plugin
from tests.support.processes import packtune_env

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin"


def test_the_example_plugin_checks_and_runs_a_study(tmp_path: Path) -> None:
    root = install_plugin(tmp_path / "dist", "packtune_example_plugin",
                          {"rings-mlp": "packtune_example_plugin:RingsMLP"})  # fmt: skip
    env = packtune_env(database_url=f"sqlite:///{tmp_path / 'packtune.db'}",
                       checkpoint_dir=tmp_path / "ckpt", scheduler_interval=0.1)  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(root), str(EXAMPLE / "src"), os.environ.get("PYTHONPATH")])
    )

    def packtune(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "service", *args]
        return subprocess.run(
            command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
        )

    checked = packtune("check", "rings-mlp", "--steps", "3")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "(exact)" in checked.stdout and "stacks bmm x4" in checked.stdout
    ran = packtune("run", str(EXAMPLE / "rings.yaml"), "--top", "3")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "completed" in ran.stdout and "rings-mlp" in ran.stdout


def test_an_objective_the_workload_never_reports_fails_its_trials_saying_so(
    tmp_path: Path,
) -> None:
    """A workload that does not declare its metrics accepts any objective at submission; a
    study naming one it never reports fails its trials at their first measurement with the
    reason (the study then fails, and ``packtune run`` exits 1), instead of ranking every
    trial last and completing without a best trial."""
    root = install_plugin(tmp_path / "dist", "trap_workloads",
                          {"undeclared": "trap_workloads:UndeclaredMLP"})  # fmt: skip
    env = packtune_env(database_url=f"sqlite:///{tmp_path / 'packtune.db'}",
                       checkpoint_dir=tmp_path / "ckpt", scheduler_interval=0.1)  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(root), str(PLUGIN_MODULES), os.environ.get("PYTHONPATH")])
    )
    spec = tmp_path / "f1.yaml"
    spec.write_text(
        "name: f1\nworkload: undeclared-mlp\n"
        "objective: {metric: val_f1, mode: max}\n"
        "space: {lr: {type: loguniform, low: 0.01, high: 0.1}}\n"
        "hyperband: {max_resource: 3, min_resource: 1, eta: 3}\n"
    )
    ran = subprocess.run(
        [sys.executable, "-m", "service", "run", str(spec)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = ran.stdout + ran.stderr
    assert ran.returncode == 1, out
    said = "did not report the study's objective metric 'val_f1'"
    assert said in out and "'val_accuracy', 'val_loss'" in out, out
    assert "isolating members" not in out, out  # every member's cause: no culprit to look for
    with sqlite3.connect(tmp_path / "packtune.db") as db:
        trials = db.execute("SELECT status, error FROM trials").fetchall()
        status = db.execute("SELECT status FROM studies").fetchone()
    assert trials and all(s == "failed" and said in e for s, e in trials), trials
    assert status == ("failed",)
