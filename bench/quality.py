"""Benchmark f: the best model per second -- best val_loss reached against wall time, packtune's
samplers side by side with Optuna's default (TPE + HyperbandPruner), over several seeds.

Every system gets the same workload, search space and budget of trial-epochs: those of
one Hyperband iteration of the spec (R=27, eta=3: 49 trials, 357 trial-epochs for
``examples/digits-mlp.yaml``).

- ``packtune-tpe``: ``packtune run`` (embedded, packed), ``sampler: tpe`` (the default);
- ``packtune-random``: the same with ``sampler: random`` (the former default);
- ``packtune-asha``: ``scheduler: asha`` with ``sampler: tpe``: the same 49 trials on bracket
  s_max's ladder, promoted as results come (about as many trial-epochs as the others);
- ``optuna``: ``TPESampler(seed)`` with ``HyperbandPruner(min_resource, max_resource,
  reduction_factor=eta)``, Optuna's defaults otherwise, trials trained one by one in one
  process by a plain ``torch.optim`` loop (:mod:`bench._plain`), as many trials as fit the
  same trial-epoch budget.

Each run is a fresh process (its imports count, as a user pays them). Time runs from the
moment the process is started; a run's curve is the best val_loss of the trials that
reached ``max_resource`` so far. Runs alternate (rotated per seed). Reported: median and
spread over seeds of the best-so-far at common times, each system's final median best, and
how long each takes to reach Optuna's final median best.

    python -m bench.quality                 # 10 seeds; HISTORY.md, results/quality_cpu.json
    python -m bench.quality --quick         # a tiny study, one seed; writes nothing
    python -m bench.quality --device cuda --seeds 0 1 2 3 4 --out-dir DIR --no-append
                                            # on a GPU box: results/quality_<GPU>.json there
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import recording
from bench._study import ROOT, cli, load_spec, service_env
from bench.peers import hyperband_trials, optuna_run, optuna_study

SYSTEMS = ("packtune-tpe", "packtune-random", "packtune-asha", "optuna")


def best_so_far(events: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(seconds, value) events -> the running minimum, one point per improvement."""
    out: list[tuple[float, float]] = []
    best = math.inf
    for t, v in sorted(events):
        if math.isfinite(v) and v < best:
            best = v
            out.append((t, v))
    return out


def value_at(curve: list[tuple[float, float]], t: float) -> float:
    """The best-so-far at time ``t`` (inf before the first result)."""
    value = math.inf
    for when, v in curve:
        if when > t:
            break
        value = v
    return value


def first_time(curve: list[tuple[float, float]], target: float) -> float | None:
    """When the curve first reaches ``target`` (None if never)."""
    for when, v in curve:
        if v <= target:
            return when
    return None


# -- the systems --------------------------------------------------------------------------


