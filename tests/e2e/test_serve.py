"""``packtune serve`` runs its scheduler in a child process, which stops with it however it
ends, releasing the scheduler lease; ``packtune scheduler`` releases it on SIGTERM too."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import wait_for
from tests.support.processes import children, free_port, gone, http, packtune_env, start, stop

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc"),
]

SPEC = {
    "name": "serve-child",
    "workload": "digits-mlp",
    "space": {
        "lr": {"type": "loguniform", "low": 0.01, "high": 0.3},
        "hidden": {"type": "choice", "values": [256]},
    },
    # long enough that a pack is still training when the test looks (R=9 could finish
    # between two polls on a fast machine); the tests stop serve long before its end
    "hyperband": {"max_resource": 81, "eta": 3},
    "seed": 0,
}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    return [p for kid in children(pid) for p in (kid, *descendants(kid))]


def lease_holders(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [row[0] for row in conn.execute("select holder from leases")]


def _answers(url: str) -> bool:
    try:
        return http.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def serve(tmp_path: Path, scheduler_interval: float) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``packtune serve`` on a fresh SQLite file, answering: (process, API base URL, db)."""
    db = tmp_path / "packtune.db"
    env = packtune_env(
        database_url=f"sqlite:///{db}", checkpoint_dir=tmp_path / "ckpt",
        scheduler_interval=scheduler_interval, torch_threads=1,
    )  # fmt: skip
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    proc = start(["serve", "--port", str(port)], env, tmp_path / "serve.log")
    try:
        wait_for(lambda: _answers(f"{api}/healthz"), 60, "packtune serve")
    except BaseException:
        stop(proc)
        raise
    return proc, api, db


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_serve_stops_its_scheduler_process_however_it_ends(tmp_path: Path, how: str) -> None:
    proc, api, db = serve(tmp_path, scheduler_interval=0.2)
    try:
        assert http.post(f"{api}/api/studies", json=SPEC, timeout=30).status_code == 201
        wait_for(
            lambda: http.get(f"{api}/api/studies/1", timeout=10).json()["packs_running"],
            60, "a pack running",
        )  # fmt: skip
        (holder,) = lease_holders(db)
        scheduler_pid = int(holder.split(":")[1])
        tree = descendants(proc.pid)
        assert scheduler_pid != proc.pid and scheduler_pid in tree
        assert len(descendants(scheduler_pid)) >= 1  # the runner, under the scheduler

        proc.send_signal(getattr(signal, how))
        proc.wait(30)
        wait_for(lambda: all(gone(p) for p in tree), 15, f"{tree} to exit")
        assert lease_holders(db) == []  # released, even when serve itself was killed
    finally:
        stop(proc)


def test_the_scheduler_releases_its_lease_on_sigterm(tmp_path: Path) -> None:
    db = tmp_path / "packtune.db"
    env = packtune_env(database_url=f"sqlite:///{db}", scheduler_interval=0.2)
    assert start(["db", "upgrade"], env, tmp_path / "upgrade.log").wait(60) == 0
    proc = start(["scheduler"], env, tmp_path / "scheduler.log")
    try:
        wait_for(lambda: lease_holders(db), 60, "the scheduler's lease")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert lease_holders(db) == []
    finally:
        stop(proc)


def test_a_study_posted_to_serve_starts_without_waiting_for_a_tick(tmp_path: Path) -> None:
    """With a 30 s tick the idle scheduler would pick the study up only at its next tick;
    serve wakes its scheduler process on the POST, so the study starts within seconds."""
    proc, api, db = serve(tmp_path, scheduler_interval=30)
    try:
        wait_for(lambda: lease_holders(db), 60, "the scheduler's first tick")
        time.sleep(1.0)  # its first tick is over: the next one is ~29 s away
        posted = time.monotonic()
        assert http.post(f"{api}/api/studies", json=SPEC, timeout=30).status_code == 201
        wait_for(
            lambda: http.get(f"{api}/api/studies/1", timeout=10).json()["status"] != "pending",
            15, "the study to start",
        )  # fmt: skip
        assert time.monotonic() - posted < 15
    finally:
        stop(proc)
