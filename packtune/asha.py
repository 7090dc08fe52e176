"""Asynchronous successive halving (ASHA; Li et al., MLSys 2020), deterministic.

ASHA promotes a configuration out of rung ``k`` as soon as it is in the top ``1/eta`` of
the results rung ``k`` has *so far*, instead of waiting for the whole rung as synchronous
successive halving (each Hyperband bracket) does. Which results a rung has "so far" depends
on timing in ASHA as published; here it is defined by the trials' sample indices, so that a
study's promotions never depend on packing, workers or restarts:

    rung ``k``'s results are read in sample-index order; after the ``m``-th, the best
    ``floor(m / eta)`` of those ``m`` are promoted (if not already).

A result is known once its trial has been measured at the rung (or has diverged or failed
there: it ranks last, as in :func:`packtune.hyperband.rank`). Promotions are decided over
the longest *prefix* of known results, so a slow trial holds back the decisions after it,
never those before it. As in ASHA, a trial promoted early may not have been promoted by
synchronous halving over the whole rung (a "mistaken" promotion, bounded by ``eta``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from packtune.hyperband import Direction


def known_prefix(
    results: Sequence[tuple[int, float | None, bool]],
) -> list[tuple[int, float | None]]:
    """The results before the first unknown one: ``results`` are (trial id, value, known)
    in sample-index order."""
    out = []
    for trial_id, value, known in results:
        if not known:
            break
        out.append((trial_id, value))
    return out


def promotions(results: Sequence[tuple[int, float | None]], eta: int, mode: Direction) -> set[int]:
    """Every trial ASHA promotes out of a rung whose results, in sample-index order, are
    ``results`` (trial id, objective; ``None`` or non-finite: diverged or failed, never
    promoted): the union over ``m`` of the best ``floor(m / eta)`` of the first ``m``.
    Ties break by position (the earlier sample first)."""
    if eta < 2:
        raise ValueError(f"eta must be >= 2, got {eta}")
    sign = 1.0 if mode == "min" else -1.0
    ranked: list[tuple[float, int, int]] = []  # (signed value, position, trial id)
    chosen: set[int] = set()
    for position, (trial_id, value) in enumerate(results):
        finite = value is not None and math.isfinite(value)
        key = sign * value if finite else math.inf  # type: ignore[operator]
        bisect.insort(ranked, (key, position, trial_id))
        for key_, _, tid in ranked[: (position + 1) // eta]:
            if key_ != math.inf:
                chosen.add(tid)
    return chosen
