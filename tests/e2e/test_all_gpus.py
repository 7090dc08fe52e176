"""``packtune worker --all-gpus``, the compose worker's command: a worker per GPU it may use
(``CUDA_VISIBLE_DEVICES`` heeded), each started again when it exits."""

from __future__ import annotations

import os
import signal
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest

from service.db import upgrade
from tests.support.cluster import wait_for
from tests.support.processes import packtune_env, start
from worker.main import gpus_to_run

READINGS: list[dict[str, Any]] = [
    {"index": i, "uuid": f"GPU-{c}{c}{c}-{i}"} for i, c in enumerate("abcd")
]


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, [0, 1, 2, 3]),  # unset: every GPU
        ("2,3", [2, 3]),  # before: every GPU of the host, whatever the variable said
        ("3,1", [3, 1]),
        ("GPU-ccc,GPU-aaa-0", [2, 0]),  # UUID prefixes
        ("1,7,2", [1]),  # CUDA stops at the first entry it cannot place
        ("GPU-", []),  # a prefix of several GPUs places none
        ("", []),  # none visible: one worker, as on a host without GPUs
        ("1,1", [1]),
    ],
)
def test_the_gpus_a_worker_each_are_those_cuda_may_use(
    visible: str | None, expected: list[int]
) -> None:
    assert gpus_to_run(READINGS, visible) == expected


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_a_worker_that_dies_is_started_again_under_its_name(redis_url: str, tmp_path: Path) -> None:
    """The parent waited on its workers and nothing else: one killed (by the kernel for
    memory, a CUDA fault) left its GPU idle while the container stayed up, so no restart
    policy ever fired (found by an audit)."""
    url = f"sqlite:///{tmp_path / 'packtune.db'}"
    upgrade(url)
    env = packtune_env(
        database_url=url, redis_url=redis_url, checkpoint_dir=tmp_path / "ckpt",
        queue_name=f"all-gpus-{uuid.uuid4().hex[:8]}", heartbeat_interval=0.5, device="cpu",
        log_level="INFO",
    )  # fmt: skip
    log = tmp_path / "worker.log"
    name = f"{socket.gethostname()}-cpu"
    parent = start(["worker", "--all-gpus"], env, log)
    try:
        listening = f"worker {name} listening on"
        wait_for(lambda: listening in log.read_text(), 90, "the first worker")
        [first] = _children(parent.pid)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: log.read_text().count(listening) == 2, 90, "the worker started again")
        [second] = _children(parent.pid)
        assert second != first and parent.poll() is None
        assert "the worker on the CPU exited (code -9); starting it again in 1 s" in log.read_text()
        parent.terminate()
        assert parent.wait(60) == 0, log.read_text()[-3000:]
        assert not Path(f"/proc/{second}").exists() or _zombie(second)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
