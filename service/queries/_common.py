"""What every read-side module shares: the row type and a stored spec's Hyperband plan."""

from __future__ import annotations

from typing import Any

from service.hyperband import Rung, plan_brackets
from service.models import (
    TrialStatus,
)

Row = dict[str, Any]

UNIT_FINISHED = (
    TrialStatus.paused,
    TrialStatus.stopped,
    TrialStatus.completed,
    TrialStatus.diverged,
    TrialStatus.failed,
)


def plan_of(spec: dict[str, Any]) -> list[list[Rung]]:
    """Hyperband's brackets for a stored spec, highest ``s`` first."""
    hb = spec["hyperband"]
    return plan_brackets(hb["max_resource"], hb.get("eta", 3), hb.get("min_resource", 1))
