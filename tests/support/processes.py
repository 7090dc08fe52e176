"""Helpers for end-to-end tests: real ``packtune`` processes on free ports."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from packtune.hyperband import plan_brackets

#: The suite's HTTP client. ``httpx.get`` builds a client per call, and a client's TLS
#: context (the CA bundle loaded, even for plain http) costs ~60 ms of CPU (AMD EPYC, 2
#: cores): a study polled every 0.3 s cost the test more CPU than the server spent
#: answering. No keep-alive, so that every request opens its own connection as
#: ``httpx.get``'s do: a server killed or restarted is seen the same way.
http = httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: the size of the terminal the suite was started from (pytest-xdist's workers set them to 80x24):
#: a child writing to a pipe is in no terminal, and its output must not depend on the caller's
TERMINAL_SIZE = ("COLUMNS", "LINES")


#: The embedded runner's CPU priority in the suite's processes: the same as everything else.
#: At the default (nice 10) a runner got ~10% of a core beside the other test process's
#: training at nice 0: the invariance module's studies took 337 s in a full run against 129 s
#: alone, and with two busy processes beside it (AMD EPYC, 2 cores) `packtune run` of
#: examples/digits-mlp.yaml did not end in 150 s, against 22.7 s at nice 0, so tests timed
#: out. tests/worker/test_embedded_runner.py checks the default, test_cli.py a value set.
RUNNER_NICE = 0


def packtune_env(**settings: Any) -> dict[str, str]:
    settings = {"runner_nice": RUNNER_NICE, **settings}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PACKTUNE_") and k not in TERMINAL_SIZE
    }
    env.update({f"PACKTUNE_{k.upper()}": str(v) for k, v in settings.items() if v is not None})
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(args: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "service", *args], env=dict(env), stdout=out, stderr=out
    )


def stop(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def serving(env: Mapping[str, str], log: Path, *extra: str) -> Iterator[str]:
    """``packtune serve`` on a free port; yields its base URL once /healthz answers."""
    port = free_port()
    proc = start(["serve", "--port", str(port), *extra], env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"packtune serve exited: {log.read_text()[-2000:]}")
            try:
                if http.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"packtune serve did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        stop(proc)


def wait_finished(
    url: str, study_id: int, timeout: float, log: Path | None = None
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        summary = http.get(f"{url}/api/studies/{study_id}", timeout=10).json()
        if summary["status"] in ("completed", "failed", "cancelled"):
            return dict(summary)
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log else ""
            raise TimeoutError(f"study {study_id} not finished: {summary}\n{tail}")
        time.sleep(0.3)


def final_metrics(curves: list[dict[str, Any]], metric: str) -> dict[int, dict[float, float]]:
    """trial id -> {resource: metric} from the /curves payload."""
    out: dict[int, dict[float, float]] = defaultdict(dict)
    for curve in curves:
        for point in curve["points"]:
            out[curve["trial_id"]][float(point["resource"])] = point["metrics"].get(metric)
    return dict(out)


def check_hyperband(
    spec: dict[str, Any], trials: list[dict[str, Any]], curves: dict[int, dict[float, float]]
) -> None:
    """Trials per bracket and rung match plan_brackets; every promotion was among the best
    floor(n_i/eta) of its rung; every trial's measurements reach its final resource."""
    hb = spec["hyperband"]
    brackets = plan_brackets(hb["max_resource"], eta=hb["eta"], min_resource=hb["min_resource"])
    s_max = len(brackets) - 1
    eta = hb["eta"]
    by_bracket: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for t in trials:
        by_bracket[t["bracket"]].append(t)
    assert sorted(by_bracket) == list(range(s_max + 1))
    for j, rungs in enumerate(brackets):
        s = s_max - j
        members = by_bracket[s]
        assert len(members) == rungs[0].n, (s, len(members), rungs[0].n)
        for i, rung in enumerate(rungs):
            reached = [t for t in members if t["rung"] >= i]
            assert len(reached) == rung.n, (s, i, len(reached), rung.n)
            if i == 0:
                continue
            prev = [t for t in members if t["rung"] >= i - 1]
            r_prev = rungs[i - 1].resource
            ranked = sorted(
                prev,
                key=lambda t: (
                    not math.isfinite(curves[t["id"]].get(r_prev, math.inf)),
                    curves[t["id"]].get(r_prev, math.inf),
                    t["id"],
                ),
            )
            best_ids = {t["id"] for t in ranked[: len(prev) // eta]}
            assert {t["id"] for t in reached} == best_ids, (s, i)
        for t in members:
            target = rungs[t["rung"]].resource
            assert math.isclose(max(curves[t["id"]]), target), (t["id"], curves[t["id"]], target)
            assert math.isclose(t["resource"], target)


def imports_torch(code: str, database_url: str) -> bool:
    """Run ``code`` in a fresh interpreter on ``database_url``; did it import torch?"""
    script = f"{code}\nimport sys\nprint('torch' in sys.modules)\n"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PACKTUNE_DATABASE_URL": database_url},
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1] == "True"


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (no longer exists, or is a zombie)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def children(pid: int) -> list[int]:
    """``pid``'s child processes, whichever of its threads started them (reads /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(p) for p in task.read_text().split()]
        except FileNotFoundError:
            continue  # the thread ended meanwhile
    return out


def runners(pid: int) -> list[int]:
    """``pid``'s spawned multiprocessing children (not its resource tracker)."""
    out = []
    for kid in children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{kid}/cmdline").read_bytes():
                out.append(kid)
        except FileNotFoundError:
            pass
    return out


def runner_identity(together: Any) -> tuple[str | None, str | None]:
    """Run in an embedded runner: once ``together`` (a manager's ``Barrier`` of two) has
    seen another call running at the same time, so that the two calls are in two runners
    however late one of them took its call, its worker name and torch threads setting."""
    together.wait()
    return os.environ.get("PACKTUNE_WORKER_NAME"), os.environ.get("PACKTUNE_TORCH_THREADS")
