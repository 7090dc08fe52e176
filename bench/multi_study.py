"""Benchmark g: many studies on one fleet, submitted at once and staggered.

Eight studies of mixed sizes and two workloads (``digits-mlp`` from
``examples/digits-mlp.yaml``, ``synthetic-mlp`` from ``examples/synthetic-mlp.yaml``;
Hyperband ``max_resource`` 81, 27, 9 or 3: 5 to 143 trials; distinct search spaces; all
but one with seed 0, so that units of the same workload and horizon may fuse) run on one
fleet:

- ``serve``: ``packtune serve`` with SQLite (the embedded default: one runner; with
  ``--runners N``, N in the ``new`` variant), the studies POSTed to its API;
- ``rq:N``: PostgreSQL + Redis + one ``packtune scheduler`` + N ``packtune worker``, the
  studies inserted and the scheduler woken as the API does.

Per mode, each run on a fresh service and database (a warm-up study of each workload first,
not measured):

- ``sequential``: today's scheduler (``PACKTUNE_SHARE_PACKS=false``,
  ``PACKTUNE_DISPATCH_ORDER=id``), each study submitted once the one before has finished:
  the baseline, and each study's time alone;
- ``today``: today's scheduler, the studies submitted ``at-once`` or ``staggered`` (the
  large study first, the others every ``--stagger`` seconds);
- ``new``: the defaults (cross-study packs and fusion, weighted fair share then
  longest-remaining-first), the same patterns; with ``--runners N``, serve's ``new`` has N
  embedded runners (``PACKTUNE_EMBEDDED_RUNNERS``; busy counts N workers);
- pattern ``behind``: only the large study, then the small one ``--stagger`` seconds
  later (the target's case: a small study submitted behind a large one finishes within
  2x its time alone).

Reported per run: makespan (first study created to last finished, from the database),
each study's completion time (its ``created_at`` to ``finished_at``) and their mean, the
device busy fraction (Σ over the packs of ``finished_at - started_at`` / (workers x
makespan)), packs, packs that held trials of more than one study, fused stacks whose
trials came from more than one study, and each study's best val_loss. Ratios: sequential
makespan (the sum of the times alone) / new, today / new, and the small study's completion
time / its time alone. With ``--repeats N`` every run is made N times, in turn; each ratio
is taken within one repeat (its own studies alone) and the median of the N is reported,
with the N beside it.

    python -m bench.multi_study                        # serve and rq:2; HISTORY.md, results/
    python -m bench.multi_study --modes serve --variants sequential new
    python -m bench.multi_study --repeats 3            # each run 3 times: medians of paired ratios
    python -m bench.multi_study --quick                # three tiny studies; writes nothing
    python -m bench.multi_study --modes rq:2 --set preempt=false --no-append
                                                       # a setting for new (out of RESULTS.md)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from bench import _study, recording
from bench._study import (
    ROOT,
    _stop,
    load_spec,
    parse_settings,
    rq_service,
    service_env,
    start_serve,
)

EXAMPLES = ROOT / "examples"
#: today's scheduler: one study per pack, studies and packs by id
TODAY = {"share_packs": "false", "dispatch_order": "id"}
#: the defaults (set explicitly, so that a changed default does not change the benchmark)
NEW = {"share_packs": "true", "dispatch_order": "fair"}
SETTINGS = {"sequential": TODAY, "today": TODAY, "new": NEW}
VARIANTS = ("sequential", "today", "new")
#: the modes, variants and patterns a run measures unless told otherwise
MODES = ("serve", "rq:2")
#: the settings each service gets from the bench itself (not ``--set``'s to give)
BENCH_SETTINGS = frozenset({
    "database_url", "redis_url", "device", "checkpoint_dir", "queue_name",
    "heartbeat_interval", "log_level", "embedded_runners", *TODAY, *NEW,
})  # fmt: skip
#: behind: only the large study, then the small one --stagger seconds later (the target's case)
PATTERNS = ("at-once", "staggered", "behind")
FINAL = ("completed", "failed", "cancelled")
IGNORED = " The service had no share_packs / dispatch_order settings: new ran today's scheduler."


@dataclass(frozen=True)
class Member:
    """One study of the fleet: an example spec with its size, seed and space changed."""

    name: str
    example: str
    max_resource: int
    seed: int = 0
    space: dict[str, Any] = field(default_factory=dict)
    small: bool = False  # the small study submitted behind a large one (the 2x target)

    def spec(self) -> dict[str, Any]:
        spec = load_spec(EXAMPLES / self.example)
        spec["name"] = self.name
        spec["hyperband"] = {**spec["hyperband"], "max_resource": self.max_resource}
        spec["seed"] = self.seed
        spec["space"] = {**spec["space"], **self.space}
        return spec

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "example": self.example, "max_resource": self.max_resource,
                "seed": self.seed, "space": self.space, "small": self.small}  # fmt: skip


LOG_WD = {"type": "loguniform", "low": 0.00001, "high": 0.01}
HIGH_MOMENTUM = {"type": "uniform", "low": 0.5, "high": 0.99}
#: submitted in this order (staggered: the first, large, at 0 s, then one every --stagger s);
#: times alone on 2 CPU cores, serve: 8.8, 2.7, 4.2, 0.8, 2.7, 2.7, 4.2, 0.9 s
FLEET = (
    Member("g-digits-81-large", "digits-mlp.yaml", 81),
    Member("g-digits-27-a", "digits-mlp.yaml", 27),
    Member("g-synthetic-9-a", "synthetic-mlp.yaml", 9),
    Member("g-digits-9-small", "digits-mlp.yaml", 9, small=True),
    Member("g-digits-27-b", "digits-mlp.yaml", 27, space={"weight_decay": LOG_WD}),
    Member("g-digits-27-seed7", "digits-mlp.yaml", 27, seed=7),
    Member("g-synthetic-9-b", "synthetic-mlp.yaml", 9, space={"momentum": HIGH_MOMENTUM}),
    Member("g-synthetic-3", "synthetic-mlp.yaml", 3),
)
QUICK_FLEET = (
    Member("g-digits-3-a", "digits-mlp.yaml", 3),
    Member("g-digits-3-b", "digits-mlp.yaml", 3, space={"weight_decay": LOG_WD}, small=True),
    Member("g-synthetic-3", "synthetic-mlp.yaml", 3),
)
WARM_UP = (
    Member("g-warm-up-digits", "digits-mlp.yaml", 3, seed=99),
    Member("g-warm-up-synthetic", "synthetic-mlp.yaml", 3, seed=99),
)


def small_of(fleet: tuple[Member, ...]) -> str:
    """The study the staggered target is about: a small one submitted behind the large one."""
    return next(m.name for m in fleet if m.small)


def workers_of(mode: str) -> int:
    return 1 if mode == "serve" else int(mode.split(":", 1)[1])


# -- a fleet: a running service to submit studies to --------------------------------------


@dataclass
class Fleet:
    url: str
    workers: int
    submit: Callable[[dict[str, Any]], int]


@contextmanager
def serve_fleet(workdir: Path, settings: dict[str, str], device: str) -> Iterator[Fleet]:
    """``packtune serve`` on a fresh SQLite file; studies are POSTed to its API."""
    import httpx

    workdir.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{workdir / 'packtune.db'}"
    env = service_env(database_url=url, checkpoint_dir=workdir / "ckpt", device=device,
                      log_level="WARNING", **settings)  # fmt: skip
    proc, base = start_serve(env, workdir / "service.log")
    try:
        with httpx.Client(base_url=base, timeout=30) as client:

            def submit(spec: dict[str, Any]) -> int:
                r = client.post("/api/studies", json=spec)
                if r.status_code != 201:
                    raise RuntimeError(f"POST /api/studies: {r.status_code} {r.text[:500]}")
                return int(r.json()["id"])

            yield Fleet(url, runners_of(settings), submit)
    finally:
        _stop([proc])


@contextmanager
def rq_fleet(workdir: Path, workers: int, settings: dict[str, str], device: str) -> Iterator[Fleet]:
    """PostgreSQL + Redis + ``packtune scheduler`` + ``workers`` workers, all heartbeating;
    studies are inserted and the scheduler woken as the API does it."""
    with rq_service(workdir, workers, device, **settings) as service:
        yield Fleet(service.url, workers, service.submit)


@contextmanager
def fleet(mode: str, workdir: Path, settings: dict[str, str], device: str) -> Iterator[Fleet]:
    if mode == "serve":
        with serve_fleet(workdir, settings, device) as f:
            yield f
    else:
        with rq_fleet(workdir, workers_of(mode), settings,
                      "cpu" if device == "auto" else device) as f:  # fmt: skip
            yield f


def wait_all(url: str, ids: list[int], timeout: float) -> None:
    """Poll the database until every study of ``ids`` has ended."""
    from service.db import make_engine
    from service.models import Study

    engine = make_engine(url)
    start = time.monotonic()
    try:
        while True:
            with Session(engine) as s:
                rows = s.execute(sa.select(Study.id, Study.status).where(Study.id.in_(ids)))
                done = {i for i, st in rows if str(st) in FINAL}
            if len(done) == len(ids):
                return
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"studies {sorted(set(ids) - done)} did not end in {timeout} s")
            time.sleep(0.1)
    finally:
        engine.dispose()


# -- reading a run back -------------------------------------------------------------------


def _seconds(a: datetime | None, b: datetime | None) -> float | None:
    return None if a is None or b is None else (b - a).total_seconds()


def read_run(url: str, ids: list[int], workers: int) -> dict[str, Any]:
    """Makespan, each study's completion time and best val_loss, the packs (busy time, how
    many held or fused trials of more than one study) of the studies ``ids``."""
    from packtune.objective import value_of
    from service.db import make_engine
    from service.models import Pack, PackMember, PackStatus, Study, Trial

    engine = make_engine(url)
    try:
        with Session(engine) as s:
            studies = {st.id: st for st in s.scalars(sa.select(Study).where(Study.id.in_(ids)))}
            t0 = min(st.created_at for st in studies.values())
            ends = [st.finished_at for st in studies.values() if st.finished_at is not None]
            t1 = max(ends) if ends else None
            makespan = _seconds(t0, t1) or 0.0
            trial_study: dict[int, int] = {
                trial_id: study_id
                for trial_id, study_id in s.execute(
                    sa.select(Trial.id, Trial.study_id).where(Trial.study_id.in_(ids))
                )
            }
            members: dict[int, set[int]] = {}
            for pack_id, trial_id in s.execute(
                sa.select(PackMember.pack_id, PackMember.trial_id).where(
                    PackMember.trial_id.in_(list(trial_study))
                )
            ):
                members.setdefault(pack_id, set()).add(trial_study[trial_id])
            packs = list(s.scalars(sa.select(Pack).where(Pack.id.in_(list(members)))))
            busy, shared, stacks, cross_stacks = 0.0, 0, 0, 0
            train, gave_up, withdrawn = 0.0, 0, 0
            for p in packs:
                train += p.train_seconds or 0.0
                gave_up += any(a.get("gave_up") for a in p.arrays or [])
                withdrawn += p.status == PackStatus.cancelled
                if p.started_at is not None and p.finished_at is not None:
                    start, end = max(p.started_at, t0), p.finished_at
                    if t1 is not None:
                        end = min(end, t1)
                    busy += max(0.0, (end - start).total_seconds())
                shared += len(members[p.id]) > 1
                for array in p.arrays or []:
                    for stack in array.get("stacks", []):
                        if len(stack.get("trials", [])) > 1 and stack.get("mode") != "serial":
                            stacks += 1
                            owners = {trial_study.get(t) for t in stack["trials"]}
                            cross_stacks += len(owners - {None}) > 1
            out: list[dict[str, Any]] = []
            for study_id in ids:
                st = studies[study_id]
                best = None
                if st.best_trial_id is not None:
                    trial = s.get(Trial, st.best_trial_id)
                    assert trial is not None
                    max_r = float(st.spec["hyperband"]["max_resource"])
                    metric = st.spec["objective"]["metric"]
                    values = [value_of(m.metrics, metric) for m in trial.measurements
                              if abs(m.resource - max_r) < 1e-9]  # fmt: skip
                    best = values[-1] if values else None
                out.append({
                    "id": study_id, "name": st.name, "status": str(st.status), "error": st.error,
                    "created": _seconds(t0, st.created_at),
                    "finished": _seconds(t0, st.finished_at),
                    "completion": _seconds(st.created_at, st.finished_at), "best": best,
                    "trials": sum(1 for v in trial_study.values() if v == study_id),
                })  # fmt: skip
    finally:
        engine.dispose()
    completions = [r["completion"] for r in out if r["completion"] is not None]
    return {
        "makespan": makespan,
        "mean_completion": sum(completions) / len(completions) if completions else None,
        "busy_fraction": busy / (workers * makespan) if makespan else None,
        "packs": len(packs),
        "train_seconds": train,
        "packs_gave_up": gave_up,
        "packs_withdrawn": withdrawn,
        "shared_packs": shared,
        "fused_stacks": stacks,
        "cross_study_stacks": cross_stacks,
        "studies": out,
    }


# -- running --------------------------------------------------------------------------------


def run_once(
    mode: str, variant: str, pattern: str, fleet_specs: list[dict[str, Any]],
    args: argparse.Namespace, workdir: Path,
) -> dict[str, Any]:  # fmt: skip
    """One fresh service; the warm-up studies (none if quick); then the fleet, by ``pattern``."""
    settings = dict(SETTINGS[variant])
    if mode == "serve" and variant == "new" and args.runners > 1:
        settings["embedded_runners"] = str(args.runners)
    if variant == "new":
        settings.update(args.new_settings)
    # --quick checks that the script runs and times nothing: no warm-up (a third of its time)
    warm = [] if args.quick else [m.spec() for m in WARM_UP]
    with fleet(mode, workdir, settings, args.device) as f:
        warm_ids = [f.submit(spec) for spec in warm]
        wait_all(f.url, warm_ids, args.timeout)
        ids: list[int] = []
        posted: list[float] = []
        cpu_before = recording.cpu_seconds()
        start = time.perf_counter()
        if variant == "sequential":
            for spec in fleet_specs:
                posted.append(time.perf_counter() - start)
                ids.append(f.submit(spec))
                wait_all(f.url, ids[-1:], args.timeout)
        else:
            if pattern == "behind":
                fleet_specs = [fleet_specs[0], *(s for s in fleet_specs if s["name"] == args.small)]
            for i, spec in enumerate(fleet_specs):
                if pattern in ("staggered", "behind"):
                    time.sleep(max(0.0, start + i * args.stagger - time.perf_counter()))
                posted.append(time.perf_counter() - start)
                ids.append(f.submit(spec))
            wait_all(f.url, ids, args.timeout)
        bench_seconds = time.perf_counter() - start
        machine_busy = recording.busy_between(cpu_before, recording.cpu_seconds())
        run = read_run(f.url, ids, f.workers)
    for row, t in zip(run["studies"], posted, strict=True):
        row["posted"] = t
    bad = [f"{r['name']} {r['status']}: {r['error']}" for r in run["studies"]
           if r["status"] != "completed"]  # fmt: skip
    if bad:
        log = (workdir / "service.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{mode} {variant} {pattern}: not completed: {bad}\n{log}")
    if variant == "sequential":  # the studies one after another: the sum of the times alone
        run["span"] = run["makespan"]
        run["makespan"] = sum(r["completion"] for r in run["studies"])
    return {"mode": mode, "variant": variant, "pattern": pattern, "settings": settings,
            "workers": f.workers, "bench_seconds": bench_seconds, "load": recording.load_average(),
            "machine_busy": machine_busy, **run}  # fmt: skip


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def runners_of(settings: dict[str, str]) -> int:
    """The embedded runners a run's service settings give serve (1 unless set)."""
    return int(settings.get("embedded_runners", 1))


