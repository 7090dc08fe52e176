"""What a plugin's own tests check: it registers, it fuses exactly, it runs a study."""

import subprocess
import sys
from pathlib import Path

from packtune.workloads import registry

HERE = Path(__file__).resolve().parents[1]


def test_the_workloads_are_registered() -> None:
    assert {"rings-mlp", "rings-files"} <= set(registry())


def test_it_fuses_exactly() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "check", "rings-mlp"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_study_runs_to_the_end(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "run", str(HERE / "rings.yaml")],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_streaming_workload_fuses_exactly_under_vmap() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "check", "rings-files", "--members", "3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stacks vmap x3" in result.stdout


def test_a_streaming_study_runs_to_the_end(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "run", str(HERE / "rings-files.yaml")],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "completed" in result.stdout
