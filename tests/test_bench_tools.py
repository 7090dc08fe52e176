"""The scripts a borrowed GPU box runs: its preflight check and ``bench/gpu_run.sh``.

A GPU's minutes are few and lent by chance: a script that names a benchmark option that no
longer exists, or a box that lacks a package packtune gained since the last run (optuna,
fastapi-offline), would spend them on an error.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from bench import preflight

ROOT = Path(__file__).resolve().parents[1]
GPU_RUN = ROOT / "bench" / "gpu_run.sh"


def lookup_of(dists: dict[str, tuple[str, list[str]]]) -> preflight.Lookup:
    return lambda name: dists.get(name)


def test_preflight_names_what_is_missing_or_too_old_and_who_needs_it() -> None:
    dists = {
        "optuna": ("4.1.0", ["colorlog", "tqdm", 'sphinx; extra == "document"']),
        "tqdm": ("4.66.0", []),
        "fastapi": ("0.100.0", ["starlette>=0.27"]),
        "starlette": ("0.27.0", []),
        "psycopg": ("3.2.0", ['psycopg-binary==3.2.0; extra == "binary"',
                              "tzdata; os_name == 'nt'"]),
    }  # fmt: skip
    found = preflight.problems(
        ["optuna>=4.0", "fastapi>=0.121", "fastapi-offline>=1.7", "psycopg[binary]>=3.1"],
        lookup_of(dists),
    )
    assert found == [
        "fastapi>=0.121: 0.100.0 is installed",
        "fastapi-offline>=1.7: not installed",
        "colorlog: not installed (needed by optuna)",
        # the extra asked for is followed; another extra's needs and other platforms' are not
        "psycopg-binary==3.2.0: not installed (needed by psycopg)",
    ]


def test_preflight_is_quiet_where_everything_is_installed() -> None:
    dists = {"a": ("1.0", ["b>=2"]), "b": ("2.1", ["a"])}  # a cycle is followed once
    assert preflight.problems(["a"], lookup_of(dists)) == []
    # this checkout's own environment has every runtime requirement
    assert preflight.main([]) == 0


def test_preflight_reads_the_projects_requirements() -> None:
    core = preflight.project_requirements()
    assert any(r.startswith("optuna") for r in core)
    assert any(r.startswith("fastapi-offline") for r in core)
    dev = preflight.project_requirements(["dev"])
    assert set(core) < set(dev)
    with pytest.raises(ValueError, match="no such extra"):
        preflight.project_requirements(["nope"])
    assert preflight.main(["--extra", "nope"]) == 2


def _bench_calls(script: str) -> list[list[str]]:
    """The argument lists of every ``python3 -m bench.X ...`` in ``script`` (lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", script)
    calls = []
    for match in re.finditer(r"python3 -m (bench\.[a-z_]+)([^|\n]*)", joined):
        calls.append([match.group(1), *shlex.split(match.group(2).replace("$", ""))])
    return calls


def test_gpu_run_names_only_benchmarks_and_options_that_exist() -> None:
    calls = _bench_calls(GPU_RUN.read_text())
    modules = {call[0] for call in calls}
    assert {"bench.preflight", "bench.fused_throughput", "bench.study_walltime",
            "bench.quality", "bench.multi_study", "bench.spill"} <= modules  # fmt: skip
    for module, *args in calls:
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        source += (ROOT / "bench" / "recording.py").read_text()  # the shared output options
        for flag in (a for a in args if a.startswith("--")):
            assert f'"{flag}"' in source, f"{module} has no option {flag}"


def test_gpu_run_steps_are_all_known_and_all_run_by_default() -> None:
    script = GPU_RUN.read_text()
    default = re.search(r"STEPS=\$\{STEPS:?-([^}]*)\}", script)
    assert default is not None
    used = set(re.findall(r"want ([a-z0-9]+) &&", script))
    assert used == set(default.group(1).split())
    assert "python3 -m bench.preflight" in script.split("want ")[0]  # before any step
