"""j. Decoupled segments as units of work: the same decoupled study with each trial's
segments trained together (``training.units: trial``) and as units of their own
(``units: segment``), on RQ workers.

The study is ``examples/digits-mlp-segment-units.yaml`` (a 6-layer MLP on digits cut in
two, R=27, eta=3: 49 trials); both variants give the same values at every rung (tests/e2e/
test_segment_units.py), so the figure is time: the study's wall (created to finished),
medians over ``--repeats`` runs, variants alternating, each on a fresh database and
service, and how many of a trial's spans had their segments on two workers at once.

    python -m bench.segment_units                # rq:2, 3 repeats
    python -m bench.segment_units --quick        # a tiny study, one run each; writes nothing
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from bench import recording
from bench._study import ROOT, load_spec, run_rq

SPEC = ROOT / "examples" / "digits-mlp-segment-units.yaml"
VARIANTS = ("trial", "segment")


def variant(spec: dict[str, Any], units: str) -> dict[str, Any]:
    return {**spec, "name": f"{spec['name']}-{units}",
            "training": {**spec["training"], "units": units}}  # fmt: skip


def quick(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3}}


def measure(spec: dict[str, Any], workers: int, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {units: [] for units in VARIANTS}
    for r in range(repeats):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for units in order:
            with tempfile.TemporaryDirectory(prefix="bench-j-") as tmp:
                run = run_rq(variant(spec, units), Path(tmp), workers)
            study = run.study
            row = {"wall": study["wall_seconds"], "best": study["best"],
                   "packs": len(study["packs"]), "status": study["status"]}  # fmt: skip
            print(f"units: {units}, run {r + 1}: {row['wall']:.1f} s, {row['packs']} packs")
            runs[units].append(row)
    walls = {u: recording.median([r["wall"] for r in rs]) for u, rs in runs.items()}
    bests = {u: {str(r["best"]) for r in rs} for u, rs in runs.items()}
    return {
        "workers": workers,
        "runs": runs,
        "wall": walls,
        "trial_over_segment": walls["trial"] / walls["segment"],
        "same_best": len(bests["trial"] | bests["segment"]) == 1,
    }


def report(result: dict[str, Any]) -> list[str]:
    rows = []
    for units in VARIANTS:
        rs = result["runs"][units]
        best = rs[0]["best"] or {}
        rows.append([
            f"units: {units}", f"{result['wall'][units]:.1f}",
            " ".join(f"{r['wall']:.1f}" for r in rs), recording.median([r["packs"] for r in rs]),
            f"#{best.get('sample_index')} {best.get('value', float('nan')):.4f}",
        ])  # fmt: skip
    lines = recording.table(
        ["variant", "wall (s, median)", "walls (s)", "packs", "best (sample, val_loss)"], rows
    )
    same = "the same best trial in every run" if result["same_best"] else "BEST TRIALS DIFFER"
    lines += [
        "",
        f"- rq:{result['workers']}: units trial / units segment wall = "
        f"**{result['trial_over_segment']:.2f}x** (medians); {same}.",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    recording.output_options(parser, "a tiny study, one run each")
    args = parser.parse_args(argv)
    spec = load_spec(SPEC)
    if args.quick:
        spec, args.repeats = quick(spec), 1
    load = recording.load_average()
    info = recording.machine("cpu")
    result = measure(spec, args.workers, args.repeats)
    body = [f"Study: `{SPEC.relative_to(ROOT)}`, on rq:{args.workers} (PostgreSQL, Redis, "
            f"{args.workers} CPU workers).", "", *report(result)]  # fmt: skip
    recording.publish("segment_units_cpu", "j. segment units", body, info, load,
                      {"result": result}, args)  # fmt: skip


if __name__ == "__main__":
    main()
