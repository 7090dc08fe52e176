"""Many studies on one fleet: who goes first when their ready work competes for devices.

Pure functions of plain values; the scheduler (``service.planning``) reads the inputs
from the database. Three rules, applied in this order:

1. **Weighted fair share.** Each running study has a ``priority`` and has used some
   device-seconds (its share of every pack that trained its trials). Its *level* is
   ``used / priority``; studies are served lowest level first, as in weighted fair
   queuing, so that device time goes to studies in proportion to their priority and a
   small study submitted behind a large one is not kept waiting for it. Levels within
   one ``quantum`` of each other (``floor(level / quantum)``, a *band*) count as equal.
2. **Longest remaining work first** (Hydra's Sharded-LRTF, applied to units of work):
   within a band, the unit whose trial has the most expected work left to the end of its
   study goes first, so that long chains (a bracket's survivors, the few trials that train
   to the maximum resource) start early and overlap with other work instead of running
   alone at the end.
3. **Preemption.** A pack that is already running keeps its device only while nothing
   better waits: when a pack of a study in a better band is planned and no device is free,
   the worst-served running pack gives its device up at its next training step
   (:func:`packs_to_yield`); its trials keep what they trained (a checkpoint at that step)
   and are planned again, so that a small study behind a large one waits for a step and a
   checkpoint of the large one's pack, not for the whole pack.

A trial's expected remaining work (:func:`expected_remaining`) is what is left of its
current rung plus each later rung's span weighted by the chance of reaching it under
its bracket's halving (``n_j / n_i``): 1 epoch for a first-rung trial of Hyperband's
most aggressive bracket with eta=3 and R=27 is worth ~1 + 2/3 + 6/9 + 18/27 = 3 epochs,
while a trial of the bracket that starts at R has all 27 ahead of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from packtune.hyperband import Rung

Order = Literal["fair", "id"]


@dataclass(frozen=True)
class StudyLoad:
    """A running study's claim on the fleet: its ``priority`` and the device-seconds its
    trials have trained so far (``used_seconds``)."""

    study_id: int
    priority: float
    used_seconds: float

    @property
    def level(self) -> float:
        return self.used_seconds / self.priority


def band(load: StudyLoad, quantum: float) -> int:
    """The fair-share band of ``load``: lower bands are served first."""
    if quantum <= 0:
        raise ValueError(f"quantum must be > 0, got {quantum}")
    return math.floor(load.level / quantum)


def study_order(loads: Iterable[StudyLoad], quantum: float, order: Order = "fair") -> list[int]:
    """Study ids in the order their ready work is planned: by band then id (``fair``), or
    by id (``id``)."""
    loads = list(loads)
    if order == "id":
        return sorted(load.study_id for load in loads)
    return [
        load.study_id
        for load in sorted(loads, key=lambda load: (band(load, quantum), load.study_id))
    ]


def expected_remaining(rungs: Sequence[Rung], rung: int, done: float) -> float:
    """Expected resource a trial at rung index ``rung`` of a bracket with ``rungs``, having
    trained ``done``, still trains to the end of its study (see the module docstring)."""
    if not 0 <= rung < len(rungs):
        raise ValueError(f"rung {rung} is not in a bracket of {len(rungs)} rungs")
    here = rungs[rung]
    left = max(0.0, float(here.resource) - done)
    for before, after in zip(rungs[rung:], rungs[rung + 1 :], strict=False):
        left += float(after.resource - before.resource) * after.n / here.n
    return left


def unit_key(
    order: Order, study_band: int, study_id: int, remaining: float, trial_id: int
) -> tuple[float, ...]:
    """Sort key of a ready unit: fair band, then longest expected remaining work, then
    trial id (``fair``); study id then trial id (``id``)."""
    if order == "id":
        return (study_id, trial_id)
    return (study_band, -remaining, trial_id)


def entitled_shares(loads: Iterable[StudyLoad]) -> dict[int, float]:
    """Each study's fair share of device time: its priority over the sum of priorities."""
    loads = list(loads)
    total = sum(load.priority for load in loads)
    return {load.study_id: load.priority / total for load in loads} if total > 0 else {}


def split_seconds(seconds: float, work: Mapping[int, float]) -> dict[int, float]:
    """A pack's ``seconds`` split between its studies in proportion to their ``work`` (the
    trial-resource each trained in it); all to nobody when no work is known."""
    total = sum(work.values())
    if total <= 0:
        return {}
    return {study: seconds * (w / total) for study, w in work.items()}


def covered_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` spans (overlaps counted once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def seconds_to_leave_band(load: StudyLoad, quantum: float, rate: float) -> float:
    """Seconds until ``load`` crosses into its next band while it gains ``rate``
    device-seconds per second (its shares of the packs it trains in now); ``inf`` if it
    trains in none. Equal bands never preempt each other, so this is the soonest moment a
    waiting study of its present band may take its device: the scheduler looks again
    then, instead of at its next regular tick (up to ``scheduler_interval`` later)."""
    if rate <= 0:
        return math.inf
    gap = (band(load, quantum) + 1) * quantum - load.level
    return max(0.0, gap * load.priority / rate)


def packs_to_yield(
    running: Mapping[int, int], waiting: Iterable[int], free_devices: int
) -> list[int]:
    """Which running packs give their device up at their next training step.

    ``running``: pack id -> its band (the best fair-share band of the studies it holds);
    ``waiting``: the bands of the packs planned and not yet started; ``free_devices``:
    devices with no pack running. A waiting pack first takes a free device; each one left
    over that is in a strictly better band than a running pack takes the device of the
    worst-served running pack (the highest band, then the newest pack). Equal bands never
    preempt each other, so two studies served alike do not take turns pack by pack.
    """
    left = sorted(waiting)[max(0, free_devices) :]
    victims = sorted(running.items(), key=lambda item: (-item[1], -item[0]))
    out: list[int] = []
    for want in left:
        if not victims or victims[0][1] <= want:
            break
        out.append(victims.pop(0)[0])
    return out
