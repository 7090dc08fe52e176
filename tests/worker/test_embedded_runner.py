"""The embedded runner is started ahead of the first pack, and never outlives its parent."""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from packtune.settings import get_settings
from tests.support.processes import gone, packtune_env, runner_identity, runners
from worker.embedded import EmbeddedDispatcher

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")

SMALL = {
    "name": "prestart",
    "workload": "digits-mlp",
    "space": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.3}},
    "hyperband": {"max_resource": 3, "eta": 3},
}


def mappers_configured() -> bool:
    """In a runner: whether the models' mappers are configured (SQLAlchemy does it at a
    session's first query: ~0.1 s on a CPU, which the first pack's claim paid)."""
    from sqlalchemy import inspect

    from service.models import Trial

    return bool(inspect(Trial).configured)


def test_start_spawns_and_warms_the_runner_before_any_pack(clean_env: pytest.MonkeyPatch) -> None:
    dispatcher = EmbeddedDispatcher(get_settings())
    began = time.monotonic()
    dispatcher.start("digits-mlp")
    assert time.monotonic() - began < 1.0  # returns at once; the child does the work
    try:
        [warm_up] = dispatcher.warm_ups
        assert warm_up.result(timeout=120).startswith("warm in")
        kids = runners(os.getpid())
        assert kids, "no runner process after start()"
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert [os.getpriority(os.PRIO_PROCESS, k) for k in kids] == [min(19, ours + 10)]
        assert dispatcher.busy() == 0  # the warm-up is not a pack
        # torch's objects frozen out of the collector's way: the first pack's memory probe
        # collects in milliseconds, not the ~0.12 s a full collection of them takes
        assert dispatcher._executor().submit(gc.get_freeze_count).result(timeout=60) > 100_000
        assert dispatcher._executor().submit(mappers_configured).result(timeout=60)
    finally:
        dispatcher.close()
    assert all(gone(k) for k in kids)


def test_closed_while_warming_up_the_runner_is_stopped_at_once(
    clean_env: pytest.MonkeyPatch,
) -> None:
    dispatcher = EmbeddedDispatcher(get_settings())
    dispatcher.start("digits-mlp")
    time.sleep(0.2)
    kids = runners(os.getpid())
    began = time.monotonic()
    dispatcher.close()
    assert time.monotonic() - began < 5.0
    assert all(gone(k) for k in kids)


def test_two_runners_each_take_a_name_of_their_own_and_a_share_of_the_cores(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("PACKTUNE_DEVICE", "cpu")
    clean_env.setenv("PACKTUNE_EMBEDDED_RUNNERS", "2")
    dispatcher = EmbeddedDispatcher(get_settings())
    host = socket.gethostname()
    assert dispatcher.embedded_workers == {f"embedded@{host}", f"embedded-2@{host}"}
    dispatcher.start("digits-mlp")
    try:
        # every warm-up done: a runner still warming up (torch's import, seconds on a loaded
        # machine) would leave both calls below to the other one
        assert all(w.result(timeout=120) for w in dispatcher.warm_ups)
        assert len(dispatcher.warm_ups) == 2
        pool = dispatcher._executor()
        # Each call waits for the other to be running too, so the two run in two runners
        # whichever takes them when. One runner is held still meanwhile, as a loaded machine
        # holds a process: the other takes the first call, and the second waits for the
        # held one (calls that only slept a second went both to the free runner then).
        held = runners(os.getpid())[0]
        with multiprocessing.Manager() as manager:
            together = manager.Barrier(2, timeout=60)
            os.kill(held, signal.SIGSTOP)
            try:
                calls = [pool.submit(runner_identity, together) for _ in range(2)]
                time.sleep(1.5)
            finally:
                os.kill(held, signal.SIGCONT)
            got = sorted(c.result(timeout=120) for c in calls)
        threads = str(max(1, ((os.cpu_count() or 2) - 1) // 2))
        assert got == [(f"embedded-2@{host}", threads), (f"embedded@{host}", threads)]
        assert len(runners(os.getpid())) == 2
        rows = dispatcher.runner_statuses()
        assert [r["name"] for r in rows] == [f"embedded@{host}", f"embedded-2@{host}"]
        assert not any(r["busy"] for r in rows)
    finally:
        dispatcher.close()


def test_on_a_gpu_there_is_one_runner_whatever_the_setting(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("PACKTUNE_DEVICE", "cuda")
    clean_env.setenv("PACKTUNE_EMBEDDED_RUNNERS", "3")
    dispatcher = EmbeddedDispatcher(get_settings())
    assert dispatcher.embedded_workers == {f"embedded@{socket.gethostname()}"}


def _marked(marker: str) -> list[int]:
    """Processes whose environment carries ``marker`` (a runner left behind would)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return [pid for pid in found if not gone(pid)]


@pytest.mark.parametrize("database", ["ok", "unusable"])
def test_run_leaves_no_runner_behind(tmp_path: Path, database: str) -> None:
    """``packtune run`` starts its runner before migrating; it is gone after the command,
    whether the study ran or the database could not even be opened."""
    marker = f"PACKTUNE_TEST_MARK=run-{uuid.uuid4().hex}"
    db = tmp_path / "packtune.db" if database == "ok" else tmp_path / "missing" / "x.db"
    env = packtune_env(
        database_url=f"sqlite:///{db}", checkpoint_dir=tmp_path / "ckpt", scheduler_interval=0.1
    )
    key, value = marker.split("=", 1)
    env[key] = value
    result = run_small([sys.executable, "-m", "service"], env, tmp_path)
    if database == "ok":
        assert result.returncode == 0, result.stderr
        assert "completed" in result.stdout
    else:
        assert result.returncode != 0 and "database unavailable" in result.stderr
    deadline = time.monotonic() + 5  # a runner cut off from its parent exits within ~1 s
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked(marker) == []


def run_small(
    command: list[str], env: dict[str, str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """``COMMAND run`` of :data:`SMALL`, its spec written to ``tmp_path``."""
    spec = tmp_path / "small.yaml"
    spec.write_text(yaml.safe_dump(SMALL))
    return subprocess.run(
        [*command, "run", str(spec)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def packtune_script() -> str:
    """The installed ``packtune`` command, beside this interpreter (``.ci/run`` installs it)."""
    found = shutil.which("packtune", path=str(Path(sys.executable).parent))
    assert found, f"no packtune script beside {sys.executable}: install the project"
    return found


@pytest.mark.parametrize("command", ["packtune", "python -m service"])
def test_the_runner_does_not_import_the_cli_again(tmp_path: Path, command: str) -> None:
    """A spawned child imports its parent's main module again before it runs anything: the
    ``packtune`` script's module must not pull in the CLI (typer, rich: ~0.15 s on the
    first pack's critical path). Every process's imports are printed
    (``PYTHONPROFILEIMPORTTIME``): the CLI once, in the command's own process."""
    env = packtune_env(
        database_url=f"sqlite:///{tmp_path / 'packtune.db'}",
        checkpoint_dir=tmp_path / "ckpt",
        scheduler_interval=0.1,
    )
    env["PYTHONPROFILEIMPORTTIME"] = "1"
    start = [packtune_script()] if command == "packtune" else [sys.executable, "-m", "service"]
    result = run_small(start, env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "completed" in result.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")]  # fmt: skip
    # the runner trained the packs, so it imported torch; the CLI, only the parent
    assert imported.count("torch") == 1, "torch: imported by the runner alone"
    assert imported.count("service.cli") == 1
    assert imported.count("typer") == 1
