"""Helpers for the fault tests: private servers, packtune processes, study outcomes.

- :class:`RedisServer`: a ``redis-server`` of the test's own on a free port,
  keeping nothing on disk, so restarting it loses every queued job.
- :class:`PostgresCluster`: a throwaway PostgreSQL cluster (``initdb`` in a
  temporary directory, run as the ``postgres`` OS user when we are root), so
  restarting it disturbs no other test.
- :class:`Services`: ``packtune`` processes started, killed and restarted by name.
- :func:`outcome` reads what a study ended with straight from its database;
  :func:`assert_same_outcome` compares two of them.
"""

from __future__ import annotations

import glob
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa

from packtune.spec import validate_spec
from service import store
from service.db import make_engine, session_factory, session_scope
from service.models import Measurement, Pack, Study, Trial
from tests.support.processes import free_port, start
from tests.support.services import unavailable

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float, what: str, every: float = 0.1) -> T:
    """Call ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


# -- private servers ----------------------------------------------------------------------


class RedisServer:
    """``redis-server --save "" --appendonly no`` on a free loopback port."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            unavailable("redis-server", FileNotFoundError("redis-server is not installed"))
        self.binary = str(binary)
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import redis

        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir)],
            stdout=log, stderr=log,
        )  # fmt: skip
        client = redis.Redis(port=self.port, socket_connect_timeout=1)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_for(answers, 10, "redis-server to answer")
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # nothing is saved anyway: the same as a crash
            self.proc.wait(10)
        self.proc = None

    def subscribed(self) -> list[str]:
        """The RQ worker channels (``rq:pubsub:<name>``) someone listens on."""
        import redis

        client = redis.Redis(port=self.port)
        try:
            return sorted(c.decode() for c in client.pubsub_channels("rq:pubsub:*"))
        finally:
            client.close()

    def job_ids(self) -> list[str]:
        """Every RQ job Redis knows of (RQ keeps a hash ``rq:job:<id>`` per job)."""
        import redis

        client = redis.Redis(port=self.port)
        try:
            prefix = "rq:job:"
            return sorted(
                key.decode()[len(prefix) :]
                for key in client.scan_iter(match=f"{prefix}*")
                if key.decode().count(":") == 2  # not rq:job:<id>:dependents and the like
            )
        finally:
            client.close()


def _postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version_key)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _version_key(path: str) -> int:
    part = Path(path).parts[-3]
    return int(part) if part.isdigit() else 0


class PostgresCluster:
    """A PostgreSQL cluster of the test's own, trust auth, on a free loopback port."""

    def __init__(self) -> None:
        bindir = _postgres_bin()
        if bindir is None:
            unavailable("PostgreSQL binaries", FileNotFoundError("initdb not found"))
        assert bindir is not None
        self.bindir = bindir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="packtune-pg-"))
        self.data = self.root / "data"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._as: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            self._as = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.root, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "-E", "UTF8", "--no-sync")  # fmt: skip

    def _run(self, tool: str, *args: str, check: bool = True) -> None:
        done = subprocess.run(
            [*self._as, str(self.bindir / tool), *args], capture_output=True, text=True, timeout=120
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{tool} failed: {done.stdout}{done.stderr}")

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"),
                  "-o", options, "-w", "-t", "60", "start")  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


# -- packtune processes -------------------------------------------------------------------


