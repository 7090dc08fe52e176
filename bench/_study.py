"""Run one study through the real service and read its timings back from the database.

Two ways, both real processes:

- ``embedded``: ``packtune run SPEC`` (SQLite, the scheduler in the process,
  packs in its spawned child) — the default a user gets;
- ``serve``: ``packtune serve`` on a fresh SQLite file (the embedded default
  as a running service: the scheduler and its runner up, a small warm-up study
  already run), the study POSTed to its API;
- ``rq``: a fresh PostgreSQL database and a private Redis queue, one
  ``packtune scheduler`` and N ``packtune worker`` processes, started and
  heartbeating before the study is created (a running service), the study
  inserted and the scheduler woken as the API would do it.

The database holds what the analysis needs: the study's ``created_at`` and
``finished_at``, and per pack ``created_at``, ``enqueued_at``,
``started_at``, ``finished_at`` and ``train_seconds`` (the time the job spent
in its arrays: data, memory probe, steps, per-epoch evaluation and
measurement writes, checkpoint saves).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_URL = os.environ.get(
    "PACKTUNE_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("PACKTUNE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")


def load_spec(path: Path) -> dict[str, Any]:
    """The spec file as written (``packtune run`` validates it)."""
    import yaml

    spec = yaml.safe_load(path.read_text())
    assert isinstance(spec, dict)
    return spec


def stored_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec as the API and ``packtune run`` store it: validated, defaults filled."""
    from packtune.spec import validate_spec

    return validate_spec(spec).model_dump(mode="json")


def variant(spec: dict[str, Any], packed: bool) -> dict[str, Any]:
    """The spec packed as written, or unpacked (``packing.max_pack_size: 1``)."""
    out = json.loads(json.dumps(spec))
    if not packed:
        out["packing"] = {**out.get("packing", {}), "max_pack_size": 1}
        out["name"] = f"{out['name']}-unpacked"
    return out


#: packtune settings a benchmark's ``--set KEY=VALUE`` gives every process it starts
EXTRA_SETTINGS: dict[str, str] = {}


def result_name(
    name: str,
    settings: dict[str, str],
    chosen: Sequence[tuple[Sequence[str], Sequence[str]]] = (),
) -> str:
    """A benchmark's JSON result's name: ``name``, then each of ``chosen``'s (chosen,
    default) lists that is not its default (a run of some modes does not replace the
    others' figures), sorted, then the settings of ``--set``; every character but letters,
    digits and ``._-`` (a mode's ``:``, a setting's path) made ``-``.

    >>> result_name("multi_study_cpu", {"checkpoint_dir": "/tmp/ck"}, [(["rq:2"], ["serve"])])
    'multi_study_cpu_rq-2_checkpoint_dir--tmp-ck'
    """
    for part, default in chosen:
        if sorted(part) != sorted(default):
            name += "".join(f"_{p}" for p in sorted(part))
    name += "".join(f"_{key}-{value}" for key, value in sorted(settings.items()))
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)


