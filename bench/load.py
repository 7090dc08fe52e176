"""Load on the read endpoints: many dashboard clients while a study trains.

    python -m bench.load [--clients 100] [--requests 50] [--think 1.0] [--duration 120]
                         [--database-url URL] [--trials 10000] [--train small|big] [--results]

What it does, all on this machine (loopback only):

1. makes a database (a fresh SQLite file, or the empty PostgreSQL database
   given) and writes a finished Hyperband study of about ``--trials`` trials
   straight through :mod:`service.store` (trials, a measurement per rung
   reached, promotions, packs), in seconds rather than by training;
2. starts ``packtune serve`` on a free loopback port and submits a small real
   study (digits-mlp, 17 trials); whenever one finishes, the next is submitted,
   so that a study trains for as long as the load runs. With ``--train big``
   the study that trains is a second one of ``--trials`` trials instead (it
   does not finish in the run): the scheduler then samples, decides and plans
   over thousands of trials while the clients read, and the clients' GETs on
   "the small study" go to it (its brackets, all its trials, are left out of
   the mix);
3. runs ``--clients`` concurrent clients (asyncio + httpx, one connection
   each). Each sends ``--requests`` GETs drawn from a dashboard-like mix of
   read endpoints on both studies, waiting a random ``0..2 x --think`` seconds
   between two (``--think 0``: back to back, to find saturation). The run is
   bounded by the request count and by ``--duration`` seconds;
4. prints p50/p90/p99/max latency overall and per endpoint and the errors
   (any status other than 200, or a transport error); with ``--results``
   appends them to ``bench/HISTORY.md`` with the machine, command and date, and saves
   the overall figures to ``bench/results/load_<database>.json``.

A latency is measured in the clients' event loop, from just before a GET is
sent to when its response has been read, so a loop busy elsewhere would add to
it. Two things keep that honest: the clients share one TLS context (httpx builds
one per client otherwise: ~85 ms each on a slow CPU, so 100 clients blocked the
loop for ~9 s and then sent their first GETs all at once), and a task measures
how late the loop wakes from a 5 ms sleep; its p99 and max are printed with the
latencies, per 20 s window too. When they are small next to a window's p99 the
tail is the server's.

Exit status 1 if any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import platform
import random
import shlex
import ssl
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import recording
from bench._study import start_serve
from bench.recording import cpu_model

HISTORY_MD = Path(__file__).resolve().parent / "HISTORY.md"
SMALL_STUDY: dict[str, Any] = {
    "name": "load-small",
    "workload": "digits-mlp",
    "space": {"lr": {"type": "loguniform", "low": 0.005, "high": 0.5}},
    "hyperband": {"max_resource": 9, "eta": 3},
    "seed": 0,
}


# -- the big study ------------------------------------------------------------------------


def big_spec(trials: int) -> dict[str, Any]:
    """A digits-mlp spec whose Hyperband plan samples at least ``trials`` trials (eta 3)."""
    from packtune.hyperband import plan_brackets, total_trials

    resource = 1
    while total_trials(plan_brackets(resource, 3)) < trials and resource < 6561:
        resource *= 3
    return {
        "name": "load-big",
        "workload": "digits-mlp",
        "objective": {"metric": "val_loss", "mode": "min"},
        "space": {"lr": {"type": "loguniform", "low": 1e-4, "high": 0.3}},
        "hyperband": {"max_resource": resource, "min_resource": 1, "eta": 3},
        "packing": {"enabled": True, "max_pack_size": 16},
        "seed": 0,
    }


def seed_big_study(url: str, trials: int) -> tuple[int, int]:
    """Write a finished study as Hyperband would have left it; returns (id, trials)."""
    from sqlalchemy import insert

    from packtune.hyperband import plan_brackets
    from service import store
    from service.db import make_engine, session_factory, session_scope
    from service.models import Measurement, PackStatus, StudyStatus, TrialStatus, utcnow

    spec = big_spec(trials)
    rng = random.Random(0)
    hb = spec["hyperband"]
    plan = plan_brackets(hb["max_resource"], hb["eta"])
    key = 'digits-mlp|{"hidden":64}'
    engine = make_engine(url)
    try:
        with session_scope(session_factory(engine)) as s:
            study = store.create_study(s, name="load-big", workload="digits-mlp", spec=spec, seed=0)
            rows, index = [], 0
            for j, rungs in enumerate(plan):
                for _ in range(rungs[0].n):
                    lr = 10 ** rng.uniform(-4, -0.5)
                    rows.append({"sample_index": index, "bracket": len(plan) - 1 - j, "rung": 0,
                                 "config": {"lr": lr}, "fusion_key": key})  # fmt: skip
                    index += 1
            store.add_trials(s, study.id, rows)
            by_bracket: dict[int, list[Any]] = defaultdict(list)
            for t in store.trials_of(s, study.id):
                by_bracket[t.bracket].append(t)
            measurements = []
            for j, rungs in enumerate(plan):
                alive = by_bracket[len(plan) - 1 - j]
                for i, rung in enumerate(rungs):
                    alive = sorted(alive, key=lambda t: t.config["lr"])[: rung.n]
                    if i > 0:
                        store.record_promotions(
                            s, study.id, alive[0].bracket, i - 1, [(t.id, None) for t in alive]
                        )
                    for t in alive:
                        loss = 2.0 / (1 + rung.resource) + rng.random() * 0.1
                        t.rung, t.resource_done = i, rung.resource
                        t.measured_resource, t.objective = rung.resource, loss
                        measurements.append({"trial_id": t.id, "resource": rung.resource,
                                             "metrics": {"val_loss": loss, "train_loss": loss},
                                             "created_at": utcnow()})  # fmt: skip
                        pack_members = [(t.id, key, 0.0, rung.resource)]
                        if rng.random() < 0.1:  # some packs, with timing, for /packs
                            pack = store.create_pack(s, study_id=study.id, members=pack_members)
                            store.move_pack(s, pack, PackStatus.running)
                            store.finish_pack(s, pack, PackStatus.completed, train_seconds=1.0)
                for t in by_bracket[len(plan) - 1 - j]:
                    last = t.rung == len(rungs) - 1
                    t.status = TrialStatus.completed if last else TrialStatus.stopped
            s.execute(insert(Measurement), measurements)
            store.move_study(s, study, StudyStatus.running)
            store.move_study(s, study, StudyStatus.completed)
        if engine.dialect.name == "postgresql":
            # what autovacuum does within a minute or so of such writes; without it the
            # planner still believes the trials table is nearly empty and sorts 10,000 rows
            # for a page of 100 (10 ms instead of 0.7 ms)
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.exec_driver_sql("VACUUM ANALYZE")
        return study.id, index
    finally:
        engine.dispose()


def training_big(trials: int) -> dict[str, Any]:
    """``--train big``: a study like the seeded one, to train (sampled by the scheduler)."""
    return {**big_spec(trials), "name": "load-running"}


# -- the load ------------------------------------------------------------------------------


@dataclass
class Load:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: list[str] = field(default_factory=list)
    retried: int = 0  # GETs sent again on a fresh connection (see ``client``)
    seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (sent at, latency) s
    wall: float = field(default_factory=time.time)  # when the load started, epoch seconds
    small_done: float | None = None  # when the first training study finished, s after the start
    trained: list[int] = field(default_factory=list)  # studies trained to the end meanwhile
    loop_lag: list[tuple[float, float]] = field(default_factory=list)  # (at, how late) s


def requests_for(
    big: int, small: int, trials: int, rng: random.Random, brackets: bool = True
) -> tuple[str, str]:
    """One GET a dashboard might send: (endpoint name, path with query)."""
    study = big if rng.random() < 0.7 else small
    which = rng.choices(
        ["summary", "leaderboard", "trials page", "packs", "curves", "studies", "workers",
         "health", "brackets"],
        weights=[20, 20, 15, 10, 15, 8, 6, 3, 3 if brackets else 0],
    )[0]  # fmt: skip
    if which == "brackets":
        study = small  # the big study's brackets list all 10,000 trials: not a poll
    paths = {
        "summary": f"/api/studies/{study}",
        "leaderboard": f"/api/studies/{study}/leaderboard?limit=20",
        "trials page": f"/api/studies/{study}/trials?limit=100&offset={rng.randrange(trials)}",
        "packs": f"/api/studies/{study}/packs?limit=50",
        "curves": f"/api/studies/{study}/curves?"
        + "&".join(f"trial_id={rng.randrange(1, trials)}" for _ in range(5)),
        "studies": "/api/studies",
        "workers": "/api/workers",
        "health": "/healthz",
        "brackets": f"/api/studies/{study}/brackets",
    }
    return which, paths[which]


async def client(
    base: str, ids: tuple[int, int, int], count: int, think: float, deadline: float,
    load: Load, seed: int, tls: ssl.SSLContext, brackets: bool,
) -> None:  # fmt: skip
    rng = random.Random(seed)
    big, small, trials = ids
    async with httpx.AsyncClient(base_url=base, timeout=30, verify=tls) as http:
        await asyncio.sleep(rng.random() * think)  # clients do not all start at once
        for _ in range(count):
            if time.monotonic() > deadline:
                return
            name, path = requests_for(big, small, trials, rng, brackets)
            started = time.perf_counter()
            try:
                try:
                    response = await http.get(path)
                except (httpx.ReadError, httpx.RemoteProtocolError):
                    # the server closed the idle keep-alive connection as we reused it
                    # (uvicorn closes them after 5 s): a client sends a GET again
                    load.retried += 1
                    response = await http.get(path)
                if response.status_code != 200:
                    load.errors.append(f"{path}: {response.status_code} {response.text[:200]}")
            except httpx.HTTPError as exc:
                load.errors.append(f"{path}: {type(exc).__name__}: {exc}")
            load.latencies[name].append(time.perf_counter() - started)
            load.timeline.append((started - load.started, time.perf_counter() - started))
            await asyncio.sleep(rng.uniform(0, 2 * think))


async def run_load(
    base: str, ids: tuple[int, int, int], clients: int, requests: int, think: float,
    duration: float, training: dict[str, Any] = SMALL_STUDY,
) -> Load:  # fmt: skip
    """``clients`` concurrent clients of ``requests`` GETs each, for ``duration`` s at most,
    while study ``ids[1]`` trains, and another like ``training`` after it (``--train``)."""
    if not base.startswith(("http://127.", "http://localhost", "http://[::1]")):
        raise ValueError(f"loopback addresses only, not {base}")
    gc.collect()
    gc.freeze()  # its own full collections would stall the clients (see service.api.app)
    load = Load()
    started = time.monotonic()
    deadline = started + duration
    done = asyncio.Event()
    tls = ssl.create_default_context()  # unused over http://, but httpx builds one per client
    trainer = asyncio.create_task(keep_training(base, ids[1], training, done, load))
    monitor = asyncio.create_task(watch_loop(done, load))
    brackets = training is SMALL_STUDY  # a big study's brackets list all its trials: no poll
    await asyncio.gather(
        *(client(base, ids, requests, think, deadline, load, seed, tls, brackets)
          for seed in range(clients))
    )  # fmt: skip
    load.seconds = time.monotonic() - started
    done.set()
    await trainer
    await monitor
    return load


async def watch_loop(done: asyncio.Event, load: Load, every: float = 0.005) -> None:
    """Record how late the event loop wakes from ``every`` s sleeps: the share of a latency
    that is the load generator's own (a callback holding the loop), not the server's."""
    while not done.is_set():
        asked = time.perf_counter()
        await asyncio.sleep(every)
        woke = time.perf_counter()
        load.loop_lag.append((asked - load.started, max(0.0, woke - asked - every)))


async def keep_training(
    base: str, first: int, training: dict[str, Any], done: asyncio.Event, load: Load
) -> None:
    """Keep a study training while the clients read: when one finishes, submit the next.

    Its GETs (every second) and POSTs are not counted in the latencies.
    """
    current = first
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        while not done.is_set():
            state = (await http.get(f"/api/studies/{current}")).json()["status"]
            if state not in ("pending", "running"):
                load.trained.append(current)
                spec = {**training, "name": f"{training['name']}-{len(load.trained) + 1}"}
                current = (await http.post("/api/studies", json=spec)).json()["id"]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=1.0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary(load: Load) -> list[tuple[str, int, float, float, float, float]]:
    """(endpoint, requests, p50, p90, p99, max) in milliseconds, overall first."""
    every = [v for values in load.latencies.values() for v in values]
    rows = [("all", every), *sorted(load.latencies.items())]
    out = []
    for name, v in rows:
        if v:
            p50, p90, p99 = (1000 * percentile(v, q) for q in (0.5, 0.9, 0.99))
            out.append((name, len(v), p50, p90, p99, 1000 * max(v)))
    return out


def windows(load: Load, width: float = 20.0) -> list[tuple[float, int, float, float, float, float]]:
    """(window start s, requests, p50, p99, max, the client loop's largest lag) in
    milliseconds per ``width`` s of the run."""
    buckets: dict[int, list[float]] = defaultdict(list)
    for sent, latency in load.timeline:
        buckets[int(sent // width)].append(latency)
    lags: dict[int, float] = defaultdict(float)
    for at, lag in load.loop_lag:
        lags[int(at // width)] = max(lags[int(at // width)], lag)
    return [
        (i * width, len(v), 1000 * percentile(v, 0.5), 1000 * percentile(v, 0.99),
         1000 * max(v), 1000 * lags[i])
        for i, v in sorted(buckets.items())
    ]  # fmt: skip


def loop_lag(load: Load) -> tuple[float, float]:
    """The client loop's lag, p99 and max, in milliseconds."""
    lags = [lag for _, lag in load.loop_lag]
    return 1000 * percentile(lags, 0.99), 1000 * max(lags, default=float("nan"))


# -- the server ----------------------------------------------------------------------------


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def append_results(args: argparse.Namespace, load: Load, ids: tuple[int, int, int]) -> None:
    total = sum(len(v) for v in load.latencies.values())
    lag_p99, lag_max = loop_lag(load)
    trains = (
        "digits-mlp studies of 17 trials one after the other"
        if args.train == "small"
        else f"a digits-mlp study of {ids[2]} trials like it (its first rungs)"
    )
    lines = [
        "",
        f"## Read endpoints under load ({args.clients} client{'s' * (args.clients != 1)}, "
        f"think {args.think} s)",
        "",
        f"- machine: {platform.node()}, {cpu_model()} ({os.cpu_count()} cores), Python "
        f"{platform.python_version()}; database {args.database_url or 'SQLite file'}",
        f"- command: `python -m bench.load {shlex.join(sys.argv[1:])}`",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M UTC}; load average after: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- database: a finished study of {ids[2]} trials (written by the store, not trained); "
        f"meanwhile `packtune serve` trains {trains} ({len(load.trained)} finished during the "
        "run)",
        f"- {total} requests in {load.seconds:.1f} s ({total / load.seconds:.0f}/s), "
        f"errors: {len(load.errors)}, sent again after a closed keep-alive connection: "
        f"{load.retried}; the load generator's event loop woke late by {lag_p99:.1f} ms at p99, "
        f"{lag_max:.1f} ms at most",
        "",
        "| endpoint | requests | p50 ms | p90 ms | p99 ms | max ms |",
        "|---|---|---|---|---|---|",
        *(f"| {n} | {c} | {a:.1f} | {b:.1f} | {d:.1f} | {m:.1f} |" for n, c, a, b, d, m in
          summary(load)),
        "",
        f"Over time, by when the GET was sent ({trains} trained all the while):",
        "",
        "| from s | requests | p50 ms | p99 ms | max ms | client loop lag max ms |",
        "|---|---|---|---|---|---|",
        *(f"| {t:.0f} | {c} | {a:.1f} | {d:.1f} | {m:.1f} | {g:.1f} |"
          for t, c, a, d, m, g in windows(load)),
    ]  # fmt: skip
    with HISTORY_MD.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    overall = summary(load)[0]  # ("all", requests, p50, p90, p99, max), in ms
    database = "postgresql" if args.database_url else "sqlite"
    recording.save_json(f"load_{database}", {
        "command": f"python -m bench.load {shlex.join(sys.argv[1:])}",
        "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}",
        "machine": recording.machine("cpu"),
        "clients": args.clients,
        "database": database,
        "requests": total,
        "errors": len(load.errors),
        "p50_ms": overall[2],
        "p99_ms": overall[4],
        "endpoints": summary(load),
    })  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.load", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--requests", type=int, default=50, help="GETs per client")
    parser.add_argument("--think", type=float, default=1.0, help="mean seconds between GETs")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds at most")
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--database-url", help="an empty PostgreSQL database (default: SQLite)")
    parser.add_argument(
        "--train", choices=["small", "big"], default="small",
        help="the study that trains meanwhile: small ones in turn, or one of --trials trials",
    )  # fmt: skip
    parser.add_argument(
        "--results", action="store_true",
        help="append to bench/HISTORY.md, save bench/results/load_<database>.json",
    )  # fmt: skip
    args = parser.parse_args(argv)

    from service.db import upgrade

    tmp = Path(tempfile.mkdtemp(prefix="packtune-load-"))
    url = args.database_url or f"sqlite:///{tmp / 'packtune.db'}"
    upgrade(url)
    started = time.monotonic()
    big, trials = seed_big_study(url, args.trials)
    print(f"study {big}: {trials} trials written in {time.monotonic() - started:.1f} s")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACKTUNE_")}
    env.update(PACKTUNE_DATABASE_URL=url, PACKTUNE_CHECKPOINT_DIR=str(tmp / "ckpt"),
               PACKTUNE_LOG_LEVEL="WARNING")  # fmt: skip
    proc, base = start_serve(env, tmp / "serve.log", timeout=60)
    try:
        training = SMALL_STUDY if args.train == "small" else training_big(args.trials)
        small = httpx.post(f"{base}/api/studies", json=training, timeout=30).json()["id"]
        ids = (big, small, trials)
        load = asyncio.run(
            run_load(base, ids, args.clients, args.requests, args.think, args.duration, training)
        )
        doc = httpx.get(f"{base}/api/studies/{small}", timeout=60).json()
    finally:
        stop(proc)
    if doc.get("finished_at"):
        load.small_done = datetime.fromisoformat(doc["finished_at"]).timestamp() - load.wall
    print(f"{sum(len(v) for v in load.latencies.values())} requests in {load.seconds:.1f} s; "
          f"errors: {len(load.errors)}; sent again: {load.retried}; the first training study "
          f"was {doc['status']} at the end (finished {load.small_done or 0:.0f} s in); "
          f"{len(load.trained)} training studies trained to the end meanwhile")  # fmt: skip
    print(f"{'endpoint':<12} {'n':>6} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}  (ms)")
    for name, n, p50, p90, p99, top in summary(load):
        print(f"{name:<12} {n:>6} {p50:>8.1f} {p90:>8.1f} {p99:>8.1f} {top:>8.1f}")
    lag_p99, lag_max = loop_lag(load)
    print(f"the client event loop woke late by {lag_p99:.1f} ms at p99, {lag_max:.1f} ms at most")
    print(f"{'from s':>8} {'n':>6} {'p50':>8} {'p99':>8} {'max':>8} {'lag':>8}  "
          "(ms, by when sent; lag: the client loop's largest)")  # fmt: skip
    for t, c, a, d, m, g in windows(load):
        print(f"{t:>8.0f} {c:>6} {a:>8.1f} {d:>8.1f} {m:>8.1f} {g:>8.1f}")
    for error in load.errors[:10]:
        print("error:", error)
    if args.results:
        append_results(args, load, ids)
    return 1 if load.errors else 0


if __name__ == "__main__":
    sys.exit(main())
