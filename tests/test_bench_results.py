"""Which result files make bench b's row of RESULTS.md.

``bench.study_walltime --spec other.yaml`` saved its JSON under the default study's name
(``study_walltime_cpu.json``), and ``bench.summary`` took the newest file as bench b's
figure: a run of another study (a dropout model, say) replaced the row of the study the
target is set for. Such a run is now named after its spec and left out of the row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import multi_study, study_walltime, summary


def test_a_run_of_another_spec_is_named_after_it() -> None:
    default, other = study_walltime.DEFAULT_SPEC, Path("examples/digits-mlp-dropout.yaml")
    assert study_walltime.result_name(default, "cpu", {}) == "study_walltime_cpu"
    assert study_walltime.result_name(other, "cpu", {}) == "study_walltime_cpu_digits-mlp-dropout"
    assert (
        study_walltime.result_name(other, "cpu", {"torch_threads": "1"})
        == "study_walltime_cpu_digits-mlp-dropout_torch_threads-1"
    )


def _result(
    folder: Path, name: str, date: str, ratio: float, spec_file: str | None,
    modes: tuple[str, ...] = ("serve",),
) -> None:  # fmt: skip
    figures = {"ratio_of_medians": ratio, "unpacked_wall": 10.0 * ratio, "packed_wall": 10.0,
               "best_agree": True}  # fmt: skip
    data = {
        "machine": {"device": "cpu", "cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu"},
        "date": date, "command": "python -m bench.study_walltime", "settings": {},
        "summary": {mode: figures for mode in modes},
        **({"spec_file": spec_file} if spec_file is not None else {}),
    }  # fmt: skip
    (folder / f"{name}.json").write_text(json.dumps(data))


def test_bench_b_s_row_is_the_default_study_s_newest_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(summary, "RESULTS", tmp_path)
    _result(tmp_path, "study_walltime_cpu", "2026-11-28 10:00 UTC", 2.5, None)  # before spec_file
    _result(tmp_path, "study_walltime_cpu_digits-mlp-dropout", "2026-11-29 10:00 UTC", 2.4,
            "examples/digits-mlp-dropout.yaml")  # fmt: skip
    [row] = summary.study_rows()
    assert row.value.startswith("2.50x"), row
    _result(tmp_path, "study_walltime_cpu_again", "2026-11-29 11:00 UTC", 2.7,
            summary.DEFAULT_STUDY)  # fmt: skip
    [row] = summary.study_rows()
    assert row.value.startswith("2.70x"), row


def test_fused_step_ab_takes_what_ab_sh_passes_and_writes_its_figures(tmp_path: Path) -> None:
    """``bench/ab.sh`` adds ``--out-dir DIR --no-append`` to its command: fused_step_ab
    refused both ('unrecognized arguments'), so an A/B of it had to be run by hand."""
    from bench import fused_step_ab

    fused_step_ab.main(["--workload", "synthetic-mlp", "--k", "2", "--steps", "2",
                        "--pairs", "2", "--threads", "1", "--out-dir", str(tmp_path),
                        "--no-append"])  # fmt: skip
    data = json.loads((tmp_path / "fused_step_ab_synthetic-mlp_k2.json").read_text())
    assert data["k"] == 2 and len(data["ratios"]) == 2 and data["fused_ms"] > 0
    assert data["machine"]["device"] == "cpu" and data["commit"]


def test_bench_b_s_run_of_one_mode_keeps_the_other_mode_s_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench.study_walltime --modes serve`` saved its JSON under the name of a run of
    every mode, so the embedded row left RESULTS.md. It is named after its mode now, and
    each mode's row is the newest run of the default study that measured it."""
    monkeypatch.setattr(summary, "RESULTS", tmp_path)
    spec = study_walltime.DEFAULT_SPEC
    assert study_walltime.result_name(spec, "cpu", {}, ["embedded", "rq:1", "rq:2"]) == (
        "study_walltime_cpu"
    )
    both = study_walltime.result_name(spec, "cpu", {}, ["embedded", "serve"])
    one = study_walltime.result_name(spec, "cpu", {}, ["serve"])
    assert (both, one) == ("study_walltime_cpu_embedded_serve", "study_walltime_cpu_serve")
    _result(tmp_path, both, "2026-11-28 10:00 UTC", 2.0, summary.DEFAULT_STUDY,
            modes=("embedded", "serve"))  # fmt: skip
    _result(tmp_path, one, "2026-11-30 10:00 UTC", 3.5, summary.DEFAULT_STUDY)
    rows = {row.figure.rsplit(", ", 1)[1]: row.value for row in summary.study_rows()}
    assert rows["embedded"].startswith("2.00x") and rows["serve"].startswith("3.50x"), rows


