"""A trial's objective value: the study's metric out of a measurement, when it is a number.

Pure: no database, no I/O. The store keeps each trial's latest objective value
in a column (written with every measurement) so that the read side can rank
trials in SQL. Which metric and direction: ``StoredSpec.of(spec).objective``.
"""

from __future__ import annotations

import math
from typing import Any


def value_of(metrics: dict[str, Any] | None, metric: str) -> float | None:
    """``metrics[metric]`` as a float when it is a finite number, else None."""
    value = (metrics or {}).get(metric)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
