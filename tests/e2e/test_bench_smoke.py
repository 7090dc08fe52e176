"""Each benchmark's ``--quick`` mode runs to the end (tiny sizes; nothing is written).

These check that the benchmark scripts still work against the code they
measure; they time nothing. The peers part needs the ``bench`` extra and skips
without it. (``study_walltime --quick`` in its ``embedded``
mode runs two ``packtune run``, ~10-20 s: it is left to
``python -m bench.study_walltime --quick``; tests/e2e/test_e2e.py covers the same
path. Its ``serve`` mode, which the GPU figures rest on, is run here.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import recording


@pytest.fixture(autouse=True)
def results_untouched(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Quick runs must not append to bench/HISTORY.md: point it at a file that must stay absent."""
    monkeypatch.setattr(recording, "HISTORY_MD", tmp_path / "HISTORY.md")
    yield
    assert not (tmp_path / "HISTORY.md").exists()


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ")]


def recorded(folder: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """What ``python -m bench.record FOLDER ARGS`` appends to HISTORY.md for the JSON in
    ``folder`` (as a GPU box's ``--out-dir`` holds it), written aside: the quick run itself
    appended nothing (``results_untouched``)."""
    from bench import record

    history = folder / "recorded_history"
    monkeypatch.setattr(recording, "HISTORY_MD", history)
    record.main([str(folder), *args])
    return history.read_text()


def test_a_wholly_busy_span_is_busy_one_not_more() -> None:
    """Tick counts over HZ round: 2,090 ticks, all busy, came out 1.0000000000042 busy."""
    hz = 100
    before = (145_272_509 / hz, 16_940_109 / hz)
    after = ((145_272_509 + 2_090) / hz, (16_940_109 + 2_090) / hz)
    assert recording.busy_between(before, after) == 1.0
    assert recording.busy_between(before, (after[0], before[1] + 10.45)) == pytest.approx(0.5)


def test_fused_throughput_quick(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import fused_throughput

    fused_throughput.main(["--quick", "--workloads", "synthetic-mlp", "--max-concurrent", "1"])
    out = capsys.readouterr().out
    assert "| synthetic-mlp | 1 |" in out and "| synthetic-mlp | 2 |" in out


def test_fused_throughput_hand_fused_and_compiled_quick(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench's three variants, its compiled step traced by torch's ``aot_eager`` backend
    (the same tracing and guards, no code generated: ~20 s less on a 2-core CPU);
    inductor's generated steps are tested against eager ones in tests/worker/test_compiled.py."""
    from bench import fused_throughput
    from worker import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")

    fused_throughput.main(["--quick", "--workloads", "digits-cnn", "--variants", "fused",
                           "hand-fused", "compiled", "--ks", "2", "--repeats", "1"])  # fmt: skip
    compiled.reset()
    out = capsys.readouterr().out
    assert "digits-cnn k=2: compiled in" in out
    row = next(line for line in out.splitlines() if line.startswith("| digits-cnn | 2 |"))
    cells = [cell.strip() for cell in row.strip(" |").split("|")]
    # hand-fused / fused and compiled / fused, every variant measured
    assert cells[-2].endswith("x") and cells[-1].endswith("x"), row


def test_fused_throughput_in_bf16_without_tf32_quick(tmp_path: Path) -> None:
    from bench import fused_throughput

    fused_throughput.main(["--quick", "--workloads", "digits-mlp", "--variants", "fused",
                           "serial", "--ks", "2", "--precision", "bf16", "--tf32", "off",
                           "--out-dir", str(tmp_path)])  # fmt: skip
    path = tmp_path / "fused_throughput_cpu_digits-mlp_bf16_tf32-off.json"  # not fp32's file
    data = json.loads(path.read_text())
    assert (data["precision"], data["tf32"]) == ("bf16", False)
    run = data["results"]["digits-mlp"]
    assert run["config"]["precision"] == "bf16"
    assert run["ks"]["2"]["fused"] and run["ks"]["2"]["serial"]


def test_spill_quick(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench h's quick run; its JSON renders into HISTORY.md as the run printed it
    (bench.record, for a run on a GPU box)."""
    from bench import spill

    spill.main(["--quick", "--alternate", "--out-dir", str(tmp_path), "--no-append"])
    result = json.loads((tmp_path / "spill_cpu.json").read_text())["result"]
    assert result["shards"] >= 2 and result["spilled_steps_per_s"] > 0
    assert result["alternation"]["alternating_s"] > 0
    printed = table_rows(capsys.readouterr().out)
    text = recorded(tmp_path, monkeypatch)
    assert "## h. spilled training\n" in text
    assert printed and table_rows(text) == printed


def test_decoupled_quick(tmp_path: Path) -> None:
    from bench import decoupled

    decoupled.main(["--quick", "--out-dir", str(tmp_path), "--no-append"])
    summary = json.loads((tmp_path / "decoupled_cpu.json").read_text())["summary"]
    assert summary["decoupled"]["step_bytes"] < summary["end_to_end"]["step_bytes"]


@pytest.mark.postgres
@pytest.mark.redis
def test_segment_units_quick(tmp_path: Path, postgres_url: str, redis_url: str) -> None:
    """Both variants on two RQ workers (the servers: the fixtures fail without them)."""
    from bench import segment_units

    segment_units.main(["--quick", "--out-dir", str(tmp_path), "--no-append"])
    result = json.loads((tmp_path / "segment_units_cpu.json").read_text())["result"]
    assert result["same_best"] and set(result["wall"]) == {"trial", "segment"}


def test_owners_quick(tmp_path: Path) -> None:
    """Bob alone, then four studies labelled with owners and four unlabelled, on one serve."""
    from bench import owners

    owners.main(["--quick", "--out-dir", str(tmp_path), "--no-append"])
    summary = json.loads((tmp_path / "owners_cpu.json").read_text())["result"]["summary"]
    assert summary["alone"] > 0
    for variant in ("owners", "unlabelled"):
        assert (
            summary[variant]["bob"] > 0 and summary[variant]["makespan"] >= summary[variant]["bob"]
        )


def test_scheduler_scale_quick(tmp_path: Path) -> None:
    from bench import scheduler_scale

    scheduler_scale.main(["--quick", "--backends", "sqlite", "--out-dir", str(tmp_path)])
    raw = json.loads((tmp_path / "scheduler_scale.json").read_text())["raw"]["sqlite"]
    assert raw["timed"]["status"] == "completed" and raw["timed"]["trials"] == 49


@pytest.mark.slow
def test_study_walltime_quick_serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``packtune serve`` up, a warm-up study, then the measured one POSTed, packed and not;
    ``--set`` gives the service a setting for the run's life."""
    from bench import _study, study_walltime

    envs: list[dict[str, str]] = []
    start_serve = _study.start_serve
    monkeypatch.setattr(
        _study, "start_serve", lambda env, log: (envs.append(env), start_serve(env, log))[1]
    )
    study_walltime.main(["--quick", "--modes", "serve", "--out-dir", str(tmp_path),
                         "--set", "torch_threads=1"])  # fmt: skip
    assert envs and all(env["PACKTUNE_TORCH_THREADS"] == "1" for env in envs)
    assert _study.EXTRA_SETTINGS == {}  # for the run's life only
    [path] = tmp_path.glob("study_walltime_*.json")
    data = json.loads(path.read_text())
    # a run with settings of its own: named and marked so (RESULTS.md leaves it out)
    assert path.name.endswith("_torch_threads-1.json") and data["settings"] == {
        "torch_threads": "1"
    }
    runs = data["runs"]["serve"]
    assert sorted(r["packed"] for r in runs) == [False, True]
    assert all(r["status"] == "completed" for r in runs)
    assert data["summary"]["serve"]["best_agree"]
    packed, unpacked = sorted(runs, key=lambda r: not r["packed"])
    assert len(packed["packs"]) < len(unpacked["packs"])  # the warm-up's study is not counted
    assert max(p["size"] for p in unpacked["packs"]) == 1


@pytest.mark.slow
def test_multi_study_quick_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench g: three tiny studies on one ``packtune serve``, one after another with today's
    scheduler, then at once and a small one behind a large one with the new one on two
    embedded runners; every study completes in every run. (``today`` at once and the
    staggered pattern differ from these only in settings and sleeps: left to the full
    bench, for the suite's time.) Its JSON renders into HISTORY.md as the run printed it
    (bench.record, for a run on a GPU box)."""
    from bench import multi_study

    multi_study.main(
        [
            "--quick",
            "--modes",
            "serve",
            "--variants",
            "sequential",
            "new",
            "--patterns",
            "at-once",
            "behind",
            "--runners",
            "2",
            "--out-dir",
            str(tmp_path),
        ]
    )
    data = json.loads(next(tmp_path.glob("multi_study_*.json")).read_text())
    runs = data["runs"]["serve"]
    assert [multi_study.label(r) for r in runs] == [
        "sequential", "new (2 runners) at-once", "new (2 runners) behind",
    ]  # fmt: skip
    assert [r["workers"] for r in runs] == [1, 2, 2]
    names = [m["name"] for m in data["fleet"]]
    small = next(m["name"] for m in data["fleet"] if m["small"])
    for run in runs:
        wanted = [names[0], small] if run["pattern"] == "behind" else names
        assert [s["name"] for s in run["studies"]] == wanted
        assert all(s["status"] == "completed" and s["best"] is not None for s in run["studies"])
        assert 0 < run["busy_fraction"] <= 1.0 + 1e-6 and run["makespan"] > 0
        # training is part of the packs' time: at most the device's whole busy time (over
        # the span busy_fraction is of: sequential's makespan is the sum of its studies'
        # times alone, its span the first creation to the last end, gaps included)
        busy = run["busy_fraction"] * run.get("span", run["makespan"]) * run["workers"]
        assert 0 < run["train_seconds"] <= busy + 0.05, run
        assert 0 <= run["packs_gave_up"] + run["packs_withdrawn"] <= run["packs"]
        assert 0 < run["machine_busy"] <= 1.0  # studies trained: the machine was busy
        if run["settings"]["share_packs"] == "false":
            assert run["shared_packs"] == 0  # one study per pack
    assert set(data["summary"]["serve"]["alone"]) == set(names)
    printed = table_rows(capsys.readouterr().out)
    text = recorded(tmp_path, monkeypatch)
    assert "## g. Many studies on one fleet — cpu" in text
    assert f"Fleet: {len(names)} studies" in text
    assert printed and table_rows(text) == printed


def test_multi_study_repeats_pair_each_ratio_within_its_repeat() -> None:
    """bench g --repeats: each ratio is taken within one repeat (its own studies alone, its
    own runs), then the median over the repeats; RESULTS.md's row shows the repeats'."""
    from bench import multi_study, summary

    fleet = multi_study.QUICK_FLEET
    small = multi_study.small_of(fleet)

    def run(variant: str, pattern: str, repeat: int, times: list[float]) -> dict[str, object]:
        studies = [{"name": m.name, "completion": t, "best": 0.1}
                   for m, t in zip(fleet, times, strict=True)]  # fmt: skip
        if pattern == "behind":
            studies = [s for s in studies if s["name"] in (fleet[0].name, small)]
        return {"variant": variant, "pattern": pattern, "repeat": repeat, "settings": {},
                "makespan": max(times) if variant != "sequential" else sum(times),
                "mean_completion": sum(times) / len(times), "busy_fraction": 0.5,
                "packs": 3, "shared_packs": 0, "cross_study_stacks": 0, "bench_seconds": 9.0,
                "studies": studies}  # fmt: skip

    # repeat 0: alone 2+2+2 = 6 s, new at once 5 s (1.2x); repeat 1: alone 3+3+3 = 9 s,
    # new at once 5 s (1.8x); the small study behind: 4 s against 2 s, then 3 s against 3 s
    runs = {"serve": [
        run("sequential", "-", 0, [2.0, 2.0, 2.0]), run("new", "at-once", 0, [5.0, 5.0, 5.0]),
        run("new", "behind", 0, [5.0, 4.0, 5.0]),
        run("sequential", "-", 1, [3.0, 3.0, 3.0]), run("new", "at-once", 1, [5.0, 5.0, 5.0]),
        run("new", "behind", 1, [5.0, 3.0, 5.0]),
    ]}  # fmt: skip
    lines, got = multi_study.summarise(runs, fleet)
    at_once, behind = got["serve"]["at-once"], got["serve"]["behind"]
    assert at_once["sequential_over_new_each"] == pytest.approx([1.2, 1.8])
    assert at_once["sequential_over_new"] == pytest.approx(1.5)  # not 7.5 / 5 of the medians
    assert behind["small_over_alone_each"] == pytest.approx([2.0, 1.0])
    assert behind["small_over_alone"] == pytest.approx(1.5)
    assert got["serve"]["alone"][small] == pytest.approx(2.5) and got["serve"]["repeats"] == 2
    assert any("per repeat: 1.20x, 1.80x" in line for line in lines)
    assert summary._repeats(at_once, "sequential_over_new") == (
        "; median of 2 repeats: 1.20x, 1.80x"
    )
    assert summary._repeats({"sequential_over_new_each": [1.3]}, "sequential_over_new") == ""


def test_peers_quick_optuna(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("optuna")
    from bench import peers

    peers.main(["--quick", "--systems", "optuna"])
    assert "| optuna |" in capsys.readouterr().out


def test_an_optuna_study_of_one_seed_has_one_name() -> None:
    """Optuna's HyperbandPruner picks a trial's bracket from a hash of the study's name and
    the trial's number (and an unnamed study's name is random): the bench names its studies
    after the spec and seed, so that runs of one seed train the same brackets."""
    optuna = pytest.importorskip("optuna")
    from bench import peers

    def name(seed: int) -> str:
        spec = {"name": "digits", "seed": seed, "hyperband": {"max_resource": 27, "eta": 3}}
        return str(peers.optuna_study(spec, optuna.samplers.RandomSampler(seed=seed)).study_name)

    assert name(2) == name(2) != name(3)


def test_quality_quick_all_systems(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench f: packtune's two samplers and Optuna run the same tiny study to the end, each
    with a best-so-far curve from its own clock; its JSON, as a GPU box writes it
    (``--out-dir``, ``--no-append``), renders into HISTORY.md here (bench.record)."""
    from bench import quality

    quality.main(["--quick", "--out-dir", str(tmp_path), "--no-append"])
    out = capsys.readouterr().out
    for name in quality.SYSTEMS:
        assert f"| {name} |" in out
        line = next(x for x in out.splitlines() if x.startswith(f"| {name} |"))
        best = float(line.split("|")[4])
        assert 0 < best < 5, line  # a finite val_loss was reached at max_resource
    text = recorded(tmp_path, monkeypatch, "--via", "bash bench/gpu_run.sh")
    assert "## f. best val_loss against wall time" in text
    assert "- command: `bash bench/gpu_run.sh` → `" in text  # the wrapper, then the run's own
    assert table_rows(text) == table_rows(out)  # the same table as the run printed


def test_plots_from_quick_results(tmp_path: Path) -> None:
    from bench import fused_throughput, plots

    fused_throughput.main(["--quick", "--workloads", "synthetic-mlp", "--variants", "fused",
                           "serial", "--out-dir", str(tmp_path)])  # fmt: skip
    plots.main(["--results", str(tmp_path), "--out", str(tmp_path / "png")])
    png = tmp_path / "png" / "throughput_cpu.png"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_throughput_plot_is_of_each_devices_fullest_run() -> None:
    """A rerun of a subset of workloads writes its own JSON (sorted after the full run's):
    the device's plot is of the run of the most workloads, the newest of those, whatever
    order the files come in. (It was the last file in name order, a two-workload rerun.)"""
    from bench import plots

    def run(device: str, workloads: list[str], date: str) -> dict[str, object]:
        return {"machine": {"device": device}, "date": date,
                "results": {w: {"ks": {}} for w in workloads}}  # fmt: skip

    full = run("cpu", ["a", "b", "c"], "2026-11-22 15:51 UTC")
    newer_full = run("cpu", ["a", "b", "c"], "2026-11-25 02:39 UTC")
    subset = run("cpu", ["a", "b"], "2026-11-26 10:00 UTC")
    gpu = run("NVIDIA H100 80GB HBM3", ["a"], "2026-11-22 22:23 UTC")
    for runs in ([full, newer_full, subset, gpu], [gpu, subset, newer_full, full]):
        assert plots.fullest(runs) == {"cpu": newer_full, "h100": gpu}


def test_quality_plot_from_the_recorded_result(tmp_path: Path) -> None:
    """Bench f's plot (best so far against seconds, per system) is drawn again from its
    JSON, so bench/plots/ can follow bench/results/ without running the benchmark."""
    from bench import plots
    from bench.recording import RESULTS_DIR

    [recorded] = RESULTS_DIR.glob("quality_cpu.json")
    png = plots.quality_plot(json.loads(recorded.read_text()), tmp_path)
    assert png.name == "quality_cpu.png" and png.read_bytes()[:4] == b"\x89PNG"


def test_results_md_is_what_the_summary_writes() -> None:
    """bench/RESULTS.md is generated from bench/results/**/*.json: never stale."""
    from bench import summary

    assert summary.main(["--check"]) == 0
    rows = [
        line
        for line in summary.RESULTS_MD.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| figure")
    ]
    assert len(rows) >= 10 and all(line.count(" | ") == 7 for line in rows)
