"""Append figures measured on another machine (a GPU box) to ``bench/HISTORY.md``.

The GPU runs (``bench/gpu_run.sh``) write their JSON with ``--no-append``; this
renders each file's tables exactly as the benchmark itself would have, under a
section naming the device, the command that produced it (``--via`` adds the
wrapper that ran it) and the date of the run.

    python -m bench.record bench/results/gpu --via "A_TARGET=0.1 bash bench/gpu_run.sh"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench import fused_throughput, multi_study, quality, recording, spill, study_walltime


def _command(data: dict[str, Any], via: str | None) -> str:
    inner = str(data["command"]).replace("python -m", "python3 -m")
    return f"{via}` → `{inner}" if via else inner


def record_throughput(data: dict[str, Any], via: str | None, notes: list[str]) -> None:
    results = data["results"]
    variants = [
        v
        for v in fused_throughput.VARIANTS
        if any(res["ks"][k].get(v) for res in results.values() for k in res["ks"])
    ]
    first = next(iter(results.values()))
    body = [f"torch threads per process: {data['threads']}; variants interleaved.", "",
            *fused_throughput.report(results, variants), *notes]  # fmt: skip
    recording.append_section(f"a. Fused throughput — {data['machine']['device']}", data["machine"],
                           body, first["load_before"], command=_command(data, via),
                           date=data["date"], load_after="n/a")  # fmt: skip


def record_study(data: dict[str, Any], via: str | None, notes: list[str]) -> None:
    body, _ = study_walltime.summarise(data["runs"])
    spec = data["spec"]
    head = (
        f"Study `{spec['name']}` ({spec['workload']}, max_resource "
        f"{spec['hyperband']['max_resource']}, eta {spec['hyperband']['eta']})."
    )
    first = next(iter(data["runs"].values()))[0]
    recording.append_section(
        f"b. Study wall time, packed vs unpacked — {data['machine']['device']}", data["machine"],
        [head, "", *body, *notes], first.get("load", "n/a"), command=_command(data, via),
        date=data["date"], load_after="n/a")  # fmt: skip


def record_quality(data: dict[str, Any], via: str | None, notes: list[str]) -> None:
    # in the run's order (the JSON's keys are sorted); summarised again from its curves
    runs = {name: data["runs"][name] for name in quality.SYSTEMS if name in data["runs"]}
    body = [*quality.report(quality.summarise(runs), runs), "", f"seeds {data['seeds']}", *notes]
    first = next(iter(runs.values()))[0]
    recording.append_section(quality.section(data["machine"]), data["machine"], body,
                             first.get("load", "n/a"), command=_command(data, via),
                             date=data["date"], load_after="n/a")  # fmt: skip


def record_multi_study(data: dict[str, Any], via: str | None, notes: list[str]) -> None:
    members = tuple(multi_study.Member(**m) for m in data["fleet"])
    body, _ = multi_study.summarise(data["runs"], members)
    lines = multi_study.history_lines(members, data["stagger"], data["settings_known"], body)
    first = next(iter(data["runs"].values()))[0]
    recording.append_section(multi_study.section(data["machine"]),
                             data["machine"], [*lines, *notes], first.get("load", "n/a"),
                             command=_command(data, via), date=data["date"],
                             load_after="n/a")  # fmt: skip


def record_spill(data: dict[str, Any], via: str | None, notes: list[str]) -> None:
    recording.append_section(spill.SECTION, data["machine"],
                             [*spill.report(data["result"]), *notes],
                             "n/a", command=_command(data, via), date=data["date"],
                             load_after="n/a")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--via", default=None, help="the wrapper command that ran them")
    parser.add_argument("--note", action="append", default=[], help="a line to add under each")
    args = parser.parse_args(argv)
    notes = ["", *args.note] if args.note else []
    for path in sorted(args.folder.glob("fused_throughput_*.json")):
        record_throughput(json.loads(path.read_text()), args.via, notes)
    for path in sorted(args.folder.glob("study_walltime_*.json")):
        record_study(json.loads(path.read_text()), args.via, notes)
    for path in sorted(args.folder.glob("quality_*.json")):
        record_quality(json.loads(path.read_text()), args.via, notes)
    for path in sorted(args.folder.glob("multi_study_*.json")):
        record_multi_study(json.loads(path.read_text()), args.via, notes)
    for path in sorted(args.folder.glob("spill_*.json")):
        record_spill(json.loads(path.read_text()), args.via, notes)


if __name__ == "__main__":
    main()
