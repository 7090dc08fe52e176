"""What every read-side module shares: the row type and the statuses that end a unit."""

from __future__ import annotations

from typing import Any

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
