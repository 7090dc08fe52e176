"""examples/plugin, the template for bringing a model, works end to end as a user's plugin:
registered through its entry point, it fuses exactly and a study runs to the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
