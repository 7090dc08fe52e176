"""k. Owners on one fleet: one user's study beside another user's three, on ``packtune serve``.

Alice submits three studies and Bob one, all at once, all the same size
(``examples/digits-mlp.yaml``, R=27 by default). Labelled with their owners, each user is
entitled to half of the device whatever the number of studies (``owner``: a fair-share
claim per owner first, then per study), so Bob's study should take about twice its time
alone; unlabelled, every study is entitled to a quarter (less than four times its time
alone all the same: the four share packs, and fuse where their seeds agree). Per repeat,
one fresh ``packtune serve`` (SQLite, one runner, the defaults) runs, after a warm-up
study: Bob's study alone, then the four labelled, then the four unlabelled (the order of
the last two alternating per repeat; a finished study has no claim, so one variant does
not weigh on the next).

Reported: each study's completion (from the first of the four's creation to its end),
Bob's over his time alone, and the makespan of the four.

    python -m bench.owners                 # 3 repeats; HISTORY.md, results/owners_cpu.json
    python -m bench.owners --quick         # tiny studies, one repeat; writes nothing
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from bench import recording
from bench._study import ROOT, load_spec
from bench.multi_study import NEW, read_run, serve_fleet, wait_all

SPEC = ROOT / "examples" / "digits-mlp.yaml"
STUDIES = (("alice-1", "alice"), ("alice-2", "alice"), ("alice-3", "alice"), ("bob", "bob"))
VARIANTS = ("owners", "unlabelled")


def _times(url: str, ids: dict[str, int]) -> dict[str, float]:
    """Each study's end, in seconds from the first of ``ids`` to be created."""
    rows = read_run(url, list(ids.values()), workers=1)["studies"]
    return {name: row["finished"] for name, row in zip(ids, rows, strict=True)}


def one_repeat(spec: dict[str, Any], order: tuple[str, ...], workdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with serve_fleet(workdir, NEW, "cpu") as fleet:
        quick = {**spec["hyperband"], "max_resource": 3}
        wait_all(fleet.url, [fleet.submit({**spec, "name": "warm-up", "hyperband": quick})], 600)
        alone = {"bob": fleet.submit({**spec, "name": "bob-alone", "owner": "bob"})}
        wait_all(fleet.url, list(alone.values()), 600)
        out["alone"] = _times(fleet.url, alone)["bob"]
        for variant in order:
            ids = {}
            for name, owner in STUDIES:
                labels = {"owner": owner} if variant == "owners" else {}
                ids[name] = fleet.submit({**spec, "name": f"{name}-{variant}", **labels})
            wait_all(fleet.url, list(ids.values()), 600)
            times = _times(fleet.url, ids)
            out[variant] = {"completion": times, "makespan": max(times.values())}
    return out


def measure(spec: dict[str, Any], repeats: int) -> dict[str, Any]:
    runs = []
    for r in range(repeats):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        with tempfile.TemporaryDirectory(prefix="bench-k-") as tmp:
            run = one_repeat(spec, order, Path(tmp))
        print(f"repeat {r + 1}: bob alone {run['alone']:.1f} s; "
              + "; ".join(f"{v}: bob {run[v]['completion']['bob']:.1f} s, makespan "
                          f"{run[v]['makespan']:.1f} s" for v in VARIANTS), flush=True)  # fmt: skip
        runs.append(run)
    alone = recording.median([run["alone"] for run in runs])
    summary: dict[str, Any] = {"alone": alone}
    for v in VARIANTS:
        bob = recording.median([run[v]["completion"]["bob"] for run in runs])
        alice = recording.median([max(run[v]["completion"][n] for n, o in STUDIES if o == "alice")
                                  for run in runs])  # fmt: skip
        makespan = recording.median([run[v]["makespan"] for run in runs])
        summary[v] = {"bob": bob, "bob_over_alone": bob / alone, "alice_last": alice,
                      "makespan": makespan}  # fmt: skip
    return {"runs": runs, "summary": summary}


def report(result: dict[str, Any]) -> list[str]:
    s = result["summary"]
    rows = [
        [v, f"{s[v]['bob']:.1f}", f"{s[v]['bob_over_alone']:.2f}x", f"{s[v]['alice_last']:.1f}",
         f"{s[v]['makespan']:.1f}"]
        for v in VARIANTS
    ]  # fmt: skip
    lines = recording.table(
        ["labels", "Bob's study (s)", "x alone", "Alice's last (s)", "makespan (s)"], rows
    )
    lines += [
        "",
        f"Bob's study alone: {s['alone']:.1f} s (medians over {len(result['runs'])} repeats). "
        f"With owners Bob's study took **{s['owners']['bob_over_alone']:.2f}x** its time alone "
        f"(entitled to half the device), unlabelled {s['unlabelled']['bob_over_alone']:.2f}x "
        "(a quarter; the four share packs). Labelled, the owners' studies are in different "
        "bands and share fewer packs: the makespan is the price of the fairness.",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    recording.output_options(parser, "tiny studies, one repeat")
    args = parser.parse_args(argv)
    spec = load_spec(SPEC)
    if args.quick:
        spec, args.repeats = {**spec, "hyperband": {**spec["hyperband"], "max_resource": 3}}, 1
    load = recording.load_average()
    info = recording.machine("cpu")
    result = measure(spec, args.repeats)
    body = [f"Studies: `{SPEC.relative_to(ROOT)}` (R={spec['hyperband']['max_resource']}), "
            "three of Alice's and one of Bob's submitted at once to `packtune serve` (SQLite, "
            "one runner).", "", *report(result)]  # fmt: skip
    recording.publish("owners_cpu", "k. owners on one fleet", body, info, load,
                      {"result": result}, args)  # fmt: skip


if __name__ == "__main__":
    main()
