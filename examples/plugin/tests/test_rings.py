"""What a plugin's own tests check: it registers, it fuses exactly, it runs a study."""

import subprocess
import sys
from pathlib import Path

from packtune.workloads import registry

HERE = Path(__file__).resolve().parents[1]


def test_the_workloads_are_registered() -> None:
    assert {"rings-mlp", "rings-files"} <= set(registry())


def packtune(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The ``packtune`` command, as a user runs it; its output must say it succeeded."""
    result = subprocess.run(
        [sys.executable, "-m", "service", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_it_fuses_exactly() -> None:
    packtune("check", "rings-mlp")


def test_a_study_runs_to_the_end(tmp_path: Path) -> None:
    packtune("run", str(HERE / "rings.yaml"), cwd=tmp_path)


def test_the_streaming_workload_fuses_exactly_under_vmap() -> None:
    assert "stacks vmap x3" in packtune("check", "rings-files", "--members", "3").stdout


def test_a_streaming_study_runs_to_the_end(tmp_path: Path) -> None:
    assert "completed" in packtune("run", str(HERE / "rings-files.yaml"), cwd=tmp_path).stdout
