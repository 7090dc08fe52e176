"""Live progress in the terminal, the same for ``packtune run`` and ``packtune submit --watch``.

Both feed :func:`watch` a function returning the study summary (the JSON of
``GET /api/studies/{id}``): one reads the database, the other the API.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from packtune.errors import error_cause

FINISHED = ("completed", "failed", "cancelled")
#: columns of output that is not a terminal (a file, a pipe, CI's log): rich would assume 80
#: and cut the progress line short
PIPE_WIDTH = 200


class _OutputConsole(Console):
    """A console whose reader may go (``| head``) without ending the command: rich exits 1
    there, before the command has decided how it ends (a failed study exits 1, a finished
    one 0); the rest of its output goes nowhere instead."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def output_console() -> Console:
    """A console for the CLI's output: the terminal's width, or :data:`PIPE_WIDTH` when the
    output is not a terminal (and ``COLUMNS`` does not say)."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return _OutputConsole()
    return _OutputConsole(width=PIPE_WIDTH)


def _best(summary: dict[str, Any], metric: str) -> str:
    best = summary.get("best_trial") or summary.get("best_so_far")
    if not best:
        return "best: -"
    value = (best.get("metrics") or {}).get(metric)
    shown = f"{value:.4g}" if isinstance(value, int | float) else "?"
    return f"best: trial {best['id']} {escape(metric)}={shown}"


def failed_text(failed: int, markup: bool = False) -> str:
    """`` (3 failed)``, said after a study's units done where ``failed`` of its trials
    failed (in red with ``markup``): their last units count as done (the bar reaches its
    total however its trials end), and "6/6 units" alone read as a study whose trials all
    trained; nothing where none did."""
    if not failed:
        return ""
    return f" [red]({failed} failed)[/]" if markup else f" ({failed} failed)"


def budget_text(summary: dict[str, Any]) -> str:
    """The budget and what is used of it, e.g. ``tpe · iteration 2/3 · 61 trials · 40/600 s``."""
    budget = summary.get("budget") or {}
    if not budget:
        return ""
    parts = [str(budget.get("sampler", ""))]
    top = budget.get("max_iterations")
    parts.append(f"iteration {budget.get('iterations', 0)}" + (f"/{top}" if top else ""))
    trials = f"{budget.get('trials', 0)}"
    if budget.get("max_trials"):
        trials += f"/{budget['max_trials']}"
    parts.append(f"{trials} trials")
    if budget.get("max_seconds"):
        parts.append(f"{budget.get('seconds') or 0:.0f}/{budget['max_seconds']:g} s")
    if budget.get("target") is not None:
        parts.append(f"target {budget['target']:g}")
    if budget.get("stop_reason"):
        parts.append(f"stopped: {budget['stop_reason']}")
    return " · ".join(parts)


def watch(
    fetch: Callable[[], dict[str, Any]],
    *,
    console: Console | None = None,
    interval: float = 0.5,
    until: Callable[[], bool] | None = None,
    sleep: Callable[[float], Any] = time.sleep,
) -> dict[str, Any]:
    """Show a progress bar (units done / total, trials failed, packs running, best so far)
    until the study is finished, or ``until()`` says so; returns the last summary.
    ``sleep(interval)`` waits between looks (it may return early: ``packtune run`` joins its
    scheduler thread, which ends with the study). ``until()`` is asked before each read, so
    that the summary returned was read after it said so: ``packtune run``'s thread ends with
    its last commit, and a summary read before it showed the study running (and the run
    exited 1)."""
    console = console or output_console()
    ended = until is not None and until()
    summary = fetch()
    metric = summary.get("objective", {}).get("metric", "val_loss")
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("units{task.fields[failed]}"),
        TextColumn("{task.fields[packs]} packs running"),
        TextColumn("{task.fields[best]}"),
        TextColumn("[dim]{task.fields[budget]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(
            escape(summary.get("name", "study")), total=None, failed="", packs=0,
            best="best: -", budget="",
        )  # fmt: skip
        while True:
            progress = summary.get("progress") or {}
            bar.update(
                task,
                total=progress.get("total"),
                completed=progress.get("done", 0),
                failed=failed_text(progress.get("failed") or 0, markup=True),
                packs=summary.get("packs_running", 0),
                best=_best(summary, metric),
                budget=budget_text(summary),
                description=escape(f"{summary.get('name', 'study')} [{summary.get('status')}]"),
            )
            if summary.get("status") in FINISHED or ended:
                break
            sleep(interval)
            ended = until is not None and until()
            summary = fetch()
    return summary


def leaderboard_table(rows: list[dict[str, Any]], metric: str, limit: int = 10) -> Table:
    table = Table(title="leaderboard")
    table.add_column("#", justify="right")
    table.add_column("trial", justify="right")
    table.add_column("bracket", justify="right")
    table.add_column("resource", justify="right")
    table.add_column(escape(metric), justify="right")  # a plugin's may hold brackets
    table.add_column("config")
    for i, row in enumerate(rows[:limit], 1):
        value = (row.get("metrics") or {}).get(metric)
        config = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in sorted((row.get("config") or {}).items())
        )
        table.add_row(
            str(i),
            str(row["id"]),
            str(row.get("bracket", "")),
            f"{row.get('resource', 0):g}",
            f"{value:.4f}" if isinstance(value, int | float) else "-",
            escape(config),
        )
    return table


def error_lines(trials: Sequence[Mapping[str, Any]]) -> list[str]:
    """What went wrong with a study's trials, one line per distinct error, most frequent
    first: ``3 trials failed: ValueError: ...``, ``2 trials diverged: loss became ...``."""
    seen: Counter[tuple[str, str]] = Counter()
    for trial in trials:
        if trial.get("status") in ("failed", "diverged"):
            seen[(str(trial["status"]), error_cause(str(trial.get("error") or "")))] += 1
    lines = []
    for (status, text), n in seen.most_common():
        lines.append(f"{n} trial{'s' if n > 1 else ''} {status}: {text}")
    return lines
