"""What the CLI's commands print where their output cannot go, or where there is little to
show: real subprocesses against a real ``packtune serve`` (SQLite, no scheduler, so that
its one study stays pending, without trials, and nothing trains beside the tests)."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.support.processes import http, packtune_env, serving

SPEC = {
    "name": "idle",
    "workload": "digits-mlp",
    "space": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.3}},
    "hyperband": {"max_resource": 3, "eta": 3},
}


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("idle")
    env = packtune_env(database_url=f"sqlite:///{tmp / 'packtune.db'}", checkpoint_dir=tmp / "ckpt")
    spec = tmp / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    with serving(env, tmp / "serve.log", "--no-scheduler") as url:
        created = http.post(f"{url}/api/studies", json=SPEC)
        assert created.status_code == 201, created.text
        yield {"url": url, "env": env, "tmp": tmp, "spec": spec, "study": created.json()["id"]}


def _studies(url: str) -> int:
    return int(http.get(f"{url}/api/studies").json()["count"])


def stdout_closed(args: list[str], idle: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``packtune ARGS >&-``: file descriptor 1 closed, not /dev/null."""
    return subprocess.run(
        [sys.executable, "-m", "service", *args], env=idle["env"], cwd=idle["tmp"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("command", "what"),
    [("check digits-mlp --steps 1", "the check"), ("studies", "the studies"),
     ("show STUDY", "the study"), ("export STUDY", "the trials (--out FILE writes them)"),
     ("submit SPEC", "the study")],
)  # fmt: skip
def test_a_command_with_its_standard_output_closed_is_one_line(
    idle: dict[str, Any], command: str, what: str
) -> None:
    """`packtune studies >&-` (and check, show, export) ended in a 40-line AttributeError
    traceback on ``sys.stdout`` being None, exit 1, after the work was done; only `run`
    said so. Each now stops before it starts, in `run`'s line: a study is not submitted."""
    args = command.replace("STUDY", str(idle["study"])).replace("SPEC", str(idle["spec"]))
    url = [] if command.startswith("check") else ["--url", idle["url"]]
    before = _studies(idle["url"])
    result = stdout_closed([*args.split(), *url], idle)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: standard output is closed: nothing could show {what}"
    ]
    assert _studies(idle["url"]) == before


def test_export_to_a_file_needs_no_standard_output(idle: dict[str, Any]) -> None:
    out = idle["tmp"] / "trials.csv"
    result = stdout_closed(["export", str(idle["study"]), "--out", str(out),
                            "--url", idle["url"]], idle)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert out.exists()


def cli(idle: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args, "--url", idle["url"]], env=idle["env"],
        cwd=idle["tmp"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_page_of_studies_past_the_last_says_there_are_none(idle: dict[str, Any]) -> None:
    """`packtune studies --offset 50` of 4 studies ended 'studies 50-50 of 4'."""
    count = _studies(idle["url"])
    listed = cli(idle, "studies", "--offset", "50")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip().splitlines()[-1] == f"no studies at offset 50 of {count}"


def test_the_csv_of_a_study_without_trials_is_its_header_row(idle: dict[str, Any]) -> None:
    """`packtune export ID` of a study with no trials yet wrote a bare line end, no header:
    a reader of the file found no columns to read."""
    exported = cli(idle, "export", str(idle["study"]))
    assert exported.returncode == 0, exported.stderr
    reader = csv.DictReader(io.StringIO(exported.stdout))
    assert list(reader) == []
    assert reader.fieldnames == ["id", "status", "iteration", "bracket", "rung", "resource",
                                 "measured_resource", "error"]  # fmt: skip
