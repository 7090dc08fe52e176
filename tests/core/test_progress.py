"""The terminal progress of ``packtune run`` and ``packtune submit --watch``."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from packtune.progress import leaderboard_table, watch


def _summary(status: str, done: int) -> dict[str, Any]:
    return {"name": "s", "status": status, "progress": {"total": 3, "done": done},
            "objective": {"metric": "val_loss"}}  # fmt: skip


def test_watch_waits_with_the_given_sleep_and_stops_when_until_says_so() -> None:
    # `packtune run` passes its scheduler thread's join: it returns as the study ends, so
    # the command does not sleep out the rest of an interval after the last pack
    waits: list[float] = []
    looks = iter([_summary("running", 0), _summary("running", 2), _summary("running", 3)])
    summary = watch(
        lambda: next(looks),
        console=Console(file=io.StringIO()),
        interval=7.0,
        until=lambda: len(waits) >= 2,
        sleep=waits.append,
    )
    assert waits == [7.0, 7.0]
    assert summary["progress"]["done"] == 3


def test_watch_reads_the_study_once_more_after_until_says_the_run_ended() -> None:
    """The scheduler thread's last tick committed just after a read, and the thread ended:
    ``packtune run`` printed that read ('study 1 running in 13.7 s: 22 of 22 units of
    work') and exited 1, while the database said completed."""
    state: dict[str, Any] = {"summary": _summary("running", 2), "alive": True}
    reads: list[dict[str, Any]] = []

    def fetch() -> dict[str, Any]:
        reads.append(state["summary"])
        if len(reads) == 2:  # the last commit lands right after this read; the thread ends
            state.update(summary=_summary("completed", 3), alive=False)
        return reads[-1]

    summary = watch(
        fetch,
        console=Console(file=io.StringIO()),
        until=lambda: not state["alive"],
        sleep=lambda _: None,
    )
    assert summary["status"] == "completed" and summary["progress"]["done"] == 3
    assert len(reads) == 3


def test_watch_returns_the_finished_summary_without_waiting() -> None:
    waits: list[float] = []
    summary = watch(
        lambda: _summary("completed", 3), console=Console(file=io.StringIO()), sleep=waits.append
    )
    assert waits == [] and summary["status"] == "completed"


def test_a_metric_named_with_brackets_is_printed_as_it_is() -> None:
    """A workload that does not declare its metrics may report any name: ``acc[/top1]``
    crashed ``packtune run``, ``show`` and ``submit --watch`` (rich read it as a closing
    tag), and ``acc[top1]`` printed as ``acc``."""
    for metric in ("acc[/top1]", "acc[top1]"):
        best = {"id": 4, "metrics": {metric: 0.5}}
        summary = {**_summary("completed", 3), "objective": {"metric": metric},
                   "best_trial": best}  # fmt: skip
        out = io.StringIO()
        console = Console(file=out, width=200)
        watch(lambda s=summary: s, console=console, sleep=lambda _: None)
        row = {"id": 4, "bracket": 0, "resource": 3, "metrics": {metric: 0.5}, "config": {}}
        console.print(leaderboard_table([row], metric))
        text = out.getvalue()
        assert f"best: trial 4 {metric}=0.5" in text, text
        assert metric in text.split("leaderboard")[1], text
