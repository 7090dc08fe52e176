"""Where a study's trials stop: its brackets, each rung's resource, and the next unit's end.

Pure functions of a :class:`~packtune.spec.StoredSpec`, cached per Hyperband
setting: the scheduler asks once per pending trial.
"""

from __future__ import annotations

import functools

from packtune.hyperband import Rung, next_stop, plan_brackets, rung_resources
from packtune.spec import StoredSpec


@functools.lru_cache(maxsize=256)
def plan(max_resource: float, eta: int, min_resource: float) -> list[list[Rung]]:
    """:func:`packtune.hyperband.plan_brackets`, once per setting (a page of 50 studies
    asked for 50 plans per request, with Fractions: 0.1-0.3 ms each)."""
    return plan_brackets(max_resource, eta=eta, min_resource=min_resource)


def rung_resource(spec: StoredSpec, bracket: int, rung: int) -> float:
    """The cumulative resource at which rung ``rung`` of bracket ``bracket`` is decided."""
    brackets = spec.brackets
    s_max = len(brackets) - 1
    return float(brackets[s_max - bracket][rung].resource)


def unit_end(spec: StoredSpec, done: float, target: float) -> float:
    """Where the next unit of a trial from ``done`` toward its rung's ``target`` ends.

    With ``packing.align_rungs`` (the default, when arrays can hold more than one
    trial) a unit stops at every rung resource of the study on its way, so that a
    bracket-0 trial going from 0 to R trains its first epochs together with bracket
    s_max's first rung, and so on: fewer, larger arrays. Otherwise the whole span.
    """
    packing = spec.packing
    if not packing.enabled or packing.max_pack_size == 1 or not packing.align_rungs:
        return target
    hb = spec.hyperband
    return next_stop(
        _stops(float(hb.max_resource), int(hb.eta), float(hb.min_resource)), done, target
    )


@functools.lru_cache(maxsize=256)
def _stops(max_resource: float, eta: int, min_resource: float) -> tuple[float, ...]:
    return rung_resources(plan(max_resource, eta, min_resource))
