"""Benchmark c: the same Hyperband study with packtune, Optuna and Ray Tune, side by side.

All three sample the study's space at random and train packtune's workload
objects; Optuna and Ray Tune train each trial with a plain ``torch.optim``
loop (:mod:`bench._plain`), one epoch per reported step:

- packtune: ``packtune run SPEC`` (embedded, packed), as benchmark b;
- Optuna: ``HyperbandPruner(min_resource, max_resource, reduction_factor=eta)``,
  ``RandomSampler``, as many trials as packtune's Hyperband samples, one
  process (torch threads as a packtune worker);
- Ray Tune: ``HyperBandScheduler(max_t=max_resource, reduction_factor=eta)``,
  the same number of samples, one CPU per trial (all cores), a checkpoint per
  epoch so that paused trials resume (what HyperBand needs). ``ray.init`` is
  inside the timed wall: a user pays it.

Each system runs as a fresh process, as a user would run it: ``wall`` counts
Python's start and the imports too (``packtune run``; ``python -m bench.peers
--child optuna|ray``), and "tuning alone" is the study's own time (packtune:
study created to finished; Optuna: ``optimize``; Ray Tune: ``ray.init`` + ``fit``).
The runs alternate (rotated per repeat); times are medians. Best validation
loss is taken over trials trained to ``max_resource``.

    python -m bench.peers
    python -m bench.peers --quick    # a tiny study; writes nothing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import recording
from bench._study import ROOT, load_spec, run_embedded
from packtune.hyperband import plan_brackets

SYSTEMS = ("packtune", "optuna", "ray")


def hyperband_trials(spec: dict[str, Any]) -> tuple[int, float]:
    """(trials, trial-epochs) of the study's Hyperband plan."""
    hb = spec["hyperband"]
    brackets = plan_brackets(
        float(hb["max_resource"]),
        eta=int(hb.get("eta", 3)),
        min_resource=float(hb.get("min_resource", 1)),
    )
    trials = sum(b[0].n for b in brackets)
    epochs = 0.0
    for rungs in brackets:
        previous = 0.0
        for rung in rungs:
            epochs += rung.n * (float(rung.resource) - previous)
            previous = float(rung.resource)
    return trials, epochs


def trial_config(spec: dict[str, Any], config: dict[str, Any], number: int) -> dict[str, Any]:
    seed = int(spec.get("seed", 0))
    return {**config, "seed": seed * 100_003 + number, "data_seed": seed}


