"""A study's objective: which metric it ranks trials by, and in which direction.

Pure: no database, no I/O. The store keeps each trial's latest objective value
in a column (written with every measurement) so that the read side can rank
trials in SQL; both sides read a spec's objective through these two functions.
"""

from __future__ import annotations

import math
from typing import Any


def objective_of(spec: dict[str, Any]) -> tuple[str, str]:
    """``(metric, mode)`` of a stored spec; ``("val_loss", "min")`` when it names none."""
    objective = spec.get("objective") or {}
    return objective.get("metric", "val_loss"), objective.get("mode", "min")


def value_of(metrics: dict[str, Any] | None, metric: str) -> float | None:
    """``metrics[metric]`` as a float when it is a finite number, else None."""
    value = (metrics or {}).get(metric)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