def label(run: dict[str, Any]) -> str:
    if run["variant"] == "sequential":
        return "sequential"
    settings = run.get("settings", {})
    runners = runners_of(settings)
    more = f" ({runners} runners)" if runners > 1 else ""
    own = SETTINGS.get(run["variant"], {})
    extra = [f"{k}={v}" for k, v in sorted(settings.items())
             if k != "embedded_runners" and own.get(k) != v]  # fmt: skip
    more += f" ({', '.join(extra)})" if extra else ""
    return f"{run['variant']}{more} {run['pattern']}"


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(variant, pattern) in the order they run: sequential first (the times alone), then
    today and new alternating per pattern."""
    out = [("sequential", "-")] if "sequential" in args.variants else []
    for pattern in args.patterns:
        out += [(v, pattern) for v in ("today", "new") if v in args.variants]
    return out


def measure(args: argparse.Namespace, fleet_specs: list[dict[str, Any]]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="packtune-bench-") as tmp:
        n = 0
        for mode in args.modes:
            for repeat in range(args.repeats):
                for variant, pattern in plan(args):
                    n += 1
                    workdir = Path(tmp) / f"run{n}"
                    run = run_once(mode, variant, pattern, fleet_specs, args, workdir)
                    run["repeat"] = repeat
                    runs.setdefault(mode, []).append(run)
                    print(
                        f"{mode} {label(run)} #{repeat + 1}: makespan {run['makespan']:.1f} s, "
                        f"mean completion {run['mean_completion']:.1f} s, "
                        f"busy {100 * run['busy_fraction']:.0f}%, "
                        f"{run['packs']} packs ({run['shared_packs']} shared), "
                        f"bench {run['bench_seconds']:.1f} s",
                        flush=True,
                    )
    return runs


# -- the report -----------------------------------------------------------------------------


def _find(items: list[dict[str, Any]], variant: str, pattern: str) -> dict[str, Any] | None:
    for run in items:
        if run["variant"] == variant and (variant == "sequential" or run["pattern"] == pattern):
            return run
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _entry(
    items: list[dict[str, Any]], pattern: str, small: str, alone: dict[str, float]
) -> dict[str, Any] | None:
    """One repeat's ratios for ``pattern`` (None where it has no ``new`` run)."""
    seq = _find(items, "sequential", "-")
    new, today = _find(items, "new", pattern), _find(items, "today", pattern)
    if new is None:
        return None

    def small_time(run: dict[str, Any]) -> float | None:
        return next((r["completion"] for r in run["studies"] if r["name"] == small), None)

    # behind: two studies, no makespan against the eight alone
    seq_for = seq if pattern != "behind" else None
    return {
        "new_makespan": new["makespan"],
        "sequential_over_new": _ratio(seq_for["makespan"], new["makespan"]) if seq_for else None,
        "today_over_new": _ratio(today["makespan"], new["makespan"]) if today else None,
        "small_over_alone": _ratio(small_time(new), alone.get(small)),
        "today_small_over_alone": _ratio(small_time(today), alone.get(small)) if today else None,
    }