def run_packtune(
    spec: dict[str, Any],
    system: str,
    workdir: Path,
    random_fraction: float | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    import yaml

    workdir.mkdir(parents=True, exist_ok=True)
    sampler = "random" if system == "packtune-random" else "tpe"
    settings: dict[str, Any] = {"name": sampler}
    if random_fraction is not None and sampler == "tpe":
        settings["random_fraction"] = random_fraction
    spec = {**spec, "sampler": settings, "budget": {"max_iterations": 1}}
    if system == "packtune-asha":
        spec = {**spec, "scheduler": "asha"}
    path = workdir / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    url = f"sqlite:///{workdir / 'packtune.db'}"
    env = service_env(database_url=url, checkpoint_dir=workdir / "ckpt", device=device)
    started = time.time()
    proc = subprocess.run(cli("run", str(path), "--top", "1"), env=env, cwd=workdir,
                          capture_output=True, text=True)  # fmt: skip
    wall = time.time() - started
    if proc.returncode != 0:
        raise RuntimeError(f"packtune run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    max_r = float(spec["hyperband"]["max_resource"])
    with sqlite3.connect(workdir / "packtune.db") as db:
        rows = db.execute(
            "SELECT m.created_at, m.metrics, m.resource FROM measurements m "
            "JOIN trials t ON t.id = m.trial_id WHERE t.study_id = 1"
        ).fetchall()
    events = []
    epochs = len(rows)  # one measurement per trained epoch
    for created, metrics, resource in rows:
        if abs(float(resource) - max_r) < 1e-9:
            when = datetime.fromisoformat(created).replace(tzinfo=UTC).timestamp() - started
            events.append((when, float(json.loads(metrics).get("val_loss", math.nan))))
    return {"wall": wall, "curve": best_so_far(events), "trial_epochs": epochs,
            "completed": len(events)}  # fmt: skip


def run_optuna(
    spec: dict[str, Any], budget: float, threads: int, started: float, device: str = "cpu"
) -> dict[str, Any]:
    """In the child process: Optuna's default TPE with its Hyperband pruner, until ``budget``
    trial-epochs are spent, trials trained on ``device``."""
    import optuna
    import torch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(threads)
    max_r = int(spec["hyperband"]["max_resource"])
    epochs = 0
    events: list[tuple[float, float]] = []

    def objective(trial: optuna.Trial) -> float:
        nonlocal epochs
        run = optuna_run(spec, trial, device)
        value = math.nan
        for epoch in range(max_r):
            if epochs >= budget:
                raise optuna.TrialPruned()  # the budget is spent
            run.epoch(epoch)
            epochs += 1
            value = run.val_loss()
            trial.report(value, epoch + 1)
            if trial.should_prune():
                raise optuna.TrialPruned()
        events.append((time.time() - started, value))
        return value

    def stop(study: optuna.Study, _: Any) -> None:
        if epochs >= budget:
            study.stop()

    study = optuna_study(spec, optuna.samplers.TPESampler(seed=int(spec.get("seed", 0))))
    study.optimize(objective, callbacks=[stop])
    return {"curve": best_so_far(events), "trial_epochs": epochs, "trials": len(study.trials),
            "completed": len(events)}  # fmt: skip


def run_optuna_child(
    spec: dict[str, Any], workdir: Path, threads: int, device: str = "cpu"
) -> dict[str, Any]:
    path = workdir / "spec.json"
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    _, budget = hyperband_trials(spec)
    started = time.time()
    command = [sys.executable, "-m", "bench.quality", "--child", "--spec", str(path),
               "--threads", str(threads), "--started", repr(started),
               "--budget", repr(budget), "--device", device]  # fmt: skip
    proc = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, cwd=workdir)  # fmt: skip
    wall = time.time() - started
    if proc.returncode != 0:
        raise RuntimeError(f"optuna failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    row["curve"] = [tuple(p) for p in row["curve"]]
    return {"wall": wall, **row}


# -- measuring and reporting --------------------------------------------------------------


def measure(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.systems}
    with tempfile.TemporaryDirectory(prefix="packtune-quality-") as tmp:
        for k, seed in enumerate(args.seeds):
            seeded = {**spec, "seed": seed}
            order = args.systems[k % len(args.systems) :] + args.systems[: k % len(args.systems)]
            for name in order:
                workdir = Path(tmp) / f"{name}-{seed}"
                if name == "optuna":
                    row = run_optuna_child(seeded, workdir, args.threads, args.device)
                else:
                    row = run_packtune(seeded, name, workdir, args.random_fraction, args.device)
                row["seed"] = seed
                row["load"] = recording.load_average()
                runs[name].append(row)
                final = row["curve"][-1][1] if row["curve"] else math.nan
                print(f"{name} seed {seed}: {row['wall']:.1f} s, best {final:.4f}, "
                      f"{row['trial_epochs']:.0f} trial-epochs", flush=True)  # fmt: skip
    return runs


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over seeds: final best, wall, the best-so-far at common times, and the time to
    reach Optuna's final median best."""
    final = {n: recording.median([r["curve"][-1][1] if r["curve"] else math.inf for r in rs])
             for n, rs in runs.items()}  # fmt: skip
    wall = {n: recording.median([r["wall"] for r in rs]) for n, rs in runs.items()}
    horizon = max(r["wall"] for rs in runs.values() for r in rs)
    times = [horizon * i / 100 for i in range(1, 101)]
    at = {
        n: [recording.median([value_at(r["curve"], t) for r in rs]) for t in times]
        for n, rs in runs.items()
    }
    out: dict[str, Any] = {"final_best": final, "wall": wall, "times": times, "median_at": at}
    if "optuna" in runs:
        target = final["optuna"]
        fine = [horizon * i / 400 for i in range(1, 401)]
        reach: dict[str, float | None] = {}
        for name, rs in runs.items():
            # when the median (over seeds) best-so-far first reaches Optuna's final median
            curve = [recording.median([value_at(r["curve"], t) for r in rs]) for t in fine]
            reach[name] = next((t for t, v in zip(fine, curve, strict=True) if v <= target),
                               None)  # fmt: skip
        out["time_to_optuna_best"] = reach
        out["optuna_wall"] = wall["optuna"]
        # at Optuna's median wall time: each system's median best-so-far
        out["at_optuna_wall"] = {
            n: recording.median([value_at(r["curve"], wall["optuna"]) for r in rs])
            for n, rs in runs.items()
        }
    return out


def report(summary: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    rows = []
    for name in summary["final_best"]:
        reach = (summary.get("time_to_optuna_best") or {}).get(name)
        epochs = recording.median([r["trial_epochs"] for r in runs[name]])
        rows.append([
            name, f"{epochs:.0f}", f"{summary['wall'][name]:.1f}",
            f"{summary['final_best'][name]:.4f}",
            f"{summary.get('at_optuna_wall', {}).get(name, math.nan):.4f}",
            "never" if reach is None or not math.isfinite(reach) else f"{reach:.1f}",
        ])  # fmt: skip
    header = ["system", "trial-epochs", "wall (s, median)", "final best val_loss (median)",
              "best at Optuna's wall (median)", "s to Optuna's final median best"]  # fmt: skip
    return recording.table(header, rows)


def plot(runs: dict[str, list[dict[str, Any]]], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    times = summary["times"]
    for name, rs in runs.items():
        lows = [min(value_at(r["curve"], t) for r in rs) for t in times]
        highs = [max(value_at(r["curve"], t) for r in rs) for t in times]
        median = summary["median_at"][name]
        line = ax.plot(times, median, label=f"{name} (median of {len(rs)} seeds)")[0]
        ok = [i for i, h in enumerate(highs) if math.isfinite(h)]
        ax.fill_between([times[i] for i in ok], [lows[i] for i in ok], [highs[i] for i in ok],
                        color=line.get_color(), alpha=0.15)  # fmt: skip
    ax.set_xlabel("seconds since the process started")
    ax.set_ylabel("best val_loss at max_resource so far")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "examples" / "digits-mlp.yaml")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where every system trains (Optuna's trials too)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--random-fraction", type=float, default=None,
                        help="packtune-tpe: sampler.random_fraction")  # fmt: skip
    recording.output_options(parser, "a tiny study, one seed")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # Optuna's run in this fresh process; one JSON line out
        spec = json.loads(args.spec.read_text())
        print(json.dumps(run_optuna(spec, args.budget, args.threads, args.started, args.device)))
        return
    spec = load_spec(args.spec)
    if args.quick:
        spec["hyperband"] = {"max_resource": 3, "min_resource": 1, "eta": 3}
        args.seeds = args.seeds[:1]
    load = recording.load_average()
    commit = recording.git_commit()  # before the plot below changes a tracked file
    runs = measure(args, spec)
    summary = summarise(runs)
    lines = report(summary, runs)
    info = recording.machine(args.device)
    kind = recording.device_kind(info)
    note = ""
    if not (args.quick or args.no_append):  # a full run here: its plot too (one elsewhere:
        from bench.plots import quality_plot  # `python -m bench.plots` draws it here)

        try:
            drawn = quality_plot({"machine": info, "runs": runs, "summary": summary},
                                 recording.BENCH_DIR / "plots")  # fmt: skip
            note = f"; plot: {drawn.relative_to(ROOT)}"
        except ImportError:
            note = "; no plot (matplotlib is not installed)"
    data = {"spec": spec, "seeds": args.seeds, "runs": runs, "summary": summary, "commit": commit}
    recording.publish(f"quality_{kind}", section(info), [*lines, "", f"seeds {args.seeds}{note}"],
                      info, load, data, args)  # fmt: skip


def section(info: dict[str, Any]) -> str:
    """The HISTORY.md title of a run on ``info``'s device."""
    title = "f. best val_loss against wall time: packtune's samplers and Optuna (TPE + Hyperband)"
    return title if info["device"] == "cpu" else f"{title} — {info['device']}"


if __name__ == "__main__":
    main()
