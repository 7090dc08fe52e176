"""Write ``bench/RESULTS.md``: one row per figure, from the newest JSON result of each run.

Every benchmark saves its raw figures as JSON under ``bench/results/`` (GPU runs
under ``bench/results/gpu/``) and appends a full section to ``bench/HISTORY.md``.
This command reads the newest JSON of each benchmark and device and writes the
short current table: value, target, machine, commit, command, date.

    python -m bench.summary            # rewrite bench/RESULTS.md
    python -m bench.summary --check    # exit 1 if bench/RESULTS.md is not what it would write
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
RESULTS_MD = BENCH / "RESULTS.md"
#: bench b's study (``bench.study_walltime``'s default spec): runs of another are left out
DEFAULT_STUDY = "examples/digits-mlp.yaml"


@dataclass(frozen=True)
class Row:
    figure: str
    value: str
    target: str
    met: bool | None  # None: no target to meet
    source: Path
    data: dict[str, Any]


def newest(
    pattern: str,
    where: Path | None = None,
    plain: bool = False,
    keep: Callable[[dict[str, Any]], bool] = lambda data: True,
) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The newest result matching ``pattern`` per device: ``{device: (path, data)}``;
    ``plain``: only runs at the default settings (no ``--set``); ``keep``: only results
    it accepts."""
    found = newest_each(pattern, lambda data: [()], keep, plain, where)
    return {device: result for (device,), result in found.items()}


def newest_each(
    pattern: str,
    parts: Callable[[dict[str, Any]], Iterable[tuple[str, ...]]],
    keep: Callable[[dict[str, Any]], bool] = lambda data: True,
    plain: bool = True,
    where: Path | None = None,
) -> dict[tuple[str, ...], tuple[Path, dict[str, Any]]]:
    """The newest result matching ``pattern`` for each part a result measured (``parts``:
    a run of one mode, say, leaves the others' figures to the run that measured them), per
    device: ``{(device, *part): (path, data)}``; ``plain`` and ``keep`` as in
    :func:`newest`."""
    found: dict[tuple[str, ...], tuple[Path, dict[str, Any]]] = {}
    for path in sorted((where or RESULTS).rglob(pattern)):
        data = json.loads(path.read_text())
        if (plain and data.get("settings")) or not keep(data):
            continue
        for part in parts(data):
            key = (data["machine"]["device"], *part)
            if key not in found or data["date"] > found[key][1]["date"]:
                found[key] = (path, data)
    return found


def _ratio(ks: dict[str, Any], k: int, over: str = "serial") -> float:
    entry = ks[str(k)]
    return statistics.median(entry["fused"]) / statistics.median(entry[over])


def fused_rows() -> Iterator[Row]:
    """Fused k=8 (CPU) or k=32 (GPU) trial-steps/s over k one-by-one runs, one torch thread."""
    runs: dict[tuple[str, str], tuple[Path, dict[str, Any]]] = {}
    for path in sorted(RESULTS.rglob("fused_throughput_*.json")):
        data = json.loads(path.read_text())
        device = data["machine"]["device"]
        if device == "cpu" and data.get("threads") != 1:
            continue  # the CPU targets are for one torch thread (the default on 2 cores)
        if data.get("precision", "fp32") != "fp32" or data.get("tf32") is not None:
            continue  # the targets are for float32 at torch's defaults (others: HISTORY.md)
        for workload in data["results"]:
            key = (device, workload)
            if key not in runs or data["date"] > runs[key][1]["date"]:
                runs[key] = (path, data)
    for (device, workload), (path, data) in sorted(runs.items()):
        gpu = device != "cpu"
        k, target = (32, 10.0) if gpu else (8, 2.0)
        ks = data["results"][workload]["ks"]
        if str(k) not in ks or "serial" not in ks[str(k)]:
            continue
        ratio = _ratio(ks, k)
        wanted = (gpu and workload == "digits-cnn") or (not gpu and workload.endswith("-mlp"))
        yield Row(
            f"a. fused / serial trial-steps/s, {workload}, k={k}", f"{ratio:.2f}x",
            f">= {target:g}x" if wanted else "-", ratio >= target if wanted else None, path, data,
        )  # fmt: skip