def run_packtune(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    run = run_embedded(spec, workdir)
    best = run.study["best"]
    _, epochs = hyperband_trials(spec)
    return {
        "wall": run.process_seconds,
        "inner": run.study["wall_seconds"],
        "best": best["value"],
        "trial_epochs": epochs,
        "best_config": best["config"],
        "jobs": len(run.study["packs"]),
    }


def optuna_run(spec: dict[str, Any], trial: Any, device: str = "cpu") -> Any:
    """An Optuna trial's config drawn from the spec's space, built as a plain
    :class:`bench._plain.PlainRun` on ``device``."""
    import torch

    from bench._plain import PlainRun

    def suggest(name: str, p: dict[str, Any]) -> Any:
        if p["type"] == "choice":
            return trial.suggest_categorical(name, p["values"])
        if p["type"] == "int":
            return trial.suggest_int(name, p["low"], p["high"], log=bool(p.get("log")))
        return trial.suggest_float(name, p["low"], p["high"], log=p["type"] == "loguniform")

    config = {name: suggest(name, p) for name, p in spec["space"].items()}
    return PlainRun.build(
        spec["workload"], trial_config(spec, config, trial.number), torch.device(device)
    )


def optuna_study(spec: dict[str, Any], sampler: Any) -> Any:
    """An Optuna study minimising val_loss with ``sampler`` and the spec's Hyperband as
    ``HyperbandPruner(min_resource, max_resource, reduction_factor=eta)``, named after the
    spec and its seed: the pruner puts trial n in the bracket that a hash of the study's
    name and n picks, and Optuna's default name is random, so unnamed runs of one seed
    differ (in bench f, seed 2's best 0.0895 in one run and 0.1071 in another)."""
    import optuna

    hb = spec["hyperband"]
    pruner = optuna.pruners.HyperbandPruner(
        min_resource=int(hb.get("min_resource", 1)), max_resource=int(hb["max_resource"]),
        reduction_factor=int(hb.get("eta", 3)),
    )  # fmt: skip
    name = f"{spec.get('name', 'study')}-seed{spec.get('seed', 0)}"
    return optuna.create_study(
        study_name=name, direction="minimize", sampler=sampler, pruner=pruner
    )


def run_optuna(spec: dict[str, Any], threads: int) -> dict[str, Any]:
    import optuna
    import torch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(threads)
    max_r = int(spec["hyperband"]["max_resource"])
    n_trials, _ = hyperband_trials(spec)
    epochs = 0
    start = time.perf_counter()

    def objective(trial: optuna.Trial) -> float:
        nonlocal epochs
        run = optuna_run(spec, trial)
        value = float("nan")
        for epoch in range(max_r):
            run.epoch(epoch)
            epochs += 1
            value = run.val_loss()
            trial.report(value, epoch + 1)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return value

    study = optuna_study(spec, optuna.samplers.RandomSampler(seed=int(spec.get("seed", 0))))
    study.optimize(objective, n_trials=n_trials)
    wall = time.perf_counter() - start
    completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = min(completed, key=lambda t: t.value if t.value is not None else float("inf"))
    return {
        "inner": wall,
        "best": best.value,
        "trial_epochs": epochs,
        "best_config": best.params,
        "completed": len(completed),
    }


def _ray_space(space: dict[str, Any]) -> dict[str, Any]:
    from ray import tune

    out: dict[str, Any] = {}
    for name, p in space.items():
        if p["type"] == "choice":
            out[name] = tune.choice(p["values"])
        elif p["type"] == "int":
            out[name] = (tune.lograndint if p.get("log") else tune.randint)(p["low"], p["high"] + 1)
        elif p["type"] == "loguniform":
            out[name] = tune.loguniform(p["low"], p["high"])
        else:
            out[name] = tune.uniform(p["low"], p["high"])
    return out


def _ray_trainable(config: dict[str, Any]) -> None:
    """One Ray Tune trial: a plain loop, a checkpoint each epoch so a paused trial resumes."""
    import torch
    from ray import tune

    from bench._plain import PlainRun

    torch.set_num_threads(1)
    spec = config.pop("__spec")
    number = config.pop("__number", 0)
    run = PlainRun.build(spec["workload"], trial_config(spec, config, number), torch.device("cpu"))
    start = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt", weights_only=True)
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        start = int(state["epoch"])
    for epoch in range(start, int(spec["hyperband"]["max_resource"])):
        run.epoch(epoch)
        value = run.val_loss()
        with tempfile.TemporaryDirectory() as folder:
            torch.save(
                {
                    "model": run.model.state_dict(),
                    "optimizer": run.optimizer.state_dict(),
                    "epoch": epoch + 1,
                },
                Path(folder) / "state.pt",
            )
            tune.report(
                {"val_loss": value, "epoch": epoch + 1},
                checkpoint=tune.Checkpoint.from_directory(folder),
            )


def run_ray(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    import ray
    from ray import tune
    from ray.tune.schedulers import HyperBandScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    hb = spec["hyperband"]
    max_r, eta = int(hb["max_resource"]), int(hb.get("eta", 3))
    n_trials, _ = hyperband_trials(spec)
    start = time.perf_counter()
    ray.init(
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        space = {**_ray_space(spec["space"]), "__spec": spec}
        tuner = tune.Tuner(
            tune.with_resources(_ray_trainable, {"cpu": 1}),
            param_space=space,
            tune_config=tune.TuneConfig(
                metric="val_loss", mode="min", num_samples=n_trials,
                scheduler=HyperBandScheduler(time_attr="training_iteration", max_t=max_r,
                                             reduction_factor=eta),
                search_alg=BasicVariantGenerator(random_state=int(spec.get("seed", 0))),
            ),
            run_config=tune.RunConfig(storage_path=str(workdir / "ray"), verbose=0),
        )  # fmt: skip
        results = tuner.fit()
    finally:
        ray.shutdown()
    wall = time.perf_counter() - start
    frame = results.get_dataframe()
    epochs = int(frame["training_iteration"].sum())
    finals = frame[frame["training_iteration"] >= max_r]
    row = finals.loc[finals["val_loss"].idxmin()]
    config = {
        k.split("/", 1)[1]: row[k]
        for k in frame.columns
        if k.startswith("config/") and not k.startswith("config/__")
    }
    return {
        "inner": wall,
        "best": float(row["val_loss"]),
        "trial_epochs": epochs,
        "best_config": config,
        "completed": len(finals),
    }


def run_child(name: str, spec: dict[str, Any], workdir: Path, threads: int) -> dict[str, Any]:
    """Optuna or Ray Tune in a fresh Python process, as a user runs it: ``wall`` counts the
    imports and start-up too, like ``packtune run``'s; ``inner`` is the tuning alone."""
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "bench.peers", "--child", name, "--spec", str(spec_path),
               "--workdir", str(workdir), "--threads", str(threads)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT"
           "_SYNC_THRESHOLD_S": "0"}  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=workdir)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall": wall, **row}


def measure(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.systems}
    with tempfile.TemporaryDirectory(prefix="packtune-peers-") as tmp:
        for rep in range(args.repeats):
            shift = rep % len(args.systems)
            for name in args.systems[shift:] + args.systems[:shift]:
                workdir = Path(tmp) / f"{name}{rep}"
                workdir.mkdir()
                row = (
                    run_packtune(spec, workdir)
                    if name == "packtune"
                    else run_child(name, spec, workdir, args.threads)
                )
                row["load"] = recording.load_average()
                runs[name].append(row)
                print(
                    f"{name}: {row['wall']:.1f} s, best {row['best']:.4f}, "
                    f"{row['trial_epochs']:.0f} trial-epochs",
                    flush=True,
                )
    return runs


def summarise(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    walls = {n: recording.median([r["wall"] for r in rs]) for n, rs in runs.items()}
    rows = []
    for name, items in runs.items():
        rows.append([
            name, f"{walls[name]:.1f}", ", ".join(f"{r['wall']:.1f}" for r in items),
            f"{recording.median([r['best'] for r in items]):.4f}",
            ", ".join(f"{r['best']:.4f}" for r in items),
            f"{recording.median([r['trial_epochs'] for r in items]):.0f}",
            f"{walls[name] / walls['packtune']:.2f}x" if "packtune" in walls else "",
            f"{recording.median([r['inner'] for r in items]):.1f}",
        ])  # fmt: skip
    header = [
        "system",
        "wall (s, median)",
        "wall per run",
        "best val_loss (median)",
        "best per run",
        "trial-epochs trained",
        "wall / packtune's",
        "tuning alone (s, median)",
    ]
    return recording.table(header, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "examples" / "digits-mlp.yaml")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="torch threads for Optuna's process (as a packtune worker)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny study; appends nothing")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--child", choices=["optuna", "ray"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one system's run in this fresh process; one JSON line out
        spec = json.loads(args.spec.read_text())
        result = (
            run_optuna(spec, args.threads)
            if args.child == "optuna"
            else run_ray(spec, args.workdir)
        )
        print(json.dumps(result, default=str))
        return
    spec = load_spec(args.spec)
    if args.quick:
        spec["hyperband"] = {"max_resource": 3, "min_resource": 1, "eta": 3}
        args.repeats = 1
    load = recording.load_average()
    info = recording.machine("cpu")
    runs = measure(args, spec)
    body = summarise(runs)
    print("\n".join(body))
    if args.quick and args.out_dir is None:
        return
    recording.save_json("peers_cpu", {"machine": info, "date": recording.now(),
                                    "command": recording.command_line(), "runs": runs},
                      args.out_dir)  # fmt: skip
    if not (args.quick or args.no_append):
        trials, epochs = hyperband_trials(spec)
        recording.append_section(
            "c. Peers: packtune vs Optuna vs Ray Tune — cpu",
            info,
            [
                f"Study `{args.spec.name}`: {spec['workload']}, max_resource "
                f"{spec['hyperband']['max_resource']}, eta {spec['hyperband']['eta']} "
                f"({trials} trials, {epochs:.0f} trial-epochs in packtune's Hyperband); "
                f"{args.repeats} runs each, systems rotated. Optuna: one process, "
                f"{args.threads} torch thread(s); Ray Tune: {os.cpu_count()} CPUs, 1 per trial.",
                "",
                *body,
            ],
            load,
        )


if __name__ == "__main__":
    main()