def _multi(
    folder: Path, name: str, date: str, ratio: float, settings: dict[str, str],
    modes: tuple[str, ...] = ("rq:2",), patterns: tuple[str, ...] = ("at-once",),
    variants: tuple[str, ...] | None = None,
) -> None:  # fmt: skip
    figures = {
        "at-once": {"sequential_over_new": ratio, "today_over_new": 1.0},
        "behind": {"small_over_alone": ratio, "today_small_over_alone": 3.0},
    }
    data = {
        "machine": {"device": "cpu", "cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu"},
        "date": date, "command": "python -m bench.multi_study", "fleet": [{}] * 8,
        "settings": settings, "runs": {},
        "summary": {mode: {p: figures[p] for p in patterns} for mode in modes},
        **({"variants": list(variants)} if variants is not None else {}),
    }  # fmt: skip
    (folder / f"{name}.json").write_text(json.dumps(data))


def test_bench_g_s_row_leaves_out_a_run_with_a_setting_for_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench.multi_study --set preempt=false`` measures the new scheduler with a setting
    that is not the default: named after it, and not bench g's figure even when newer."""
    monkeypatch.setattr(summary, "RESULTS", tmp_path)
    _multi(tmp_path, "multi_study_cpu", "2026-11-28 10:00 UTC", 1.2, {})
    _multi(tmp_path, "multi_study_cpu_preempt-false", "2026-11-30 10:00 UTC", 1.6,
           {"preempt": "false"})  # fmt: skip
    [row] = summary.multi_rows()
    assert row.value.startswith("1.20x"), row
    run = {"variant": "new", "pattern": "at-once",
           "settings": {**multi_study.NEW, "preempt": "false"}}  # fmt: skip
    assert multi_study.label(run) == "new (preempt=false) at-once"
    assert multi_study.label({**run, "settings": dict(multi_study.NEW)}) == "new at-once"
    with pytest.raises(SystemExit):  # argparse's error: a one-line message, exit 2
        multi_study.main(["--set", "no_such_setting=1"])


def test_bench_g_s_run_of_one_mode_keeps_the_other_mode_s_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench.multi_study --modes rq:2`` saved its JSON under the name of a run of both
    modes, so serve's rows left RESULTS.md. It is named after its mode now, and each
    mode's row is the newest run that measured it."""
    monkeypatch.setattr(summary, "RESULTS", tmp_path)
    both = multi_study.result_name("cpu", ["serve", "rq:2"], {})
    one = multi_study.result_name("cpu", ["rq:2"], {})
    assert (both, one) == ("multi_study_cpu", "multi_study_cpu_rq-2")
    _multi(tmp_path, both, "2026-11-28 10:00 UTC", 1.2, {}, modes=("serve", "rq:2"))
    _multi(tmp_path, one, "2026-11-30 10:00 UTC", 1.4, {})
    rows = {row.figure.rsplit(", ", 1)[1]: row.value for row in summary.multi_rows()}
    assert rows["serve"].startswith("1.20x") and rows["rq:2"].startswith("1.40x"), rows


def test_bench_g_s_rows_come_from_runs_of_every_variant_per_pattern(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newer run of one pattern keeps the other pattern's row from the full run, and a
    run without today's scheduler (``--variants sequential new``) makes no row: its
    "today / new" would read nan (review)."""
    monkeypatch.setattr(summary, "RESULTS", tmp_path)
    full = ("at-once", "behind")
    _multi(tmp_path, "multi_study_cpu", "2026-11-28 10:00 UTC", 1.2, {}, ("serve",), full)
    behind = multi_study.result_name("cpu", ["serve"], {}, patterns=["behind"])
    assert behind == "multi_study_cpu_serve_behind"
    _multi(tmp_path, behind, "2026-11-29 10:00 UTC", 1.7, {}, ("serve",), ("behind",))
    two = multi_study.result_name("cpu", ["serve"], {}, variants=["sequential", "new"])
    assert two == "multi_study_cpu_serve_new_sequential"
    _multi(tmp_path, two, "2026-11-30 10:00 UTC", 1.9, {}, ("serve",), full,
           variants=("sequential", "new"))  # fmt: skip
    rows = [(row.figure.split(",")[0], row.value[:5]) for row in summary.multi_rows()]
    assert rows == [("g. 8 studies at once", "1.20x"), ("g. a small study behind a large one",
                                                        "1.70x")], rows  # fmt: skip


def test_bench_names_are_file_names_and_do_not_depend_on_the_modes_order() -> None:
    spec = study_walltime.DEFAULT_SPEC
    assert study_walltime.result_name(spec, "cpu", {}, ["serve", "embedded"]) == (
        study_walltime.result_name(spec, "cpu", {}, ["embedded", "serve"])
    )
    name = multi_study.result_name("cpu", ["rq:2"], {"checkpoint_dir": "/tmp/ck"})
    assert "/" not in name and ":" not in name, name


@pytest.mark.parametrize("setting", ["device=cuda", "checkpoint_dir=/tmp/x", "share_packs=false"])
def test_bench_g_refuses_a_setting_it_gives_its_services_itself(
    setting: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--set device=cuda`` raised TypeError at the first new run, after the sequential and
    today runs had been measured and were then lost (review): refused before anything runs."""
    with pytest.raises(SystemExit) as exc:
        multi_study.main(["--set", setting])
    assert exc.value.code == 2
    assert f"--set {setting.split('=')[0]}: the bench sets it itself" in capsys.readouterr().err