def study_rows() -> Iterator[Row]:
    """Packed over unpacked study wall time, per way of running it."""

    def default_study(data: dict[str, Any]) -> bool:  # older results name no spec file
        return data.get("spec_file", DEFAULT_STUDY) == DEFAULT_STUDY

    def modes(data: dict[str, Any]) -> list[tuple[str]]:
        return [(mode,) for mode in data["summary"]]

    results = newest_each("study_walltime_*.json", modes, keep=default_study)
    for (device, mode), (path, data) in sorted(results.items()):
        target = 3.0 if device == "cpu" else 5.0
        summary = data["summary"][mode]
        ratio = summary["ratio_of_medians"]
        yield Row(
            f"b. study unpacked / packed wall time, {mode}",
            f"{ratio:.2f}x ({summary['unpacked_wall']:.1f} s / {summary['packed_wall']:.1f} s)"
            f"{'' if summary['best_agree'] else ', best trials differ'}",
            f">= {target:g}x", ratio >= target and summary["best_agree"], path, data,
        )  # fmt: skip


def peer_rows() -> Iterator[Row]:
    """The same study run by packtune and by its peers: wall time and best trial."""
    for _, (path, data) in sorted(newest("peers_*.json").items()):
        walls = {n: statistics.median(r["wall"] for r in rs) for n, rs in data["runs"].items()}
        best = {n: statistics.median(r["best"] for r in rs) for n, rs in data["runs"].items()}
        for name in sorted(walls):
            if name == "packtune":
                continue
            ratio = walls[name] / walls["packtune"]
            yield Row(
                f"c. {name} wall / packtune wall, same study",
                f"{ratio:.2f}x ({walls[name]:.1f} s / {walls['packtune']:.1f} s); best val_loss "
                f"{best[name]:.4f} vs packtune {best['packtune']:.4f}",
                "> 1x", ratio > 1.0, path, data,
            )  # fmt: skip


def quality_rows() -> Iterator[Row]:
    """Best val_loss against wall time: packtune's model-based sampler against Optuna's."""
    for _, (path, data) in sorted(newest("quality_*.json").items()):
        summary = data["summary"]
        final, wall = summary["final_best"], summary["wall"]
        if "optuna" not in final or "packtune-tpe" not in final:
            continue
        seeds = len(data["runs"]["optuna"])
        at = summary["at_optuna_wall"]
        yield Row(
            f"f. median best val_loss at Optuna's wall time ({seeds} seeds), packtune tpe",
            f"{at['packtune-tpe']:.4f} vs Optuna {at['optuna']:.4f} (random: "
            f"{at.get('packtune-random', float('nan')):.4f})",
            "<= Optuna's", at["packtune-tpe"] <= at["optuna"], path, data,
        )  # fmt: skip
        reach = summary["time_to_optuna_best"].get("packtune-tpe")
        half = 0.5 * wall["optuna"]
        shown = "never" if reach is None else f"{reach:.1f} s"
        yield Row(
            "f. time to Optuna's final median best, packtune tpe",
            f"{shown} (Optuna's wall {wall['optuna']:.1f} s)",
            "<= half Optuna's wall", reach is not None and reach <= half, path, data,
        )  # fmt: skip


def _repeats(entry: dict[str, Any], key: str) -> str:
    """Where bench g ran its runs several times: the repeats' own figures (the value is
    their median)."""
    each = [v for v in entry.get(f"{key}_each") or [] if v is not None]
    if len(each) < 2:
        return ""
    return f"; median of {len(each)} repeats: " + ", ".join(f"{v:.2f}x" for v in each)


def multi_rows() -> Iterator[Row]:
    """Many studies on one fleet: makespan against the studies one after another, and a
    small study's time behind a large one against its time alone. Each (mode, pattern)
    from the newest run that measured it with every variant (sequential, today, new)."""
    from bench.multi_study import VARIANTS

    def every_variant(data: dict[str, Any]) -> bool:  # older results name none: all ran
        return set(VARIANTS) <= set(data.get("variants", VARIANTS))

    def measured(data: dict[str, Any]) -> list[tuple[str, str]]:
        return [
            (name, pattern)
            for name, summary in data["summary"].items()
            for pattern in ("at-once", "behind")
            if summary.get(pattern)
        ]

    chosen = newest_each("multi_study_*.json", measured, keep=every_variant)
    for (_, name, pattern), (path, data) in sorted(chosen.items()):
        row = _multi_row(name, pattern, path, data)
        if row is not None:
            yield row


