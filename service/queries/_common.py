"""What every read-side module shares: the row type and a stored spec's Hyperband plan."""

from __future__ import annotations

import functools
from typing import Any

from packtune.hyperband import Rung, plan_brackets
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
    """Hyperband's brackets for a stored spec, highest ``s`` first (shared: read only)."""
    hb = spec["hyperband"]
    return _plan(hb["max_resource"], hb.get("eta", 3), hb.get("min_resource", 1))


@functools.lru_cache(maxsize=256)
def _plan(max_resource: float, eta: int, min_resource: float) -> list[list[Rung]]:
    # a page of 50 studies computed 50 plans, with Fractions (0.1-0.3 ms each) per request
    return plan_brackets(max_resource, eta, min_resource)