@dataclass
class Services:
    """Named ``packtune`` processes sharing one environment and one log file."""

    env: dict[str, str]
    log: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> None:
        self.procs[name] = start(list(args), {**self.env, **(env or {})}, self.log)

    def run(self, *args: str) -> None:
        proc = start(list(args), self.env, self.log)
        assert proc.wait(120) == 0, self.tail()

    def kill(self, name: str) -> None:
        """``kill -9``: no clean-up of any kind."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def create_database(server_url: str, name: str) -> str:
    """A new empty database ``name`` on the server of ``server_url``; returns its URL."""
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()
    url = sa.engine.make_url(server_url).set(database=name)
    return url.render_as_string(hide_password=False)


def drop_database(server_url: str, name: str) -> None:
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def submit(engine: sa.Engine, spec: dict[str, Any]) -> int:
    """Create a study the way ``POST /api/studies`` does; returns its id."""
    body = validate_spec(spec).model_dump(mode="json")
    with session_scope(session_factory(engine)) as s:
        study = store.create_study(
            s, name=body["name"], workload=body["workload"], spec=body, seed=body["seed"]
        )
        return study.id


def study_status(engine: sa.Engine, study_id: int) -> str:
    with engine.connect() as conn:
        status = conn.execute(sa.select(Study.status).where(Study.id == study_id)).scalar_one()
    return str(status.value if hasattr(status, "value") else status)


def wait_study(engine: sa.Engine, study_id: int, timeout: float, services: Services) -> str:
    def finished() -> str | None:
        status = study_status(engine, study_id)
        return status if status in ("completed", "failed", "cancelled") else None

    try:
        return wait_for(finished, timeout, f"study {study_id} to finish", every=0.25)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n{services.tail()}") from None


# -- outcomes -----------------------------------------------------------------------------


@dataclass
class PackRow:
    id: int
    status: str
    attempts: int
    job_id: str | None
    worker: str | None
    error: str | None
    parent_id: int | None
    members: list[tuple[int, float, float]]  # (sample index, from, to)


@dataclass
class Outcome:
    """What a study ended with; trials are keyed by ``sample_index`` (ids differ per run)."""

    status: str
    best: int | None  # sample index of the best trial
    trials: dict[int, dict[str, Any]]  # status, bracket, rung, resource, error, config
    curves: dict[int, dict[float, float | None]]  # objective by resource
    packs: list[PackRow]


def _value(v: Any) -> Any:
    return v.value if hasattr(v, "value") else v


def outcome(url: str, study_id: int, metric: str = "val_loss") -> Outcome:
    engine = make_engine(url)
    try:
        with session_scope(session_factory(engine)) as s:
            study = s.get(Study, study_id)
            assert study is not None
            trials = list(s.scalars(sa.select(Trial).where(Trial.study_id == study_id)))
            index = {t.id: t.sample_index for t in trials}
            rows = s.execute(
                sa.select(Measurement.trial_id, Measurement.resource, Measurement.metrics).where(
                    Measurement.trial_id.in_(list(index))
                )
            )
            curves: dict[int, dict[float, float | None]] = {i: {} for i in index.values()}
            for trial_id, resource, metrics in rows:
                curves[index[trial_id]][float(resource)] = metrics.get(metric)
            packs = [
                PackRow(
                    id=p.id,
                    status=_value(p.status),
                    attempts=p.attempts,
                    job_id=p.job_id,
                    worker=p.worker_name,
                    error=p.error,
                    parent_id=p.parent_id,
                    members=sorted(
                        (index[m.trial_id], m.from_resource, m.to_resource) for m in p.members
                    ),
                )  # fmt: skip
                for p in s.scalars(
                    sa.select(Pack).where(store.of_study(study_id)).order_by(Pack.id)
                )
            ]
            return Outcome(
                status=_value(study.status),
                best=index.get(study.best_trial_id) if study.best_trial_id else None,
                trials={
                    t.sample_index: {
                        "status": _value(t.status),
                        "iteration": t.iteration,
                        "bracket": t.bracket,
                        "rung": t.rung,
                        "resource": t.resource_done,
                        "error": t.error,
                        "config": dict(t.config),
                        "id": t.id,
                    }  # fmt: skip
                    for t in trials
                },
                curves=curves,
                packs=packs,
            )
    finally:
        engine.dispose()


def assert_same_outcome(got: Outcome, want: Outcome) -> float:
    """Same configs (sampled from the same results), statuses and rungs per trial, same
    curves to float rounding, same best trial.

    Returns the largest difference of the objective seen (for the report).
    """
    assert got.status == want.status == "completed", (got.status, want.status)
    assert sorted(got.trials) == sorted(want.trials)
    for i, trial in want.trials.items():
        mine = got.trials[i]
        for key in ("status", "iteration", "bracket", "rung", "resource", "config"):
            assert mine[key] == trial[key], (i, key, mine[key], trial[key])
    largest = 0.0
    for i, curve in want.curves.items():
        assert sorted(got.curves[i]) == sorted(curve), (i, got.curves[i], curve)
        for r, v in curve.items():
            w = got.curves[i][r]
            if v is None or not math.isfinite(v):
                assert w is None or not math.isfinite(w), (i, r, w)
                continue
            assert w is not None
            largest = max(largest, abs(w - v))
            assert w == pytest.approx(v, rel=1e-4, abs=1e-5), (i, r, w, v)
    assert got.best == want.best
    return largest


class TcpGate:
    """A TCP forwarder to ``upstream`` that can be held shut: while :attr:`held` is set,
    nothing is forwarded either way, a closed end included (the client's requests wait, and
    a client killed meanwhile leaves its server connection open, as on a stalled network).
    Point one process's database URL at :attr:`port` to stall that process alone."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        import socket
        import threading

        self.upstream = upstream
        self.held = threading.Event()
        self._marker: bytes | None = None
        self._skip = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def hold_after(self, marker: bytes, skip: int = 0) -> None:
        """Hold the gate as soon as a client's request holding ``marker`` has been passed on,
        after ``skip`` such requests went through: the server runs it (its locks taken), and
        the answer and whatever follows wait. (psycopg prepares a statement it has run five
        times on a connection; its text is not sent again.)"""
        self._marker, self._skip = marker, skip

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for src, dst, upward in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, upward), daemon=True).start()

    def _wait_while_held(self) -> None:
        while self.held.is_set() and not self._closed.is_set():
            time.sleep(0.01)

    def _pump(self, src: Any, dst: Any, upward: bool) -> None:
        try:
            while data := src.recv(65536):
                self._wait_while_held()
                dst.sendall(data)
                if upward and self._marker is not None and self._marker in data:
                    if self._skip:
                        self._skip -= 1
                    else:
                        self._marker = None
                        self.held.set()
        except OSError:
            pass
        finally:
            self._wait_while_held()
            for sock in (src, dst):
                try:
                    sock.close()
                except OSError:
                    pass

    def url(self, database_url: str) -> str:
        """``database_url`` with its host and port replaced by this gate's."""
        url = sa.engine.make_url(database_url).set(host="127.0.0.1", port=self.port)
        return url.render_as_string(hide_password=False)

    def close(self) -> None:
        self._closed.set()
        self._server.close()