def parse_settings(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` pairs naming :class:`packtune.settings.Settings` fields (ValueError
    naming the first that is not one)."""
    from packtune.settings import Settings

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in Settings.model_fields:
            raise ValueError(f"--set {pair}: not KEY=VALUE with KEY a packtune setting")
        out[key] = value
    return out


def service_env(**settings: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACKTUNE_")}
    env.update({f"PACKTUNE_{k.upper()}": str(v) for k, v in settings.items() if v is not None})
    env.update({f"PACKTUNE_{k.upper()}": v for k, v in EXTRA_SETTINGS.items()})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "service", *args]


@dataclass
class StudyRun:
    """One finished study: what the bench measured and what the database says."""

    mode: str
    packed: bool
    process_seconds: float  # around the whole command (embedded) or study creation..finish (rq)
    study: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "packed": self.packed,
            "process_seconds": self.process_seconds,
            **self.study,
        }


def _seconds(a: datetime | None, b: datetime | None) -> float | None:
    return None if a is None or b is None else (b - a).total_seconds()


def read_study(database_url: str, study_id: int) -> dict[str, Any]:
    """The study's wall time, packs with timings, best trial and trained units."""
    from packtune.objective import value_of
    from service.db import make_engine
    from service.models import Pack, Study, Trial

    engine = make_engine(database_url)
    try:
        with Session(engine) as s:
            study = s.get(Study, study_id)
            assert study is not None
            t0 = study.created_at
            packs = []
            for p in s.scalars(sa.select(Pack).where(Pack.study_id == study_id).order_by(Pack.id)):
                packs.append({
                    "id": p.id, "status": str(p.status), "size": len(p.members),
                    "created": _seconds(t0, p.created_at), "enqueued": _seconds(t0, p.enqueued_at),
                    "started": _seconds(t0, p.started_at), "finished": _seconds(t0, p.finished_at),
                    "train_seconds": p.train_seconds, "worker": p.worker_name,
                })  # fmt: skip
            best: dict[str, Any] | None = None
            if study.best_trial_id is not None:
                trial = s.get(Trial, study.best_trial_id)
                assert trial is not None
                max_r = float(study.spec["hyperband"]["max_resource"])
                metric = study.spec["objective"]["metric"]
                values = [
                    value_of(m.metrics, metric)
                    for m in trial.measurements
                    if abs(m.resource - max_r) < 1e-9
                ]
                best = {
                    "sample_index": trial.sample_index,
                    "config": trial.config,
                    "value": values[-1] if values else None,
                }
            return {
                "study_id": study_id,
                "status": str(study.status),
                "wall_seconds": _seconds(study.created_at, study.finished_at),
                "packs": packs,
                "best": best,
            }
    finally:
        engine.dispose()


def breakdown(study: dict[str, Any], workers: int) -> dict[str, float]:
    """Where the study's wall time went, from the packs' timestamps.

    - ``train``: the jobs' ``train_seconds`` summed;
    - ``in_job_other``: the rest of the jobs' started..finished (claim, load, finish);
    - ``outside_jobs``: ``workers * wall`` minus the jobs' started..finished —
      scheduling, dispatch, queueing, process start, idle runners;
    - ``outside_training_share``: ``1 - train / (workers * wall)``.
    """
    wall = float(study["wall_seconds"] or 0.0)
    done = [p for p in study["packs"] if p["started"] is not None and p["finished"] is not None]
    in_jobs = sum(p["finished"] - p["started"] for p in done)
    train = sum(p["train_seconds"] or 0.0 for p in done)
    capacity = workers * wall
    waits = [p["started"] - p["enqueued"] for p in done if p["enqueued"] is not None]
    return {
        "wall": wall, "jobs": len(study["packs"]), "train": train,
        "in_job_other": in_jobs - train, "outside_jobs": capacity - in_jobs,
        "outside_training_share": 1 - train / capacity if capacity else float("nan"),
        "mean_queue_wait": sum(waits) / len(waits) if waits else 0.0,
    }  # fmt: skip


def run_embedded(spec: dict[str, Any], workdir: Path, device: str = "auto") -> StudyRun:
    """``packtune run`` on a fresh SQLite file; wall time around the whole command."""
    workdir.mkdir(parents=True, exist_ok=True)
    import yaml

    spec_path = workdir / "spec.yaml"  # YAML: PyYAML reads JSON's 1e-06 as a string
    spec_path.write_text(yaml.safe_dump(spec))
    url = f"sqlite:///{workdir / 'packtune.db'}"
    env = service_env(database_url=url, checkpoint_dir=workdir / "ckpt", device=device)
    start = time.perf_counter()
    proc = subprocess.run(
        cli("run", str(spec_path), "--top", "1"),
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"packtune run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return StudyRun("embedded", _packed(spec), seconds, read_study(url, 1))


def _packed(spec: dict[str, Any]) -> bool:
    return spec.get("packing", {}).get("max_pack_size") != 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_serve(
    env: dict[str, str], log: Path, timeout: float = 120
) -> tuple[subprocess.Popen[bytes], str]:
    """``packtune serve`` on a free port with ``env``, once it answers ``/healthz``: the
    process and the API's base URL (output appended to ``log``)."""
    import httpx

    port = free_port()
    with log.open("ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cli("serve", "--port", str(port)), env=env, stdout=out, stderr=out)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    # one client: each httpx.get builds its own, ~60 ms of CPU (its TLS context), taken
    # from the service starting beside it on a 2-core machine
    with httpx.Client(timeout=1) as client:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if client.get(f"{base}/healthz").status_code == 200:
                    return proc, base
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"packtune serve did not come up: {log.read_text()[-2000:]}")


def _post_and_wait(client: Any, spec: dict[str, Any], timeout: float) -> tuple[int, float]:
    """POST the study, poll it until it ends; its id and the seconds from POST to the end."""
    start = time.perf_counter()
    r = client.post("/api/studies", json=spec)
    if r.status_code != 201:
        raise RuntimeError(f"POST /api/studies: {r.status_code} {r.text[:500]}")
    study_id = int(r.json()["id"])
    while True:
        status = client.get(f"/api/studies/{study_id}").json()["status"]
        if status in ("completed", "failed", "cancelled"):
            return study_id, time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"study {study_id} did not finish in {timeout} s")
        time.sleep(0.1)


def run_serve(
    spec: dict[str, Any],
    workdir: Path,
    device: str = "auto",
    warm_up: dict[str, Any] | None = None,
    timeout: float = 900,
) -> StudyRun:
    """``packtune serve`` (embedded: SQLite, scheduler and runner in its child); the
    ``warm_up`` study first (not measured: the runner's start, the device and the
    workload's data, as in a service that has run a study before), then ``spec``."""
    import httpx

    workdir.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{workdir / 'packtune.db'}"
    env = service_env(
        database_url=url, checkpoint_dir=workdir / "ckpt", device=device, log_level="WARNING"
    )
    proc, base = start_serve(env, workdir / "service.log")
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            if warm_up is not None:
                _post_and_wait(client, warm_up, timeout)
            study_id, seconds = _post_and_wait(client, spec, timeout)
    finally:
        _stop([proc])
    return StudyRun("serve", _packed(spec), seconds, read_study(url, study_id))


@contextmanager
def fresh_postgres(server_url: str = POSTGRES_URL) -> Any:
    """A database of its own on the PostgreSQL server, dropped afterwards."""
    name = f"packtune_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.engine.make_url(server_url).set(database=name).render_as_string(False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class RQService:
    """A running RQ service: its database URL, a session factory on it, and how to submit a
    study (inserted, then the scheduler woken, as the API does after its commit)."""

    url: str
    factory: Any
    submit: Any


@contextmanager
def rq_service(
    workdir: Path, workers: int, device: str = "cpu", **settings: Any
) -> Iterator[RQService]:
    """A fresh PostgreSQL database + Redis + ``packtune scheduler`` + ``workers`` workers
    (extra ``settings`` in their environment), up once every worker has sent a heartbeat."""
    from packtune.settings import Settings
    from service import bus, store
    from service.db import make_engine, session_factory, session_scope
    from service.models import Worker

    workdir.mkdir(parents=True, exist_ok=True)
    with fresh_postgres() as url:
        queue = f"bench-{uuid.uuid4().hex}"
        env = service_env(database_url=url, redis_url=REDIS_URL, device=device,
                          checkpoint_dir=workdir / "ckpt", queue_name=queue,
                          heartbeat_interval=1, log_level="WARNING", **settings)  # fmt: skip
        subprocess.run(cli("db", "upgrade"), env=env, check=True, capture_output=True)
        log = (workdir / "service.log").open("ab")
        procs = [subprocess.Popen(cli("scheduler"), env=env, stdout=log, stderr=log)]
        procs += [
            subprocess.Popen(cli("worker", "--name", f"bench-{i}"), env=env, stdout=log, stderr=log)
            for i in range(workers)
        ]
        engine = make_engine(url)
        factory = session_factory(engine)
        wake = Settings(database_url=url, redis_url=REDIS_URL, queue_name=queue)

        def submit(spec: dict[str, Any]) -> int:
            body = stored_spec(spec)
            with session_scope(factory) as s:
                study_id = store.create_study(s, name=body["name"], workload=body["workload"],
                                              spec=body, seed=body["seed"]).id  # fmt: skip
            bus.study_changed(wake)
            return int(study_id)

        try:
            deadline = time.monotonic() + 120
            while True:  # the service is up: every worker has sent a heartbeat
                with session_scope(factory) as s:
                    if (s.scalar(sa.select(sa.func.count()).select_from(Worker)) or 0) >= workers:
                        break
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"the service did not come up; see {workdir}/service.log")
                time.sleep(0.2)
            yield RQService(url, factory, submit)
        finally:
            _stop(procs)
            engine.dispose()
            log.close()


def run_rq(
    spec: dict[str, Any], workdir: Path, workers: int, device: str = "cpu", timeout: float = 900
) -> StudyRun:
    """A study through PostgreSQL + Redis + ``packtune scheduler`` + ``workers`` workers."""
    from service.db import session_scope
    from service.models import Study, StudyStatus

    with rq_service(workdir, workers, device) as service:
        start = time.perf_counter()
        study_id = service.submit(spec)
        final = (StudyStatus.completed, StudyStatus.failed, StudyStatus.cancelled)
        while True:
            with session_scope(service.factory) as s:
                study = s.get(Study, study_id)
                if study is not None and study.status in final:
                    break
            if time.perf_counter() - start > timeout:
                raise TimeoutError(f"study {study_id} did not finish in {timeout} s")
            time.sleep(0.1)
        seconds = time.perf_counter() - start
        record = read_study(service.url, study_id)  # before the database is dropped
    return StudyRun(f"rq:{workers}", _packed(spec), seconds, record)
