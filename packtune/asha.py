"""Asynchronous successive halving (ASHA; Li et al., MLSys 2020), deterministic.

ASHA promotes a configuration out of rung ``k`` as soon as it is in the top ``1/eta`` of
the results rung ``k`` has *so far*, instead of waiting for the whole rung as synchronous
successive halving (each Hyperband bracket) does. Which results a rung has "so far" depends
on timing in ASHA as published; here it is defined by the trials' sample indices, so that a
study's promotions never depend on packing, workers or restarts:

    rung 0's results are read in sample-index order; after the ``m``-th, the best
    ``floor(m / eta)`` of those ``m`` are promoted (if not already). Rung ``k + 1``'s
    results are read in the order its trials were promoted out of rung ``k``
    (:func:`promotion_order`: by that ``m``, then by rank), which no trial promoted later
    can come before. (Read in sample-index order too, a trial promoted late with a low
    index came before results already decided on, and a slower worker changed which
    trials reached the top rung.)

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
    """Every trial ASHA promotes out of a rung whose results, in the rung's order, are
    ``results`` (trial id, objective; ``None`` or non-finite: diverged or failed, never
    promoted): the union over ``m`` of the best ``floor(m / eta)`` of the first ``m``.
    Ties break by position (the earlier first)."""
    return set(promotion_order(results, eta, mode))


def promotion_order(
    results: Sequence[tuple[int, float | None]], eta: int, mode: Direction
) -> list[int]:
    """:func:`promotions` in the order they are made: by the ``m`` after which each trial
    is first among the best ``floor(m / eta)`` of the first ``m``, then best first. A
    longer ``results`` (more of the rung known) only appends to it: the order of the next
    rung's results.

    >>> promotion_order([(1, 5.0), (2, 1.0), (3, 9.0), (4, 0.5), (5, 7.0), (6, 8.0)], 3, "min")
    [2, 4]
    >>> promotion_order([(1, 5.0), (2, 9.0), (3, 8.0), (4, 1.0), (5, 0.5), (6, 7.0)], 3, "min")
    [1, 4, 5]
    """
    if eta < 2:
        raise ValueError(f"eta must be >= 2, got {eta}")
    sign = 1.0 if mode == "min" else -1.0
    ranked: list[tuple[float, int, int]] = []  # (signed value, position, trial id)
    order: list[int] = []
    chosen: set[int] = set()
    for position, (trial_id, value) in enumerate(results):
        finite = value is not None and math.isfinite(value)
        key = sign * value if finite else math.inf  # type: ignore[operator]
        bisect.insort(ranked, (key, position, trial_id))
        for key_, _, tid in ranked[: (position + 1) // eta]:  # best first
            if key_ != math.inf and tid not in chosen:
                chosen.add(tid)
                order.append(tid)
    return order
