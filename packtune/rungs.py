"""Where a study's trials stop: its brackets, each rung's resource, and the next unit's end.

Pure functions of a study spec (the validated JSON of :mod:`packtune.spec`),
cached per Hyperband setting: the scheduler asks once per pending trial.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from packtune.hyperband import Rung, next_stop, plan_brackets, rung_resources


def brackets_of(spec: Mapping[str, Any]) -> list[list[Rung]]:
    hb = spec["hyperband"]
    return _plan(float(hb["max_resource"]), int(hb.get("eta", 3)), float(hb.get("min_resource", 1)))


@functools.lru_cache(maxsize=256)
def _plan(max_resource: float, eta: int, min_resource: float) -> list[list[Rung]]:
    # planned once per spec, not once per trial: the scheduler asks for every pending trial
    return plan_brackets(max_resource, eta=eta, min_resource=min_resource)


def rung_resource(spec: Mapping[str, Any], bracket: int, rung: int) -> float:
    brackets = brackets_of(spec)
    s_max = len(brackets) - 1
    return float(brackets[s_max - bracket][rung].resource)


def unit_end(spec: Mapping[str, Any], done: float, target: float) -> float:
    """Where the next unit of a trial from ``done`` toward its rung's ``target`` ends.

    With ``packing.align_rungs`` (the default, when arrays can hold more than one
    trial) a unit stops at every rung resource of the study on its way, so that a
    bracket-0 trial going from 0 to R trains its first epochs together with bracket
    s_max's first rung, and so on: fewer, larger arrays. Otherwise the whole span.
    """
    packing = spec.get("packing") or {}
    if not packing.get("enabled", True) or packing.get("max_pack_size") == 1:
        return target
    if not packing.get("align_rungs", True):
        return target
    hb = spec["hyperband"]
    stops = _stops(
        float(hb["max_resource"]), int(hb.get("eta", 3)), float(hb.get("min_resource", 1))
    )
    return next_stop(stops, done, target)


@functools.lru_cache(maxsize=256)
def _stops(max_resource: float, eta: int, min_resource: float) -> tuple[float, ...]:
    return rung_resources(_plan(max_resource, eta, min_resource))