def _multi_row(name: str, pattern: str, path: Path, data: dict[str, Any]) -> Row | None:
    """``name``'s row of ``pattern`` in the run ``data``, None where it has no figure."""
    from bench.multi_study import runners_of

    summary = data["summary"][name][pattern]
    runs = data.get("runs", {}).get(name, [])
    runners = max((runners_of(r.get("settings", {})) for r in runs), default=1)
    mode = f"{name} (new: {runners} runners)" if runners > 1 else name
    if pattern == "at-once":
        ratio = summary.get("sequential_over_new")
        if ratio is None:
            return None
        return Row(
            f"g. {len(data['fleet'])} studies at once, sequential / new makespan, {mode}",
            f"{ratio:.2f}x (today's scheduler's makespan / new: "
            f"{summary.get('today_over_new') or float('nan'):.2f}x)"
            + _repeats(summary, "sequential_over_new"),
            ">= 1.5x", ratio >= 1.5, path, data,
        )  # fmt: skip
    small = summary.get("small_over_alone")
    if small is None:
        return None
    return Row(
        f"g. a small study behind a large one, x its time alone, {mode}",
        f"{small:.2f}x (today's scheduler: "
        f"{summary.get('today_small_over_alone') or float('nan'):.2f}x)"
        + _repeats(summary, "small_over_alone"),
        "<= 2x", small <= 2.0, path, data,
    )  # fmt: skip


def scheduler_rows() -> Iterator[Row]:
    """The scheduler's worst tick over a study of ~10,000 trials, and over 20 studies of as
    many together, per database."""
    for pattern in ("scheduler_scale.json", "scheduler_scale_studies*.json"):
        yield from _scheduler_rows(pattern)


def _scheduler_rows(pattern: str) -> Iterator[Row]:
    for _, (path, data) in sorted(newest(pattern).items()):
        for backend, raw in sorted(data["raw"].items()):
            timed = raw["timed"]
            worst = max(t["seconds"] for t in timed["ticks"])
            studies = timed.get("studies", 1)
            where = f" in {studies} studies" if studies > 1 else ""
            yield Row(
                f"d. worst scheduler tick, {timed['trials']:,} trials{where}, {backend}",
                f"{worst:.2f} s", "< 1 s", worst < 1.0, path, data,
            )  # fmt: skip


def spill_rows() -> Iterator[Row]:
    """Spilled over in-memory trial-steps/s of a model twice its device budget, per device
    (on a GPU with the bound the host-to-device bandwidth sets)."""
    for _, (path, data) in sorted(newest("spill_*.json").items()):
        r = data["result"]
        value = (
            f"{r['fraction']:.2f}x ({r['spilled_steps_per_s']:.3g} / "
            f"{r['memory_steps_per_s']:.3g} steps/s, {r['shards']} shards)"
        )
        if r.get("bound_steps_per_s"):
            value += f"; bus bound {r['bound_steps_per_s']:.3g} steps/s"
        yield Row("h. spilled / in-memory trial-steps/s, model 2x the budget", value,
                  "stated", None, path, data)  # fmt: skip
        alternation = r.get("alternation")
        if alternation and data["machine"]["device"] != "cpu":  # a GPU figure (module doc)
            gain = alternation["sequential_s"] / alternation["alternating_s"]
            yield Row("h. two spilled trials, one after another / alternating", f"{gain:.2f}x",
                      "> 1x", gain > 1, path, data)  # fmt: skip


def decoupled_rows() -> Iterator[Row]:
    """Decoupled training (synthetic intermediate labels) against end to end: accuracy,
    bytes per step and seconds per trial, medians over seeds."""
    for _, (path, data) in sorted(newest("decoupled_*.json").items()):
        e2e, dec = data["summary"]["end_to_end"], data["summary"]["decoupled"]
        value = (
            f"accuracy {dec['accuracy']:.3f} vs {e2e['accuracy']:.3f}; bytes per step "
            f"{dec['step_bytes'] / e2e['step_bytes']:.2f}x; seconds per trial "
            f"{dec['seconds'] / e2e['seconds']:.2f}x"
        )
        if "packtune_seconds" in dec:  # the worker's path, segments at once
            value += f" ({dec['packtune_seconds'] / e2e['packtune_seconds']:.2f}x in a worker)"
        yield Row("i. decoupled / end-to-end training, 6-layer MLP cut in two (digits)", value,
                  "similar accuracy, less memory", dec["accuracy"] >= e2e["accuracy"] - 0.01
                  and dec["step_bytes"] < e2e["step_bytes"], path, data)  # fmt: skip


