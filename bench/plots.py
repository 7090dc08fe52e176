"""Benchmark e: PNG plots from the JSON the other benchmarks wrote.

- ``throughput_<device>.png``: trial-steps/s against k per workload, one line
  per variant (fused, serial, concurrent), from ``fused_throughput_*.json``;
- ``timeline_<device>.png``: the packs of one packed and one unpacked run
  of the study on a time axis (queued, then training), from
  ``study_walltime_*.json``;
- ``quality_<device>.png``: best val_loss so far against seconds, median and spread over
  seeds, per system (packtune's samplers, Optuna), from ``quality_*.json`` (bench f draws
  it too when it runs with matplotlib installed).

    python -m bench.plots            # reads bench/results (and bench/results/gpu)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.recording import BENCH_DIR, RESULTS_DIR, median

PLOTS_DIR = BENCH_DIR / "plots"
COLOURS = {"fused": "#1b6ca8", "serial": "#c0392b", "concurrent": "#7f8c8d"}


def _device(data: dict[str, Any]) -> str:
    return str(data["machine"]["device"])


def _slug(device: str) -> str:
    return "cpu" if device == "cpu" else device.split()[1].lower() if " " in device else device


def fullest(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per device, the throughput run to plot: the one of the most workloads, the newest of
    those (a rerun of a subset of the workloads writes its own JSON beside the full run's,
    and the plot of each device has one file)."""
    out: dict[str, dict[str, Any]] = {}
    for data in sorted(runs, key=lambda d: (len(d["results"]), str(d.get("date", "")))):
        out[_slug(_device(data))] = data  # the last of a device's, in this order, stays
    return out


def throughput_plot(data: dict[str, Any], out: Path) -> Path:
    import matplotlib.pyplot as plt

    results = data["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items(), strict=True):
        ks = sorted(int(k) for k in res["ks"])
        for variant, colour in COLOURS.items():
            points = [
                (k, median(res["ks"][str(k)].get(variant, [])))
                for k in ks
                if res["ks"][str(k)].get(variant)
            ]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=variant, color=colour)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("k (trials on the device)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("trial-steps / s")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Throughput against k — {_device(data)}", fontsize=11)
    fig.tight_layout()
    path = out / f"throughput_{_slug(_device(data))}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def timeline_plot(data: dict[str, Any], out: Path) -> Path:
    import matplotlib.pyplot as plt

    runs = data["runs"].get("embedded") or next(iter(data["runs"].values()))
    chosen = [next(r for r in runs if r["packed"]), next(r for r in runs if not r["packed"])]
    end = max(r["wall_seconds"] for r in chosen)
    fig, axes = plt.subplots(2, 1, figsize=(8, 4.6), sharex=True)
    for ax, run in zip(axes, chosen, strict=True):
        for row, pack in enumerate(run["packs"]):
            if pack["started"] is None or pack["finished"] is None:
                continue
            queued = pack["enqueued"] if pack["enqueued"] is not None else pack["started"]
            ax.barh(row, pack["started"] - queued, left=queued, color="#d5d8dc", height=0.8)
            ax.barh(
                row,
                pack["finished"] - pack["started"],
                left=pack["started"],
                color=COLOURS["fused" if run["packed"] else "serial"],
                height=0.8,
            )
        label = "packed" if run["packed"] else "unpacked (max_pack_size 1)"
        ax.set_title(f"{label}: {len(run['packs'])} jobs, {run['wall_seconds']:.1f} s", fontsize=10)
        ax.set_ylabel("pack")
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.02)
    axes[-1].set_xlabel("seconds since the study was created (grey: queued; colour: in the job)")
    fig.suptitle(f"{data['spec']['name']} — {_device(data)}, {runs[0]['mode']}", fontsize=11)
    fig.tight_layout()
    path = out / f"timeline_{_slug(_device(data))}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def quality_plot(data: dict[str, Any], out: Path) -> Path:
    from bench.quality import plot

    path = out / f"quality_{_slug(_device(data))}.png"
    plot(data["runs"], data["summary"], path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", type=Path, nargs="+", default=[RESULTS_DIR, RESULTS_DIR / "gpu"]
    )
    parser.add_argument("--out", type=Path, default=PLOTS_DIR)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    args.out.mkdir(parents=True, exist_ok=True)
    for folder in args.results:
        runs = [json.loads(p.read_text()) for p in sorted(folder.glob("fused_throughput_*.json"))]
        for data in fullest(runs).values():
            print(throughput_plot(data, args.out))
        for path in sorted(folder.glob("study_walltime_*.json")):
            print(timeline_plot(json.loads(path.read_text()), args.out))
        for path in sorted(folder.glob("quality_*.json")):
            print(quality_plot(json.loads(path.read_text()), args.out))


if __name__ == "__main__":
    main()
