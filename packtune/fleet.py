"""Many studies on one fleet: who goes first when their ready work competes for devices.

Pure functions of plain values; the scheduler (``service.planning``) reads the inputs
from the database. Three rules, applied in this order:

1. **Weighted fair share, owners first.** Each running study has a ``priority`` and has
   used some device-seconds (its share of every pack that trained its trials). Its
   *level* is ``used / priority``; studies are served lowest level first, as in weighted
   fair queuing, so that device time goes to studies in proportion to their priority and
   a small study submitted behind a large one is not kept waiting for it. Studies with
   the same ``owner`` label share one claim first (hierarchical fair share, as a
   cluster's fair-share tree): the owner's level is the device-seconds of its running
   studies over its weight, the largest priority among them, so that a user who splits
   one search into ten studies is served as one user, not as ten; within an owner, its
   studies' own levels decide. A study without an owner is an owner of its own (its two
   levels are equal: plain weighted fair queuing). Levels within one ``quantum`` of each
   other (``floor(level / quantum)``) count as equal: a study's *band* is its owner's
   band, then its own.
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

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from packtune.hyperband import Rung

Order = Literal["fair", "id"]
#: a study's fair-share band: its owner's, then its own (lower is served first)
Band = tuple[int, int]
#: the band of an infinite level (served after every finite one)
LAST_BAND = 2**62


@dataclass(frozen=True)
class StudyLoad:
    """A running study's claim on the fleet: its ``priority`` and the device-seconds its
    trials have trained so far (``used_seconds``); with an ``owner``, that owner's
    device-seconds and weight over its running studies (:func:`with_owners` fills them)."""

    study_id: int
    priority: float
    used_seconds: float
    owner: str | None = None
    owner_seconds: float | None = None
    owner_weight: float | None = None

    @property
    def level(self) -> float:
        return self.used_seconds / self.priority

    @property
    def claim(self) -> tuple[float, float]:
        """The owner's (device-seconds, weight): the study's own (used, priority) where it
        has no owner, or none is filled in."""
        if self.owner_seconds is None or not self.owner_weight:
            return self.used_seconds, self.priority
        return self.owner_seconds, self.owner_weight

    @property
    def owner_level(self) -> float:
        seconds, weight = self.claim
        return seconds / weight


def with_owners(loads: Iterable[StudyLoad]) -> list[StudyLoad]:
    """``loads`` with each owner's claim filled in: the device-seconds of its studies among
    ``loads`` and its weight, the largest priority among them (a study without an owner
    keeps its own claim: owner level = level)."""
    loads = list(loads)
    seconds: dict[str, float] = {}
    weight: dict[str, float] = {}
    for load in loads:
        if load.owner is not None:
            seconds[load.owner] = seconds.get(load.owner, 0.0) + load.used_seconds
            weight[load.owner] = max(weight.get(load.owner, 0.0), load.priority)
    return [
        load if load.owner is None else dataclasses.replace(
            load, owner_seconds=seconds[load.owner], owner_weight=weight[load.owner])
        for load in loads
    ]  # fmt: skip


def band(load: StudyLoad, quantum: float) -> Band:
    """The fair-share band of ``load``: its owner's, then its own; lower bands are served
    first."""
    if quantum <= 0:
        raise ValueError(f"quantum must be > 0, got {quantum}")
    return _floor(load.owner_level / quantum), _floor(load.level / quantum)


def _floor(x: float) -> int:
    """``floor(x)``; an infinite level (a priority too small for a float, stored before
    priorities had a lower bound) is the last band, not an OverflowError that stopped
    planning for every study."""
    return math.floor(x) if math.isfinite(x) else LAST_BAND


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
    order: Order, study_band: Band, study_id: int, remaining: float, trial_id: int
) -> tuple[Any, ...]:
    """Sort key of a ready unit: fair band, then longest expected remaining work, then
    trial id (``fair``); study id then trial id (``id``)."""
    if order == "id":
        return (study_id, trial_id)
    return (study_band, -remaining, trial_id)


def entitled_shares(loads: Iterable[StudyLoad]) -> dict[int, float]:
    """Each study's fair share of device time: its owner's weight over the sum of the
    owners' weights (an owner's weight: the largest priority among its studies; a study
    without an owner is an owner of its own), times its priority over the sum of its
    owner's studies' priorities."""
    loads = with_owners(loads)

    def owner_of(load: StudyLoad) -> tuple[str, str | int]:
        return ("owner", load.owner) if load.owner is not None else ("study", load.study_id)

    weights = {owner_of(load): load.claim[1] for load in loads}
    inside: dict[tuple[str, str | int], float] = {}
    for load in loads:
        inside[owner_of(load)] = inside.get(owner_of(load), 0.0) + load.priority
    total = sum(weights.values())
    if total <= 0:
        return {}
    return {
        load.study_id: weights[owner_of(load)] / total * load.priority / inside[owner_of(load)]
        for load in loads
    }


def split_seconds(
    seconds: float, work: Mapping[int, float], departed: float = 0.0
) -> dict[int, float]:
    """A pack's ``seconds`` split between its studies in proportion to their ``work`` (the
    trial-resource each trained in it); all to nobody when no work is known. ``departed``:
    seconds of it already charged to studies since deleted, split off first (to nobody)."""
    total = sum(work.values())
    if total <= 0:
        return {}
    left = max(0.0, seconds - departed)
    return {study: left * (w / total) for study, w in work.items()}


def covered_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` spans (overlaps counted once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def seconds_to_leave_band(
    load: StudyLoad, quantum: float, rate: float, owner_rate: float | None = None
) -> float:
    """Seconds until ``load`` crosses into a worse band while it gains ``rate``
    device-seconds per second (its shares of the packs it trains in now) and its owner
    ``owner_rate`` (all of its owner's studies'; default ``rate``): the sooner of its own
    level and its owner's crossing a band boundary; ``inf`` if neither trains. Equal bands
    never preempt each other, so this is the soonest moment a waiting study of its
    present band may take its device: the scheduler looks again then, instead of at its
    next regular tick (up to ``scheduler_interval`` later)."""
    owner_band, own_band = band(load, quantum)
    owner_rate = rate if owner_rate is None else owner_rate
    times = [math.inf]
    if rate > 0:
        times.append(((own_band + 1) * quantum - load.level) * load.priority / rate)
    if owner_rate > 0:
        weight = load.claim[1]
        times.append(((owner_band + 1) * quantum - load.owner_level) * weight / owner_rate)
    return max(0.0, min(times))


def packs_to_yield(
    running: Mapping[int, Band], waiting: Iterable[Band], free_devices: int
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
    victims = sorted(running.items(), key=lambda item: (item[1], item[0]), reverse=True)
    out: list[int] = []
    for want in left:
        if not victims or victims[0][1] <= want:
            break
        out.append(victims.pop(0)[0])
    return out