def _median_entry(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeats' entries as one: each figure the median of its repeats' (paired: each
    ratio within one repeat's runs), the repeats' own in ``<figure>_each``."""
    out: dict[str, Any] = {"repeats": len(entries)}
    for key in entries[0]:
        values = [e[key] for e in entries if e[key] is not None]
        out[key] = recording.median(values) if values else None
        out[f"{key}_each"] = [e[key] for e in entries]
    return out


def _each(entry: dict[str, Any], key: str) -> str:
    values = entry.get(f"{key}_each") or []
    if len(values) < 2 or all(v is None for v in values):
        return ""
    return " (per repeat: " + ", ".join(_x(v) for v in values) + ")"


def _named(run: dict[str, Any], many: bool) -> str:
    """A run's label, with its repeat's number where there are several."""
    return label(run) + (f" #{run.get('repeat', 0) + 1}" if many else "")


def summarise(
    runs: dict[str, list[dict[str, Any]]], fleet: tuple[Member, ...]
) -> tuple[list[str], dict[str, Any]]:
    """The report's lines and the summary. With repeats, each ratio is the median of the
    repeats' ratios (each measured within one repeat: the studies alone, today's and the new
    scheduler one after another), and a study's time alone the median of its repeats'."""
    small = small_of(fleet)
    rows, notes, summary = [], [], {}
    per_study: list[str] = []
    for mode, items in runs.items():
        repeats = sorted({r.get("repeat", 0) for r in items})
        by_repeat = {k: [r for r in items if r.get("repeat", 0) == k] for k in repeats}
        alone_each: dict[int, dict[str, float]] = {}
        for k, its in by_repeat.items():
            seq = _find(its, "sequential", "-")
            alone_each[k] = {r["name"]: r["completion"] for r in seq["studies"]} if seq else {}
        alone = {
            m.name: recording.median([a[m.name] for a in alone_each.values() if m.name in a])
            for m in fleet
            if any(m.name in a for a in alone_each.values())
        }
        s: dict[str, Any] = {"small_study": small, "alone": alone, "repeats": len(repeats)}

        many = len(repeats) > 1
        for run in items:
            by_name = {r["name"]: r for r in run["studies"]}
            small_c = by_name[small]["completion"]
            own = alone_each[run.get("repeat", 0)]
            rows.append([
                mode, _named(run, many), _s(run["makespan"]), _s(run["mean_completion"]),
                f"{_s(small_c)} ({_x(_ratio(small_c, own.get(small)))})",
                f"{100 * run['busy_fraction']:.0f}%", _percent(run.get("machine_busy")),
                _s(run.get("train_seconds")),
                f"{run.get('packs_gave_up', '-')} / {run.get('packs_withdrawn', '-')}",
                run["packs"], run["shared_packs"], run["cross_study_stacks"],
                _s(run["bench_seconds"]),
            ])  # fmt: skip
        for pattern in PATTERNS:
            found = [_entry(by_repeat[k], pattern, small, alone_each[k]) for k in repeats]
            entries = [e for e in found if e is not None]
            if not entries:
                continue
            entry = _median_entry(entries)
            s[pattern] = entry
            median_of = " (median of the repeats)" if len(entries) > 1 else ""
            notes.append(
                f"- **{mode}, {pattern}**: sequential / new makespan "
                f"**{_x(entry['sequential_over_new'])}**{_each(entry, 'sequential_over_new')}"
                + (" (target >= 1.5x)" if pattern == "at-once" else "")
                + f", today / new **{_x(entry['today_over_new'])}**"
                f"{_each(entry, 'today_over_new')}; {small} (small, submitted behind the "
                f"large one) took {_x(entry['small_over_alone'])}"
                f"{_each(entry, 'small_over_alone')} its time alone with new, "
                f"{_x(entry['today_small_over_alone'])} with today's scheduler"
                + (" (target <= 2x)" if pattern == "behind" else "")
                + f"{median_of}."
            )
        summary[mode] = s
        together = [r for r in items if r["variant"] != "sequential" and r["pattern"] != "behind"]
        header = ["study", "R", "seed", "alone (s)", *(f"{_named(r, many)} (s)" for r in together),
                  "best val_loss per run"]  # fmt: skip
        body = []
        for i, m in enumerate(fleet):
            cells = [r["studies"][i] for r in together]
            bests = [r["studies"][i]["best"] for r in items if r["pattern"] != "behind"]
            body.append([
                m.name, m.max_resource, m.seed, _s(alone.get(m.name)),
                *(f"{_s(c['completion'])} ({_x(_ratio(c['completion'], alone.get(m.name)))})"
                  for c in cells),
                " ".join("-" if b is None else f"{b:.4f}" for b in bests),
            ])  # fmt: skip
        per_study += ["", f"Completion time per study, {mode} (its creation to its end; x its "
                      "time alone" + (", the median of the repeats'" if many else "")
                      + "):", "",
                      *recording.table(header, body)]  # fmt: skip
    header = ["mode", "run", "makespan (s)", "mean completion (s)", f"{small} (s, x alone)",
              "busy", "machine CPU", "train (s)", "gave up / withdrawn", "packs",
              "packs > 1 study", "fused stacks > 1 study",
              "bench (s)"]  # fmt: skip
    lines = [
        *recording.table(header, rows),
        *per_study,
        "",
        *notes,
        "",
        "makespan: the first study's `created_at` to the last one's `finished_at` (sequential: "
        "the sum of the studies' times alone, gaps between them left out); completion: a "
        "study's `created_at` to `finished_at`; busy: Σ over the studies' packs of "
        "`finished_at - started_at` (within the makespan) / (workers x makespan; sequential: "
        "x the first creation to the last end); machine CPU: the machine's CPU time busy "
        "(every process: workers, scheduler, database, the bench) over all its cores' time "
        "from the first submission to the bench seeing the last study end (/proc/stat): near "
        "100%, a run is bound by the CPU, and only less work (fusion) can shorten it; "
        "train: Σ the packs' `train_seconds` (their arrays' training, probes, evaluation and "
        "writes); gave up / withdrawn: packs that gave their device up to a better-served "
        "study while training, and packs withdrawn before they started; packs > 1 "
        "study: packs whose members are trials of more than one study; fused stacks > 1 "
        "study: fused arrays (bmm or vmap) holding trials of more than one study; bench: the "
        "bench's clock from the first submission to seeing the last study end. today: "
        "`PACKTUNE_SHARE_PACKS=false PACKTUNE_DISPATCH_ORDER=id`; new: `true`, `fair`. Each "
        "run on a fresh service and database, after a warm-up study of each workload.",
    ]
    return lines, summary


def settings_known() -> bool:
    """Whether this checkout's settings have the two the benchmark varies (if not, the
    service ignores them and every variant runs today's scheduler)."""
    from packtune.settings import Settings

    return {"share_packs", "dispatch_order"} <= set(Settings.model_fields)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS))
    parser.add_argument("--stagger", type=float, default=None,
                        help="seconds between staggered submissions (1; quick: 0.5)")  # fmt: skip
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (the workers')")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per wait")
    parser.add_argument("--quick", action="store_true", help="three tiny studies; appends nothing")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="every run this many times; ratios: the median of the repeats' "
                        "(each within one repeat)")  # fmt: skip
    parser.add_argument("--runners", type=int, default=1,
                        help="serve's new variant: embedded runners (PACKTUNE_EMBEDDED_RUNNERS; "
                        "sequential and today keep 1)")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a packtune setting for the new variant's processes (e.g. "
                        "preempt=false); such a run's JSON stays out of RESULTS.md")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        args.new_settings = parse_settings(args.set)
    except ValueError as exc:
        parser.error(str(exc))
    if own := sorted(set(args.new_settings) & BENCH_SETTINGS):
        parser.error(f"--set {own[0]}: the bench sets it itself (or use --device, --runners)")
    members = QUICK_FLEET if args.quick else FLEET
    args.small = small_of(members)
    if args.stagger is None:
        args.stagger = 0.5 if args.quick else 1.0
    known = settings_known()
    if not known:
        print("note: packtune.settings has no share_packs / dispatch_order: the service ignores "
              "them, and new runs today's scheduler", flush=True)  # fmt: skip
    specs = [m.spec() for m in members]
    load = recording.load_average()
    info = recording.machine("cuda" if args.device == "cuda" else "cpu")
    runs = measure(args, specs)
    body, summary = summarise(runs, members)
    print("\n".join(body))
    if args.quick and args.out_dir is None:
        return
    kind = recording.device_kind(info)
    name = result_name(kind, args.modes, args.new_settings, args.variants, args.patterns)
    recording.save_json(name, {
        "machine": info, "date": recording.now(), "command": recording.command_line(),
        "fleet": [m.to_json() for m in members], "warm_up": [m.to_json() for m in WARM_UP],
        "stagger": args.stagger, "settings_known": known, "settings": args.new_settings,
        "variants": args.variants, "patterns": args.patterns,
        "summary": summary, "runs": runs}, args.out_dir)  # fmt: skip
    if not (args.quick or args.no_append):
        recording.append_section(
            section(info),
            info,
            history_lines(members, args.stagger, known, body),
            load,
        )