def segment_unit_rows() -> Iterator[Row]:
    """A decoupled study's wall with its segments trained together over its wall with each
    segment a unit of its own, on RQ workers (the same values at every rung)."""
    for _, (path, data) in sorted(newest("segment_units_*.json").items()):
        r = data["result"]
        walls = r["wall"]
        value = (
            f"{r['trial_over_segment']:.2f}x ({walls['trial']:.1f} s / {walls['segment']:.1f} s)"
            + ("" if r["same_best"] else "; best trials differ")
        )
        yield Row(f"j. decoupled study, units trial / units segment wall, rq:{r['workers']}",
                  value, "stated", None, path, data)  # fmt: skip


def owner_rows() -> Iterator[Row]:
    """One user's study beside another user's three on one runner: its time over its time
    alone, with owner labels (half the device) and without (a quarter)."""
    for _, (path, data) in sorted(newest("owners_*.json").items()):
        s = data["result"]["summary"]
        owners, plain = s["owners"]["bob_over_alone"], s["unlabelled"]["bob_over_alone"]
        yield Row("k. one user's study beside another's three, x its time alone, serve",
                  f"{owners:.2f}x with owners (unlabelled: {plain:.2f}x)", "<= 2x",
                  owners <= 2.0, path, data)  # fmt: skip


def load_rows() -> Iterator[Row]:
    """Read endpoints' p99 latency under 100 clients, per database."""
    for path in sorted(RESULTS.rglob("load_*.json")):
        data = json.loads(path.read_text())
        p99 = data["p99_ms"]
        yield Row(
            f"read endpoints p99, {data['clients']} clients, {data['database']}",
            f"{p99:.1f} ms ({data['requests']} GETs, {data['errors']} errors)", "< 50 ms",
            p99 < 50 and data["errors"] == 0, path, data,
        )  # fmt: skip


def commit_of(row: Row) -> str:
    """The commit the figure was measured at; for results saved before JSON carried it,
    the commit that recorded the JSON, marked so."""
    if row.data.get("commit"):
        return str(row.data["commit"])
    recorded = row.data.get("recorded_at_commit")
    return f"{recorded} (recorded)" if recorded else "?"


def machine_of(data: dict[str, Any]) -> str:
    m = data["machine"]
    device = m["device"] if m["device"] != "cpu" else f"{m['cpu']} CPU"
    return f"{device}, {m['cores']} cores, torch {m['torch']}"


def render() -> str:
    rows = [
        *fused_rows(),
        *study_rows(),
        *peer_rows(),
        *quality_rows(),
        *multi_rows(),
        *scheduler_rows(),
        *spill_rows(),
        *decoupled_rows(),
        *segment_unit_rows(),
        *owner_rows(),
        *load_rows(),
    ]
    lines = [
        "# Benchmark results",
        "",
        "The current figure of each benchmark: the newest JSON result in `bench/results/`,",
        "written by `python -m bench.summary` (do not edit by hand). Every run's full",
        "section, with the load average and per-run figures, is in [HISTORY.md](HISTORY.md);",
        "how to run each benchmark is in [README.md](README.md). Ratios are measured side by",
        "side in one run; figures from different machines or sessions are not comparable.",
        'Commit: the one measured; "(recorded)": a result saved before JSON carried it,',
        "and the commit that recorded its JSON.",
        "",
        "| figure | value | target | met | machine | commit | command | date |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        met = {True: "yes", False: "**no**", None: ""}[row.met]
        command = str(row.data["command"]).replace("|", "\\|")
        lines.append(
            f"| {row.figure} | {row.value} | {row.target} | {met} | {machine_of(row.data)} | "
            f"{commit_of(row)} | `{command}` | {row.data['date']} |"
        )
    if not any(True for _ in load_rows()):
        lines += [
            "",
            "Read endpoints under load (`python -m bench.load --results`): no JSON "
            "result yet; the runs before JSON results are in HISTORY.md.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if RESULTS_MD.read_text() != text:
            print("bench/RESULTS.md is stale: run python -m bench.summary", file=sys.stderr)
            return 1
        return 0
    RESULTS_MD.write_text(text)
    print(f"wrote {RESULTS_MD.relative_to(BENCH.parent)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
