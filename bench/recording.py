"""What every benchmark shares: the machine's description, medians, and HISTORY.md.

Each benchmark appends one section to ``bench/HISTORY.md`` (never rewriting
what is there) with the machine, the exact command, the date and the load
average, and writes its raw figures, with the commit, to
``bench/results/<name>.json``, from which ``python -m bench.summary`` writes
the current table ``bench/RESULTS.md`` and ``bench.plots`` the plots.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
HISTORY_MD = BENCH_DIR / "HISTORY.md"
RESULTS_DIR = BENCH_DIR / "results"


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "n/a"
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def cpu_seconds() -> tuple[float, float] | None:
    """The machine's CPU time so far, all cores: (total, busy) seconds from ``/proc/stat``
    (None where there is none): two readings give how busy the machine was between them."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [int(v) for v in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return sum(ticks) / hz, (sum(ticks) - idle) / hz


def busy_between(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> float | None:
    """The share of the machine's CPU time that was busy between two :func:`cpu_seconds`."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    # at most 1: the tick counts divided by HZ round, and a wholly busy span came out at
    # 1.0000000000002 (busy ticks never outnumber all ticks)
    return min(1.0, (after[1] - before[1]) / (after[0] - before[0]))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(device: str = "cpu") -> dict[str, Any]:
    """The machine a benchmark ran on, as plain values."""
    import torch

    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cpu",
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(torch.device(device))
    return info


def device_kind(info: dict[str, Any]) -> str:
    """The device of a :func:`machine` as result files name it: ``cpu``, or the GPU's name
    with dashes for spaces (``NVIDIA-H100-80GB-HBM3``)."""
    return "cpu" if info["device"] == "cpu" else str(info["device"]).replace(" ", "-")


def describe(info: dict[str, Any]) -> str:
    device = "" if info["device"] == "cpu" else f", GPU {info['device']}"
    return (
        f"{info['cpu']} ({info['cores']} cores){device}; Python {info['python']}, "
        f"torch {info['torch']}"
    )


def command_line() -> str:
    """The command that is running, as a user would type it (``python -m bench.x ...``)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([head, *map(shlex.quote, sys.argv[1:])])


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def append_section(
    title: str,
    info: dict[str, Any],
    body: Sequence[str],
    load: str,
    *,
    command: str | None = None,
    date: str | None = None,
    load_after: str | None = None,
) -> None:
    """Append ``## title`` with machine, command, date and load average, then ``body``.

    ``command``, ``date`` and ``load_after`` default to this process's (for figures
    measured elsewhere and recorded here, they come from that run's JSON).
    """
    after = load_average() if load_after is None else load_after
    lines = [
        "",
        f"## {title}",
        "",
        f"- machine: {describe(info)}",
        f"- command: `{command or command_line()}`",
        f"- date: {date or now()}; load average (1/5/15 min) before: {load}, after: {after}",
        "",
        *body,
    ]
    if not HISTORY_MD.exists():
        HISTORY_MD.write_text(
            "# Benchmark history\n\nEach section was appended by the "
            "command it names; see bench/README.md.\n"
        )
    with HISTORY_MD.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def git_commit() -> str | None:
    """The checkout's commit (with ``+`` when the tree has changes), None outside git."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=BENCH_DIR,
                              check=False)  # fmt: skip
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    return head + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def save_json(name: str, data: Any, out_dir: Path | None = None) -> Path:
    """Write ``data`` as ``<out_dir or bench/results>/<name>.json``; returns the path."""
    folder = out_dir or RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    if isinstance(data, dict) and "commit" not in data:
        data = {**data, "commit": git_commit()}
    path.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    return path


def output_options(parser: Any, quick: str) -> None:
    """The options every benchmark takes: ``--quick`` (``quick`` says what it runs; it
    writes nothing unless given ``--out-dir``), ``--out-dir`` and ``--no-append``."""
    parser.add_argument("--quick", action="store_true", help=f"{quick}; writes nothing")
    parser.add_argument("--out-dir", type=Path, default=None, help="JSON here")
    parser.add_argument("--no-append", action="store_true", help="leave HISTORY.md alone")


def publish(
    name: str, section: str, body: list[str], info: dict[str, Any], load: str,
    data: dict[str, Any], args: Any,
) -> None:  # fmt: skip
    """Print a benchmark's ``body``; then, unless it is a ``--quick`` run without
    ``--out-dir``, save ``data`` with the machine, date and command as ``<name>.json``, and
    unless ``--no-append``, append ``body`` to HISTORY.md as ``section``."""
    print("\n".join(body))
    if args.quick and args.out_dir is None:
        return
    save_json(name, {"machine": info, "date": now(), "command": command_line(), **data},
              args.out_dir)  # fmt: skip
    if not args.no_append:
        append_section(section, info, body, load)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table."""

    def cell(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return out
