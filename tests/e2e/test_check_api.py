"""``POST /api/workloads/{name}/check``: ``packtune check`` run by a service's worker.

Against real processes: ``packtune serve`` with its embedded runner (SQLite), and
PostgreSQL + Redis + ``packtune scheduler`` + an RQ ``packtune worker`` behind
``packtune serve --no-scheduler``. The API never loads torch; the worker runs the check on
its device and the report comes back through the database.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.plugins import HERE as PLUGIN_MODULES
from tests.support.plugins import install_plugin
from tests.support.processes import http, packtune_env, serving, start, stop

pytestmark = pytest.mark.slow


def ask(url: str, workload: str, body: dict[str, Any]) -> httpx.Response:
    return http.post(f"{url}/api/workloads/{workload}/check", json=body, timeout=30)


def wait_check(url: str, location: str, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        found = dict(http.get(f"{url}{location}", timeout=10).json())
        if found["status"] not in ("queued", "running"):
            return found
        assert time.monotonic() < deadline, found
        time.sleep(0.3)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """``packtune serve`` (embedded runner, SQLite) with the trap plugins installed."""
    tmp = tmp_path_factory.mktemp("check-api")
    root = install_plugin(tmp / "plugin", "trap_workloads", {
        "misdeclared": "trap_workloads:MisdeclaredMLP",
        "unbatchable": "stream_workloads:Unbatchable",
    })  # fmt: skip
    env = packtune_env(database_url=f"sqlite:///{tmp / 'packtune.db'}", scheduler_interval=0.2)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(root), str(PLUGIN_MODULES), os.environ.get("PYTHONPATH")])
    )
    with serving(env, tmp / "serve.log") as url:
        yield url, env


def test_a_check_runs_on_the_service_runner_and_reports(
    served: tuple[str, dict[str, str]],
) -> None:
    url, _ = served
    resp = ask(url, "digits-mlp", {"members": 3, "steps": 3})
    assert resp.status_code == 202, resp.text
    assert resp.json()["status"] == "queued"
    location = resp.headers["Location"]
    done = wait_check(url, location)
    assert done["status"] == "passed", done
    report = done["report"]
    assert report["stacks"] == [[[0, 1, 2], "bmm"]]
    assert [layer[1:] for layer in report["layers"]] == [
        ["Linear", "bmm"], ["ReLU", "bmm"], ["Linear", "bmm"], ["ReLU", "bmm"], ["Linear", "bmm"],
    ]  # fmt: skip
    assert report["exact"] and report["ok"] and report["max_difference"] < 1e-5
    assert set(report["step_ms"]) == {"1", "2", "4", "8"}
    assert all(ms > 0 for ms in report["step_ms"].values())
    assert "lr" in report["fusible"] and "hidden" in report["structural"]
    assert report["spill_problem"] is None and report["decoupled_problem"] is None
    assert done["worker"].startswith("embedded@") and done["finished_at"] is not None


def test_a_check_that_finds_fusion_wrong_is_failed_with_its_report(
    served: tuple[str, dict[str, str]],
) -> None:
    """The misdeclared plugin calls its activation fusible: members built with relu and tanh
    must be stacked apart, so fusion is impossible; the check says so and names it."""
    url, _ = served
    space = {"act": {"type": "choice", "values": ["relu", "tanh"]},
             "lr": {"type": "loguniform", "low": 0.01, "high": 0.1}}  # fmt: skip
    resp = ask(url, "misdeclared-mlp", {"space": space, "members": 4, "steps": 2})
    done = wait_check(url, resp.headers["Location"])
    assert done["status"] == "failed", done
    assert done["report"]["split"] and not done["report"]["ok"]
    assert any("(parameter 'act')" in w for w in done["report"]["warnings"])


def test_a_step_vmap_cannot_run_passes_with_the_fallback_named(
    served: tuple[str, dict[str, str]],
) -> None:
    url, _ = served
    done = wait_check(url, ask(url, "unbatchable", {"steps": 2}).headers["Location"])
    assert done["status"] == "passed", done
    assert done["report"]["stacks"] == [[[0], "serial"], [[1], "serial"], [[2], "serial"],
                                        [[3], "serial"]]  # fmt: skip
    assert any("vmap could not run the fused step" in w for w in done["report"]["warnings"])
    # its own training_loss sees the whole model: it can neither spill nor train decoupled
    assert "defines its own training_loss" in done["report"]["spill_problem"]
    assert "training_loss" in done["report"]["decoupled_problem"]


def test_the_cli_runs_a_check_through_the_service(
    served: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    url, env = served
    out = subprocess.run(
        [sys.executable, "-m", "service", "check", "digits-mlp", "--url", url,
         "--members", "2", "--steps", "2"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "stacks bmm x2" in out.stdout and "(exact)" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "service", "check", "no-such", "--url", url],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "404: unknown workload 'no-such'" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr


@pytest.mark.parametrize(
    ("workload", "body", "code", "loc"),
    [
        ("no-such", {}, 404, None),
        ("digits-mlp", {"space": {"depth": {"type": "int", "low": 1, "high": 3}}}, 422,
         ["body", "space", "depth"]),
        ("digits-mlp", {"space": {"lr": {"type": "uniform", "low": 1, "high": 0}}}, 422,
         ["body", "space", "lr", "low"]),
        ("digits-mlp", {"members": 1}, 422, ["body", "members"]),
        ("digits-mlp", {"steps": 0}, 422, ["body", "steps"]),
        ("digits-mlp", {"colour": "blue"}, 422, ["body", "colour"]),
    ],
)  # fmt: skip
def test_bad_checks_are_refused_naming_what_is_wrong(
    served: tuple[str, dict[str, str]],
    workload: str,
    body: dict[str, Any],
    code: int,
    loc: list[str] | None,
) -> None:
    url, _ = served
    resp = ask(url, workload, body)
    assert resp.status_code == code, resp.text
    if loc is not None:
        assert loc in [entry["loc"] for entry in resp.json()["detail"]], resp.text
    assert http.get(f"{url}/api/workloads/checks/999999", timeout=10).status_code == 404


def test_a_check_runs_on_an_rq_worker(fresh_postgres: str, redis_url: str, tmp_path: Path) -> None:
    env = packtune_env(
        database_url=fresh_postgres, redis_url=redis_url,
        queue_name=f"check-{uuid.uuid4().hex[:8]}", scheduler_interval=0.2,
        heartbeat_interval=1,
    )  # fmt: skip
    log = tmp_path / "services.log"
    migrate = start(["db", "upgrade"], env, log)
    assert migrate.wait(60) == 0, log.read_text()
    procs = [start(["scheduler"], env, log), start(["worker", "--name", "checker"], env, log)]
    try:
        with serving(env, tmp_path / "api.log", "--no-scheduler") as url:
            resp = ask(url, "digits-cnn", {"members": 2, "steps": 2})
            assert resp.status_code == 202, resp.text
            done = wait_check(url, resp.headers["Location"])
    finally:
        for proc in procs:
            stop(proc)
    assert done["status"] == "passed", (done, log.read_text()[-3000:])
    assert done["worker"] == "checker"
    assert done["report"]["stacks"] == [[[0, 1], "vmap"]]


def test_a_long_check_is_stopped_and_the_packs_behind_it_train(tmp_path: Path) -> None:
    """A check of 1,000 steps (within the request's limits) held the service's only runner
    for minutes: a one-trial study submitted after it stayed queued all that time, and
    nothing could stop the check. It stops at PACKTUNE_CHECK_SECONDS, an error that says
    why, and the study's pack then trains."""
    from tests.support.processes import wait_finished

    env = packtune_env(database_url=f"sqlite:///{tmp_path / 'packtune.db'}",
                       scheduler_interval=0.2, check_seconds=3)  # fmt: skip
    spec = {
        "name": "behind-a-check", "workload": "digits-mlp",
        "space": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.3}},
        "hyperband": {"max_resource": 1, "eta": 3}, "seed": 0,
    }  # fmt: skip
    with serving(env, tmp_path / "serve.log") as url:
        resp = ask(url, "digits-mlp", {"members": 16, "steps": 1000})
        assert resp.status_code == 202, resp.text
        study = http.post(f"{url}/api/studies", json=spec, timeout=30)
        assert study.status_code == 201, study.text
        done = wait_check(url, resp.headers["Location"], timeout=120)
        assert done["status"] == "error", done
        assert "ran past its 3 s (PACKTUNE_CHECK_SECONDS)" in done["error"], done
        finished = wait_finished(url, study.json()["id"], timeout=120)
        assert finished["status"] == "completed", finished