def result_name(
    kind: str,
    modes: Sequence[str],
    settings: dict[str, str],
    variants: Sequence[str] = VARIANTS,
    patterns: Sequence[str] = PATTERNS,
) -> str:
    """The JSON's name: ``multi_study_<device kind>``, then the modes, variants and
    patterns where they are not the default ones (a run of some does not replace the
    others' figures), then the settings of ``--set``.

    >>> result_name("cpu", ["serve", "rq:2"], {}), result_name("cpu", ["rq:2"], {})
    ('multi_study_cpu', 'multi_study_cpu_rq-2')
    >>> result_name("cpu", ["rq:2"], {"preempt": "false"}, patterns=["behind"])
    'multi_study_cpu_rq-2_behind_preempt-false'
    """
    chosen = [(modes, MODES), (variants, VARIANTS), (patterns, PATTERNS)]
    return _study.result_name(f"multi_study_{kind}", settings, chosen)


def section(info: dict[str, Any]) -> str:
    """The HISTORY.md title of a run on ``info``'s device."""
    return f"g. Many studies on one fleet — {info['device']}"


def history_lines(
    members: tuple[Member, ...], stagger: float, known: bool, body: list[str]
) -> list[str]:
    """A run's HISTORY.md section: the fleet, then the report's ``body``."""
    return [
        f"Fleet: {len(members)} studies ("
        + ", ".join(f"{m.name} R={m.max_resource} seed {m.seed}" for m in members)
        + f"), staggered every {stagger:g} s, the first (large) one first."
        + ("" if known else IGNORED),
        "",
        *body,
    ]


if __name__ == "__main__":
    main()
