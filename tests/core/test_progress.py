"""The terminal progress of ``packtune run`` and ``packtune submit --watch``."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from packtune.progress import watch


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


def test_watch_returns_the_finished_summary_without_waiting() -> None:
    waits: list[float] = []
    summary = watch(
        lambda: _summary("completed", 3), console=Console(file=io.StringIO()), sleep=waits.append
    )
    assert waits == [] and summary["status"] == "completed"
