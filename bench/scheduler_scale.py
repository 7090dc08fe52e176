"""Benchmark d: time and memory of ``Scheduler.tick()`` for a study of 10,000+ trials,
or for 20 studies of 12,000+ trials together (``--studies 20``).

A digits-mlp study with ``max_resource`` 6561 and eta 3 samples 10,582
trials (9 brackets). With ``--studies 20``: 5 studies with ``max_resource`` 729
(1,214 trials each) and 15 with 243 (415 each), 12,295 trials, all running at
once, so that every tick plans the ready trials of all of them together (fair
share, cross-study packs). The trials are created by the scheduler's own first
ticks (about 1,024 per tick; a tick also plans at most 2,048 units). A *recording*
dispatcher stands in for RQ (it records the packs it is handed and says they
are queued), and the bench plays the workers: after
each tick it completes every dispatched pack at once (measurements at the
unit's to-resource, trials paused at their rung or pending again after a
segment short of it, pack completed) — bulk SQL, not timed.
Eight fake GPU workers (8 x 80 GB) heartbeat, and a throughput profile makes
arrays of 256 the best size, so that the study moves through all its rungs.

The heap is collected and frozen before the first tick, as the scheduler's
process does (``service.runtime.settle_heap``). Per tick: wall seconds (no
tracemalloc), and in a second identical pass the tracemalloc peak. Peak RSS of
the process is reported too. Both on SQLite (a file) and PostgreSQL (a fresh
database).

    python -m bench.scheduler_scale
    python -m bench.scheduler_scale --studies 20 # 20 studies, 12,295 trials
    python -m bench.scheduler_scale --quick      # a ~100-trial study; writes nothing
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import resource
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from bench import recording
from bench._study import fresh_postgres
from packtune.dispatcher import JobState
from packtune.rungs import rung_resource
from packtune.settings import Settings
from packtune.space import fusion_key
from packtune.spec import StoredSpec
from packtune.workloads import get_workload
from service import store
from service.db import make_engine, session_factory, session_scope, upgrade
from service.models import (
    Measurement,
    Pack,
    PackMember,
    PackStatus,
    Study,
    StudyStatus,
    Trial,
    TrialStatus,
    utcnow,
)
from service.runtime import settle_heap
from service.scheduler import Scheduler

DEVICE_KIND = "NVIDIA H100 80GB HBM3"
SPACE: dict[str, dict[str, Any]] = {
    "lr": {"type": "loguniform", "low": 0.001, "high": 0.5},
    "momentum": {"type": "uniform", "low": 0.0, "high": 0.95},
    "hidden": {"type": "choice", "values": [64, 128]},
}


def spec(max_resource: int, name: str | None = None) -> dict[str, Any]:
    return {"name": name or f"scale-{max_resource}", "workload": "digits-mlp",
            "objective": {"metric": "val_loss", "mode": "min"}, "space": SPACE,
            "hyperband": {"max_resource": max_resource, "min_resource": 1, "eta": 3},
            "packing": {"enabled": True, "max_pack_size": None}, "seed": 0}  # fmt: skip


class RecordingDispatcher:
    """Takes packs without running them; every job it was given stays ``queued``."""

    embedded_workers: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.jobs: dict[str, int] = {}

    def enqueue(self, pack_id: int, job_id: str) -> None:
        self.jobs[job_id] = pack_id

    def enqueue_check(self, check_id: int, job_id: str) -> None:
        self.jobs[job_id] = check_id

    def state(self, job_id: str) -> tuple[JobState, str | None]:
        return (JobState.queued if job_id in self.jobs else JobState.missing), None

    notify: Callable[[], None] | None = None

    def start(self, workload: str | None = None) -> None:
        pass

    def runner_statuses(self) -> list[dict[str, Any]]:
        return []

    def nudge(self) -> None:
        pass

    def close(self) -> None:
        pass


def fake_fleet(factory: sessionmaker[Session], workers: int, gpus: int) -> None:
    """Heartbeats of ``workers`` hosts with ``gpus`` idle 80 GB GPUs each, and a profile."""
    wl = get_workload("digits-mlp")
    with session_scope(factory) as s:
        for w in range(workers):
            readings = [
                {
                    "index": g,
                    "name": DEVICE_KIND,
                    "memory_total": 80 * 10**9,
                    "memory_free": 79 * 10**9,
                    "utilization": 0,
                }
                for g in range(gpus)
            ]
            store.heartbeat(
                s, name=f"gpu-host-{w}", host=f"host-{w}", device_kind=DEVICE_KIND, gpus=readings
            )
        for hidden in SPACE["hidden"]["values"]:
            key = fusion_key(wl.name, wl.resolve({"hidden": hidden}), wl.structural_params())
            store.set_memory_model(s, wl.name, key, DEVICE_KIND, 2**30, 64 * 2**20)
            for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):  # +50% per doubling up to 256
                value = 1000.0 * k**0.6 if k <= 256 else 1000.0 * 256**0.6 * 1.02
                store.record_throughput(s, wl.name, key, DEVICE_KIND, k, value)


def complete_dispatched(factory: sessionmaker[Session], rng: random.Random) -> int:
    """Play the workers: finish every queued pack at once; returns the packs finished."""
    with session_scope(factory) as s:
        packs = list(s.scalars(sa.select(Pack).where(Pack.status == PackStatus.queued)))
        if not packs:
            return 0
        ids = [p.id for p in packs]
        members = list(s.scalars(sa.select(PackMember).where(PackMember.pack_id.in_(ids))))
        to = {m.trial_id: m.to_resource for m in members}
        trials = list(
            s.execute(
                sa.select(Trial.id, Trial.study_id, Trial.bracket, Trial.rung).where(
                    Trial.id.in_(list(to))
                )
            )
        )
        specs = {i: StoredSpec.of(s.get_one(Study, i).spec) for i in {row[1] for row in trials}}
        # as the worker does: paused at the trial's rung, pending after a segment short of it
        at_rung = {tid: to[tid] >= rung_resource(specs[sid], b, r) for tid, sid, b, r in trials}
        losses = {tid: 2.0 / (1 + math.log1p(r)) + rng.random() for tid, r in to.items()}
        rows = [{"trial_id": tid, "resource": to[tid], "metrics": {"val_loss": loss}}
                for tid, loss in losses.items()]  # fmt: skip
        s.execute(sa.insert(Measurement), rows)
        for tid, loss in losses.items():  # what store.record_measurement keeps, for ranking
            status = TrialStatus.paused if at_rung[tid] else TrialStatus.pending
            s.execute(
                sa.update(Trial)
                .where(Trial.id == tid)
                .values(
                    status=status,
                    resource_done=to[tid],
                    measured_resource=to[tid],
                    objective=loss,
                )
            )
        s.execute(
            sa.update(Pack)
            .where(Pack.id.in_(ids))
            .values(
                status=PackStatus.completed,
                started_at=utcnow(),
                finished_at=utcnow(),
                train_seconds=1.0,
            )
        )
        return len(packs)


@contextmanager
def database(backend: str) -> Iterator[str]:
    if backend == "postgresql":
        with fresh_postgres() as url:
            yield url
    else:
        with tempfile.TemporaryDirectory(prefix="packtune-scale-") as tmp:
            yield f"sqlite:///{Path(tmp) / 'scale.db'}"


def fleet_sizes(studies: int, max_resource: int) -> list[int]:
    """``max_resource`` of each study: one study of ``max_resource``, or a quarter of the
    studies at 729 and the rest at 243 (``--quick``: 9 and 3)."""
    if studies == 1:
        return [max_resource]
    big, small = (9, 3) if max_resource <= 27 else (729, 243)
    return [big if i < studies // 4 else small for i in range(studies)]


def one_pass(
    backend: str, max_resource: int, trace: bool, max_ticks: int, studies: int = 1
) -> dict[str, Any]:
    """Whole simulated studies; per tick seconds (or tracemalloc peak bytes when ``trace``)."""
    with database(backend) as url:
        upgrade(url)
        engine = make_engine(url)
        factory = session_factory(engine)
        settings = Settings(database_url=url, heartbeat_timeout=10**6)
        fake_fleet(factory, workers=1, gpus=8)
        ids = []
        with session_scope(factory) as s:
            for i, size in enumerate(fleet_sizes(studies, max_resource)):
                body = spec(size, name=f"scale-{size}-{i}" if studies > 1 else None)
                ids.append(
                    store.create_study(
                        s, name=body["name"], workload=body["workload"], spec=body, seed=0
                    ).id
                )
        scheduler = Scheduler(settings, factory=factory, dispatcher=RecordingDispatcher(),
                              holder="bench")  # fmt: skip
        settle_heap()  # as the scheduler's process does before its first tick
        statements = [0]

        def count(*_: Any) -> None:
            statements[0] += 1

        sa.event.listen(engine, "before_cursor_execute", count)
        rng = random.Random(0)
        ticks: list[dict[str, Any]] = []
        done: set[int] = set()
        try:
            for n in range(max_ticks):
                if trace:
                    tracemalloc.reset_peak()
                statements[0] = 0
                start = time.perf_counter()
                report = scheduler.tick()
                seconds = time.perf_counter() - start
                issued = statements[0]
                peak = tracemalloc.get_traced_memory()[1] if trace else None
                finished = complete_dispatched(factory, rng)
                ticks.append({"tick": n, "seconds": seconds, "peak_bytes": peak, "sql": issued,
                              "planned": report.planned, "dispatched": report.dispatched,
                              "finished_after": finished})  # fmt: skip
                done.update(report.finished_studies)
                if done >= set(ids):
                    break
            with session_scope(factory) as s:
                statuses = {str(s.get_one(Study, i).status) for i in ids}
                status = statuses.pop() if len(statuses) == 1 else "mixed"
                trials = s.scalar(sa.select(sa.func.count()).select_from(Trial)) or 0
                packs = s.scalar(sa.select(sa.func.count()).select_from(Pack)) or 0
        finally:
            scheduler.close()
            engine.dispose()
            gc.unfreeze()  # the next pass starts as this one did
    assert status == StudyStatus.completed or len(ticks) == max_ticks, status
    return {"ticks": ticks, "status": status, "trials": trials, "packs": packs,
            "studies": len(ids)}  # fmt: skip


def summarise(backend: str, timed: dict[str, Any], traced: dict[str, Any]) -> list[Any]:
    seconds = [t["seconds"] for t in timed["ticks"]]
    busy = [t["seconds"] for t in timed["ticks"][1:] if t["dispatched"] or t["planned"]]
    peak = max((t["peak_bytes"] or 0) for t in traced["ticks"])
    sql = [t["sql"] for t in timed["ticks"][1:]]
    return [
        backend,
        timed["trials"],
        timed["packs"],
        len(seconds),
        f"{seconds[0]:.2f}",
        f"{recording.median(seconds[1:]):.3f}",
        f"{recording.median(busy):.3f}",
        f"{max(seconds):.3f}",
        f"{recording.median(sql):.0f} / {max(sql)}",
        f"{peak / 2**20:.0f}",
        timed["status"],
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-resource", type=int, default=6561)
    parser.add_argument(
        "--backends", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"]
    )
    parser.add_argument("--max-ticks", type=int, default=200)
    parser.add_argument(
        "--studies", type=int, default=1, help="1, or N studies of mixed sizes at once"
    )
    parser.add_argument("--quick", action="store_true", help="max_resource 27; appends nothing")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_resource = 27
    load = recording.load_average()
    info = recording.machine("cpu")
    rows, raw = [], {}
    for backend in args.backends:
        timed = one_pass(backend, args.max_resource, False, args.max_ticks, args.studies)
        tracemalloc.start()
        try:
            traced = one_pass(backend, args.max_resource, True, args.max_ticks, args.studies)
        finally:
            tracemalloc.stop()
        raw[backend] = {"timed": timed, "traced": traced}
        rows.append(summarise(backend, timed, traced))
        print(rows[-1], flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    header = [
        "database",
        "trials",
        "packs",
        "ticks",
        "first tick (s: sampling)",
        "median tick (s)",
        "median busy tick (s)",
        "max tick (s)",
        "SQL statements per tick (median / max)",
        "tracemalloc peak in a tick (MiB)",
        "study",
    ]
    body = [
        *recording.table(header, rows),
        "",
        f"Peak RSS of the bench process: {rss:.0f} MiB (both databases, both passes). "
        "A busy tick planned or dispatched packs; the others only reconciled and "
        "checked rungs. 8 fake 80 GB GPUs; arrays of up to 256 trials.",
    ]
    print("\n".join(body))
    if args.quick and args.out_dir is None:
        return
    name = "scheduler_scale" if args.studies == 1 else f"scheduler_scale_studies{args.studies}"
    recording.save_json(name, {"machine": info, "date": recording.now(),
                                          "command": recording.command_line(), "raw": raw},
                      args.out_dir)  # fmt: skip
    if not (args.quick or args.no_append):
        recording.append_section(
            f"d. Scheduler scale — max_resource {args.max_resource}, eta 3"
            if args.studies == 1
            else f"d. Scheduler scale — {args.studies} studies at once, eta 3",
            info,
            body,
            load,
        )


if __name__ == "__main__":
    main()
