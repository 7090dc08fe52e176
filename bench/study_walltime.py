"""Benchmark b: the same Hyperband study packed vs unpacked, through the real service.

For each mode (``embedded``: ``packtune run``; ``serve``: ``packtune serve`` with SQLite,
up and warmed by a small study before the measured one, which is POSTed to its API;
``rq:N``: PostgreSQL + Redis +
one ``packtune scheduler`` + N ``packtune worker``), the study of
``examples/digits-mlp.yaml`` runs packed (as written) and unpacked
(``packing.max_pack_size: 1``), alternating, ``--repeats`` times each. Reported:
median wall times and their ratio, jobs (packs), the best trial of each (they
must agree), and where the wall time went (see ``_study.breakdown``).

    python -m bench.study_walltime                            # embedded, rq:1, rq:2
    python -m bench.study_walltime --modes embedded --device cuda
    python -m bench.study_walltime --modes embedded serve --device cuda
    python -m bench.study_walltime --quick                    # a tiny study, writes nothing
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import _study, recording
from bench._study import (
    ROOT,
    StudyRun,
    breakdown,
    load_spec,
    parse_settings,
    run_embedded,
    run_rq,
    run_serve,
    variant,
)

QUICK_HYPERBAND = {"max_resource": 3, "min_resource": 1, "eta": 3}


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


#: the study of bench b's figures in RESULTS.md; a run of another spec is named after it
DEFAULT_SPEC = ROOT / "examples" / "digits-mlp.yaml"


#: the modes a run measures unless told otherwise
MODES = ("embedded", "rq:1", "rq:2")


def result_name(
    spec_file: Path, kind: str, settings: dict[str, str], modes: Sequence[str] = MODES
) -> str:
    """The JSON result's name: ``study_walltime_<device kind>``, then the spec's name where
    it is not the default one, then the modes where they are not the default ones (a run of
    some modes does not replace the others' figures), then the settings of ``--set``."""
    name = f"study_walltime_{kind}"
    if spec_file.resolve() != DEFAULT_SPEC.resolve():
        name += f"_{spec_file.stem}"
    return _study.result_name(name, settings, [(modes, MODES)])


def run_one(mode: str, spec: dict[str, Any], workdir: Path, device: str) -> StudyRun:
    if mode == "embedded":
        return run_embedded(spec, workdir, device)
    if mode == "serve":
        warm = {**spec, "name": f"{spec['name']}-warm-up", "hyperband": QUICK_HYPERBAND}
        return run_serve(spec, workdir, device, warm_up=warm)
    workers = int(mode.split(":", 1)[1])
    return run_rq(spec, workdir, workers, device="cpu" if device == "auto" else device)


def workers_of(mode: str) -> int:
    return 1 if mode in ("embedded", "serve") else int(mode.split(":", 1)[1])


def measure(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="packtune-bench-") as tmp:
        n = 0
        for rep in range(args.repeats):
            for mode in args.modes:
                order = [True, False] if rep % 2 == 0 else [False, True]  # ABBA...
                for packed in order:
                    n += 1
                    run = run_one(mode, variant(spec, packed), Path(tmp) / f"run{n}", args.device)
                    if run.study["status"] != "completed":
                        raise RuntimeError(
                            f"{mode} {'packed' if packed else 'unpacked'} study "
                            f"ended {run.study['status']}"
                        )
                    row = run.to_json()
                    row["breakdown"] = breakdown(run.study, workers_of(mode))
                    row["load"] = recording.load_average()
                    runs.setdefault(mode, []).append(row)
                    print(
                        f"{mode} {'packed' if packed else 'unpacked'}: "
                        f"{row['wall_seconds']:.1f} s, {row['breakdown']['jobs']} jobs, "
                        f"best sample {row['best']['sample_index']} "
                        f"{row['best']['value']:.4f}",
                        flush=True,
                    )
    return runs


def summarise(runs: dict[str, list[dict[str, Any]]]) -> tuple[list[str], dict[str, Any]]:
    rows, notes, summary = [], [], {}
    for mode, items in runs.items():
        packed = [r for r in items if r["packed"]]
        unpacked = [r for r in items if not r["packed"]]
        wall_p = recording.median([r["wall_seconds"] for r in packed])
        wall_u = recording.median([r["wall_seconds"] for r in unpacked])
        pairs = list(zip(packed, unpacked, strict=False))
        ratios = [u["wall_seconds"] / p["wall_seconds"] for p, u in pairs]
        best = {(r["best"]["sample_index"], round(r["best"]["value"], 4)) for r in items}
        agree = len({b[0] for b in best}) == 1
        summary[mode] = {"packed_wall": wall_p, "unpacked_wall": wall_u,
                         "ratio_of_medians": wall_u / wall_p, "paired_ratios": ratios,
                         "best_agree": agree}  # fmt: skip
        for label, group in (("packed", packed), ("unpacked", unpacked)):
            b = [r["breakdown"] for r in group]
            rows.append([
                mode, label, f"{recording.median([r['wall_seconds'] for r in group]):.1f}",
                f"{recording.median([r['process_seconds'] for r in group]):.1f}",
                b[0]["jobs"], f"{recording.median([x['train'] for x in b]):.1f}",
                f"{recording.median([x['in_job_other'] for x in b]):.1f}",
                f"{recording.median([x['outside_jobs'] for x in b]):.1f}",
                f"{100 * recording.median([x['outside_training_share'] for x in b]):.0f}%",
                f"{recording.median([x['mean_queue_wait'] for x in b]):.2f}",
                "; ".join(f"#{r['best']['sample_index']} {r['best']['value']:.4f}" for r in group),
            ])  # fmt: skip
        notes.append(
            f"- **{mode}**: unpacked / packed = **{wall_u / wall_p:.2f}x** (medians); per "
            f"adjacent pair: {', '.join(f'{x:.2f}x' for x in ratios)}; best trial "
            f"{'the same in every run' if agree else 'DIFFERS between runs'} "
            f"({', '.join(sorted({f'sample #{b[0]} {b[1]}' for b in best}))})."
        )
    header = [
        "mode",
        "variant",
        "wall (s)",
        "command (s)",
        "jobs",
        "train (s)",
        "in job, not train (s)",
        "outside jobs (s)",
        "outside training",
        "mean queue wait (s)",
        "best trial (sample, val_loss) per run",
    ]
    body = [
        *recording.table(header, rows),
        "",
        *notes,
        "",
        "wall: the study's `created_at` to `finished_at`; command: around `packtune run` "
        "(embedded: Python start, imports, migrations included) or from study creation (rq) "
        "or its POST (serve) to the bench seeing it finished. train: Σ pack `train_seconds` "
        "(arrays: data, memory probe, steps, per-epoch evaluation and measurement writes, "
        "checkpoint saves); "
        "in job, not train: Σ (`finished_at` - `started_at`) - train (claim, load, finish); "
        "outside jobs: workers x wall - Σ (`finished_at` - `started_at`) (scheduling, "
        "dispatch, queueing, process start, idle workers); outside training = 1 - train / "
        "(workers x wall).",
    ]
    return body, summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC)
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (the workers')")
    parser.add_argument("--quick", action="store_true", help="a tiny study; appends nothing")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a packtune setting for every process started (e.g. "
                        "compile_step=on); such a run's JSON stays out of RESULTS.md")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        settings = parse_settings(args.set)
    except ValueError as exc:
        parser.error(str(exc))
    _study.EXTRA_SETTINGS.update(settings)
    try:
        run(args, settings)
    finally:
        _study.EXTRA_SETTINGS.clear()


def run(args: argparse.Namespace, settings: dict[str, str]) -> None:
    spec = load_spec(args.spec)
    if args.quick:
        spec["hyperband"] = QUICK_HYPERBAND
        args.repeats = 1
    load = recording.load_average()
    info = recording.machine("cuda" if args.device == "cuda" else "cpu")
    runs = measure(args, spec)
    body, summary = summarise(runs)
    print("\n".join(body))
    if args.quick and args.out_dir is None:
        return
    kind = recording.device_kind(info)
    recording.save_json(result_name(args.spec, kind, settings, args.modes), {
        "machine": info, "date": recording.now(), "command": recording.command_line(),
        "spec_file": str(_shown(args.spec.resolve())), "spec": spec, "settings": settings,
        "summary": summary, "runs": runs}, args.out_dir)  # fmt: skip
    if not (args.quick or args.no_append):
        recording.append_section(
            f"b. Study wall time, packed vs unpacked — {info['device']}",
            info,
            [
                f"Study: `{_shown(args.spec)}` ({spec['workload']}, max_resource "
                f"{spec['hyperband']['max_resource']}, eta {spec['hyperband']['eta']}); medians of "
                f"{args.repeats} runs per variant, packed and unpacked alternating.",
                "",
                *body,
            ],
            load,
        )


if __name__ == "__main__":
    main()
