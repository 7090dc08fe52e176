"""Turn the running studies' ready trials into packs: the adapter between the store and
``packing`` (which trials go together) and ``fleet`` (whose work goes first).

Reads pending trials, live workers, profiles and each study's device-seconds; calls
the pure planners; writes the packs (status ``pending``) and marks their trials
``queued``, all in the caller's transaction.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import TYPE_CHECKING, Any

from packtune.fleet import (
    Band,
    Order,
    StudyLoad,
    band,
    expected_remaining,
    packs_to_yield,
    seconds_to_leave_band,
    study_order,
    unit_key,
    with_owners,
)
from packtune.packing import (
    Device,
    MemoryModel,
    Unit,
    array_numbers,
    best_array_size,
    plan_packs,
    planned_array_size,
    segment_key,
)
from packtune.rungs import rung_resource, unit_end
from packtune.settings import Settings
from packtune.spec import StoredSpec
from packtune.tuning import (
    DEFAULT_BASE_BYTES,
    DEFAULT_PER_TRIAL_BYTES,
    MAX_UNITS_PER_PLAN,
    MIN_QUANTUM_S,
    PROBE_UNITS,
    QUEUE_DEPTH,
)
from service import store
from service.models import Pack, PackStatus, Profile, Study, StudyStatus, TrialStatus, Worker

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

DEFAULT_MEMORY = MemoryModel(base=DEFAULT_BASE_BYTES, per_trial=DEFAULT_PER_TRIAL_BYTES)
UNFINISHED = (PackStatus.pending, PackStatus.queued, PackStatus.running)


@dataclass
class FleetPlan:
    """What :func:`plan_fleet` did: the packs it made, and whether it made some yet left
    ready units while a device still has a slot open (it makes one pack per device):
    planning again at once places more. Otherwise planning again finds the same until a
    pack ends, a worker comes or goes, or a study changes."""

    made: int = 0
    more: bool = False


def devices_of(workers: list[Worker], settings: Settings) -> dict[str, tuple[Device, str]]:
    """Every device of the live workers: name -> (Device, device kind)."""
    out: dict[str, tuple[Device, str]] = {}
    for w in workers:
        if w.gpus:
            for g in w.gpus:
                free = int(g.get("memory_available", g.get("memory_free", 0)))
                name = f"{w.name}/cuda:{g.get('index', 0)}"
                out[name] = (Device(name, free), w.device_kind)
        else:
            budget = w.memory_budget or settings.cpu_memory_budget
            out[f"{w.name}/cpu"] = (Device(f"{w.name}/cpu", budget), w.device_kind)
    return out


def _probe_first(
    units: list[Unit], profiles: dict[str, Profile], in_flight: set[str]
) -> list[Unit]:
    """Of a fusion key never run on this device kind, plan only its :data:`PROBE_UNITS`
    shortest units, and none while a pack of that key is still out: that pack's job probes
    the key's memory and throughput, and the rest waits to be planned with the measured
    array sizes (an unmeasured key's units would otherwise take a whole rung,
    long units included)."""
    measured = {key for key, p in profiles.items() if p.throughput}
    # segment units do not wait for their key's probe: each unit's job probes its key
    # before it trains (worker.execute.ensure_profile), and a trial's other segments
    # would otherwise wait on every segment's probe in turn
    out = [u for u in units if u.segment >= 0 or u.fusion_key in measured]
    probing = [u for u in units if u.segment < 0 and u.fusion_key not in measured]
    kept = Counter[str]()
    # in the order of the units given (the caller sorts what comes back), so only the
    # unmeasured keys' units are sorted: thousands of measured ones are not
    for u in sorted(probing, key=lambda u: (u.to_resource - u.from_resource, u.trial_id)):
        if u.fusion_key not in in_flight and kept[u.fusion_key] < PROBE_UNITS:
            kept[u.fusion_key] += 1
            out.append(u)
    return out


@dataclass(frozen=True)
class _Planned:
    study: Study
    spec: StoredSpec
    band: Band


def study_loads(
    s: Session,
    studies: Sequence[Study],
    settings: Settings,
    now: datetime,
    used_memo: dict[int, float] | None = None,
) -> dict[int, StudyLoad]:
    """Each study's claim on the fleet: its priority, the device-seconds it has used, and
    its owner's (over every running study of that owner, ``studies`` or not).
    ``used_memo``: device-seconds already read this tick (study id -> seconds), read from
    and added to (a tick's planning and its dispatch order need the same studies' time)."""
    specs = {study.id: StoredSpec.of(study.spec) for study in studies}
    owners = {spec.owner for spec in specs.values() if spec.owner is not None}
    peers = {}  # the owners' other running studies: their device time is the owners' too
    if owners:
        for other in store.studies_with_status(s, (StudyStatus.running,)):
            if other.id not in specs and (spec := StoredSpec.of(other.spec)).owner in owners:
                peers[other.id] = spec
    every = {**specs, **peers}
    ids = list(every)
    if len(ids) <= 1:  # a lone study's load orders nothing
        used = dict.fromkeys(ids, 0.0)
    else:
        memo = {} if used_memo is None else used_memo
        memo.update(store.device_seconds(s, [i for i in ids if i not in memo], now))
        used = {i: memo[i] for i in ids}
    loads = with_owners(
        StudyLoad(i, spec.priority, used[i], owner=spec.owner) for i, spec in every.items()
    )
    return {load.study_id: load for load in loads if load.study_id in specs}


def fair_share_quantum(s: Session, settings: Settings) -> float:
    """``settings.fair_share_quantum``, or the median time of the last packs (at least 1 s):
    studies within about one pack's device time of each other count as equally served."""
    if settings.fair_share_quantum is not None:
        return settings.fair_share_quantum
    return max(MIN_QUANTUM_S, store.typical_pack_seconds(s) or MIN_QUANTUM_S)


def _cap(spec: StoredSpec) -> int | None:
    return spec.packing.max_pack_size if spec.packing.enabled else 1


def plan_fleet(
    s: Session,
    studies: Sequence[Study],
    workers: list[Worker],
    settings: Settings,
    now: datetime,
    asked: list[int] | None = None,
    wake: list[float] | None = None,
    used_memo: dict[int, float] | None = None,
) -> FleetPlan:
    """Plan and record packs for the pending trials of ``studies`` (returns what was
    made; see :class:`FleetPlan`), and append to ``asked`` the running packs asked to
    give their device up, and to ``wake`` the seconds after which a waiting pack may
    preempt one: look again then. ``used_memo``: see :func:`study_loads`.

    With ``settings.share_packs`` studies with the same pack size limit are planned
    together: their units share packs, and fuse into one array where their lanes agree
    (same data seed and training, besides the fusion key). Units are ranked by
    :func:`packtune.fleet.unit_key` (fair share, then longest remaining work), so that
    what a device cannot take this time is the work of the best-served studies.
    """
    if not studies:
        return FleetPlan()
    order: Order = settings.dispatch_order
    loads = study_loads(s, studies, settings, now, used_memo) if order == "fair" else {}
    quantum = fair_share_quantum(s, settings)
    planned = [
        _Planned(
            study,
            StoredSpec.of(study.spec),
            band(loads[study.id], quantum) if study.id in loads else (0, 0),
        )
        for study in studies
    ]
    ranked = study_order(
        [loads.get(p.study.id, StudyLoad(p.study.id, 1.0, 0.0)) for p in planned], quantum, order
    )
    position = {study_id: i for i, study_id in enumerate(ranked)}
    planned.sort(key=lambda p: position[p.study.id])
    if order == "fair":
        _withdraw_for(s, planned, loads, quantum, workers, settings)
    # studies share packs within one pack size limit and one fair-share band: a study
    # further ahead than a quantum waits for the others' packs instead of filling them
    groups: dict[object, list[_Planned]] = {}
    for p in planned:
        key = ("cap", _cap(p.spec), p.band) if settings.share_packs else ("study", p.study.id)
        groups.setdefault(key, []).append(p)
    out = FleetPlan()
    for group in groups.values():
        made, more = _plan_group(s, group, workers, settings, order, loads, quantum, now)
        out.made += made
        out.more = out.more or more
    if order == "fair" and settings.preempt:
        yielding = _yield_for(s, loads, quantum, workers, settings, now, wake)
        if asked is not None:
            asked.extend(yielding)
    return out


def _yield_for(
    s: Session,
    loads: dict[int, StudyLoad],
    quantum: float,
    workers: list[Worker],
    settings: Settings,
    now: datetime,
    wake: list[float] | None = None,
) -> list[int]:
    """Ask running packs to give their device up (:func:`packtune.fleet.packs_to_yield`)
    where a pack of a study in a better fair-share band waits and no device is free: the
    running pack stops at its next training step, its trials checkpointed there and ready
    again, and the waiting pack takes the device. Without it a small study behind a large
    one waits, at every rung, for the whole of the large one's running pack. Returns the
    packs asked."""
    running = store.packs_with_status(s, PackStatus.running)
    waiting = [
        p for p in store.packs_with_status(s, (PackStatus.pending, PackStatus.queued))
        if p.retry_after is None or p.retry_after <= now
    ]  # fmt: skip
    if not running or not waiting:
        return []
    studies = store.studies_of_packs(s, [p.id for p in (*running, *waiting)])

    def best_band(pack: Pack) -> Band | None:
        return _best_band(studies[pack.id], loads, quantum)

    asked = sum(p.yield_requested_at is not None for p in running)
    busy = {p.device for p in running}
    free = sum(name not in busy for name in devices_of(workers, settings)) + asked
    candidates = {
        p.id: b for p in running
        if p.yield_requested_at is None and not _has_segments(p)
        and (b := best_band(p)) is not None
    }  # fmt: skip
    wanted = [b for p in waiting if (b := best_band(p)) is not None]
    asked_now = store.request_yield(s, packs_to_yield(candidates, wanted, free))
    if not asked_now and wake is not None and len(wanted) > free:
        wake += _when_preemptible(s, candidates, min(wanted), studies, loads, quantum)
    if asked_now:
        # A device freed by a yield takes the next job of its queue, first in first out
        # (RQ's queue, the embedded runner's): a pack of a worse band queued before the
        # waiting one would take it, and the waiting pack would ask for another yield.
        served = min(wanted)
        for pack in waiting:
            b = best_band(pack)
            if pack.status == PackStatus.queued and b is not None and b > served:
                _withdraw(s, pack)
        log.info(
            "packs %s asked to give their device up at their next step: a study with a "
            "better fair share waits", asked_now,
        )  # fmt: skip
    return asked_now


def _when_preemptible(
    s: Session,
    candidates: dict[int, Band],
    wanted: Band,
    studies: dict[int, set[int]],
    loads: dict[int, StudyLoad],
    quantum: float,
) -> list[float]:
    """Seconds until the soonest running pack of band ``wanted`` (equal bands never preempt
    each other) leaves it, as its studies' device time grows; [] if none is in it. A small
    study behind a large one whose first packs began before it came waited here for the
    scheduler's next regular tick (0.5 s) after the large study had crossed its band."""
    equal = [pack_id for pack_id, b in candidates.items() if b == wanted]
    if not equal:
        return []
    shares = store.study_shares(s, equal)
    rate: dict[int, float] = {}
    for by_study in shares.values():
        for study_id, share in by_study.items():
            rate[study_id] = rate.get(study_id, 0.0) + share
    # an owner's claim grows with all its studies' packs; those of this band's packs are
    # known here (a pack of another band left out only makes the wake later: at worst the
    # next regular tick, as without the wake)
    owner_rate: dict[str, float] = {}
    for study_id, r in rate.items():
        if study_id in loads and (owner := loads[study_id].owner) is not None:
            owner_rate[owner] = owner_rate.get(owner, 0.0) + r

    def leaves(load: StudyLoad) -> float:
        mine = rate.get(load.study_id, 0.0)
        theirs = owner_rate.get(load.owner, mine) if load.owner is not None else mine
        return seconds_to_leave_band(load, quantum, mine, theirs)

    soonest = math.inf
    for pack_id in equal:
        mine = [i for i in studies[pack_id] if i in loads and band(loads[i], quantum) == wanted]
        soonest = min(soonest, max(leaves(loads[i]) for i in mine))
    return [soonest] if math.isfinite(soonest) else []


def _withdraw_for(
    s: Session,
    planned: list[_Planned],
    loads: dict[int, StudyLoad],
    quantum: float,
    workers: list[Worker],
    settings: Settings,
) -> None:
    """Give a full device's waiting pack back when a study with ready trials is in a better
    fair-share band than every study in it: the pack is cancelled before it starts (its job,
    when it comes, finds nothing to claim) and its trials are ready again, so that the slot
    goes to the better claim. Without it a small study behind a large one waits for two of
    the large one's packs at every rung, not one. At most one pack per device per tick."""
    pending = store.studies_with_trials(s, [p.study.id for p in planned], TrialStatus.pending)
    ready = [p.band for p in planned if p.study.id in pending]
    if not ready:
        return
    best = min(ready)
    if max(p.band for p in planned) <= best:
        return  # no study in a worse band: no waiting pack is any study's to give back
    busy = store.packs_per_device(s, UNFINISHED)
    full = {name for name in devices_of(workers, settings) if busy[name] >= QUEUE_DEPTH}
    waiting = [p for p in store.packs_with_status(s, PackStatus.queued)
               if p.device in full and not _has_segments(p)]  # fmt: skip
    if not waiting:
        return
    studies = store.studies_of_packs(s, [p.id for p in waiting])
    for device in sorted(full):
        mine = [p for p in waiting if p.device == device]
        if not mine:
            continue
        pack = max(mine, key=lambda p: p.id)  # the newest: the one that waits longest
        theirs = _best_band(studies[pack.id], loads, quantum)
        if theirs is not None and theirs > best:
            _withdraw(s, pack)


def _best_band(study_ids: set[int], loads: dict[int, StudyLoad], quantum: float) -> Band | None:
    """The best fair-share band of a pack's studies (None: none of them is planned now)."""
    bands = [band(loads[i], quantum) for i in study_ids if i in loads]
    return min(bands) if bands else None


def _has_segments(pack: Pack) -> bool:
    """Whether ``pack`` trains segment units: such a pack is neither asked to give its
    device up nor withdrawn (its trials' other segments are in other packs, and a trial's
    status moves once all of them have ended the span)."""
    return any(m.segment >= 0 for m in pack.members)


def _withdraw(s: Session, pack: Pack) -> None:
    """Cancel a queued pack before it starts (its job, when it comes, finds nothing to
    claim); its trials are ready again."""
    members = [m.trial_id for m in store.unfinished_members(s, pack, (TrialStatus.queued,))]
    reason = "withdrawn before it started: the slot went to a study with a better fair share"
    if pack.error:  # put back after a failed attempt: what failed is still worth reading
        reason += f" (its last attempt: {pack.error})"
    if store.move_pack(s, pack, PackStatus.cancelled, only_from=(PackStatus.queued,),
                       error=reason):  # fmt: skip
        store.move_trials(s, members, TrialStatus.pending, only_from=(TrialStatus.queued,))


def _ready_statuses(spec: StoredSpec) -> tuple[TrialStatus, ...]:
    """The statuses of a study's trials with units to plan: pending; with segment units also
    queued and running (a trial's span may have segments left that did not fit one plan)."""
    if spec.training.segment_units:
        return (TrialStatus.pending, TrialStatus.queued, TrialStatus.running)
    return (TrialStatus.pending,)


def _units(s: Session, p: _Planned, order: Order, briefs: list[store.TrialBrief]) -> list[Unit]:
    """The units of ``briefs``, the study's trials in any status of :func:`_ready_statuses`
    (others are left out here)."""
    spec, study = p.spec, p.study
    # what trials of different studies must share to fuse: batches (the seed) and how they
    # train (decoupled segments); not the horizon, since each member has its own schedule
    lane = f"{study.seed}|{spec.training.lane}"
    brackets = spec.brackets
    s_max = len(brackets) - 1
    k = spec.training.segment_units
    # a trial of segment units may be queued or running with some of its span's segments
    # planned (they did not all fit one plan): the rest are its ready units
    ready = _ready_statuses(spec)
    briefs = [t for t in briefs if t.status in ready]
    planned = store.planned_segments(
        s, [t.id for t in briefs if t.status != TrialStatus.pending]) if k else {}  # fmt: skip
    units = []
    # a study's thousands of ready trials stand at a handful of (bracket, rung, resource)
    # places: each place's unit end and remaining work are worked out once
    places: dict[tuple[int, int, float], tuple[float, float]] = {}
    for t in briefs:
        place = (t.bracket, t.rung, t.resource_done)
        if (known := places.get(place)) is None:
            target = rung_resource(spec, t.bracket, t.rung)
            known = places[place] = (
                unit_end(spec, t.resource_done, target),
                expected_remaining(brackets[s_max - t.bracket], t.rung, t.resource_done),
            )
        end, left = known
        rank = unit_key(order, p.band, study.id, left, t.id)
        if not k:
            units.append(Unit(t.id, t.fusion_key, t.resource_done, end, lane, rank))
            continue
        # each segment its own unit, with a fusion key (a memory model, a throughput curve)
        # and a lane of its own: an array holds one segment of its trials
        mine = planned.get(t.id, set())
        units += [Unit(t.id, segment_key(t.fusion_key, j, k), t.resource_done, end,
                       f"{lane}|segment {j}", rank, j)
                  for j in range(k) if (t.resource_done, j) not in mine]  # fmt: skip
    return units


def _held_devices(
    s: Session, loads: dict[int, StudyLoad], quantum: float, now: datetime
) -> dict[str, Band]:
    """Device -> the best fair-share band among the studies of its unfinished packs.

    A device with a pack of a better-served study in hand keeps its second slot
    (:data:`QUEUE_DEPTH`) for that study: a worse band's pack queued there would start the
    moment the better study's pack ends, a step before that study's next pack is planned
    (its next rung is decided by the tick its end wakes), and then be asked to give the
    device up again (:func:`_yield_for`): a yield per rung of the small study, each a
    pack's start and stop of the large one (0.1-0.8 s on a 2-core CPU, bench g). Held
    back, the device waits for that tick instead (tens of ms), and the worse band's pack
    is planned there once the better study has nothing ready. A pack waiting out a
    retry's backoff (``retry_after``) holds nothing: the device would idle through it.
    """
    unfinished = [
        p for p in store.packs_with_status(s, UNFINISHED)
        if p.device is not None and (p.retry_after is None or p.retry_after <= now)
    ]  # fmt: skip
    if not unfinished:
        return {}
    studies = store.studies_of_packs(s, [p.id for p in unfinished])
    out: dict[str, Band] = {}
    for pack in unfinished:
        b = _best_band(studies[pack.id], loads, quantum)
        if b is not None:
            out[str(pack.device)] = min(b, out.get(str(pack.device), b))
    return out


def _plan_group(
    s: Session,
    group: list[_Planned],
    workers: list[Worker],
    settings: Settings,
    order: Order,
    loads: dict[int, StudyLoad],
    quantum: float,
    now: datetime,
) -> tuple[int, bool]:
    """Plan the pending units of one group of studies (one pack size limit); the packs made,
    and whether units were left while a device still has a slot open. With fair order, a
    device held for a better band than the group's best
    (:func:`_held_devices`) takes none of its packs."""
    # the devices first: a full fleet (the common case between packs' ends) is one query,
    # where the group's ready units are one or more per study
    devices = devices_of(workers, settings)
    busy = store.packs_per_device(s, UNFINISHED)
    ours = min(p.band for p in group)
    # only a device with a pack in hand and a slot left can be held: read the holds then
    partly = any(0 < busy[name] < QUEUE_DEPTH for name in devices)
    held = _held_devices(s, loads, quantum, now) if order == "fair" and partly else {}
    free = [
        dev for name, (dev, _) in devices.items()
        if busy[name] < QUEUE_DEPTH and (busy[name] == 0 or held.get(name, ours) >= ours)
    ]  # fmt: skip
    if not free:
        return 0, False
    study_of: dict[int, int] = {}
    units: list[Unit] = []
    # every study's ready trials in one query
    wanted = {status for p in group for status in _ready_statuses(p.spec)}
    briefs = store.studies_briefs(
        s, [p.study.id for p in group], [st for st in TrialStatus if st in wanted]
    )
    for p in group:
        mine = _units(s, p, order, briefs[p.study.id])
        study_of.update({u.trial_id: p.study.id for u in mine})
        units += mine
    if not units:
        return 0, False
    kind = devices[free[0].name][1]  # one device kind per plan; mixed fleets use the first
    cap = _cap(group[0].spec)
    profiles: dict[str, Profile] = {}
    for workload in sorted({p.study.workload for p in group}):
        profiles.update(store.profiles_of(s, workload, kind))
    units = _probe_first(units, profiles, store.fusion_keys_of_packs(s, UNFINISHED))
    # bounded work per tick: the rest is planned by the next tick, which the loop runs at
    # once while a device has a slot open (FleetPlan.more)
    units.sort(key=lambda u: (u.rank, u.trial_id))
    units, later = units[:MAX_UNITS_PER_PLAN], units[MAX_UNITS_PER_PLAN:]
    memory: dict[str, MemoryModel] = {}
    sizes: dict[str, int] = {}
    whole: set[str] = set()  # keys whose groups are not cut by a measured size
    for key in {u.fusion_key for u in units}:
        profile = profiles.get(key)
        if profile and profile.base_bytes is not None and profile.per_trial_bytes is not None:
            memory[key] = MemoryModel(int(profile.base_bytes), int(profile.per_trial_bytes))
        alone, at_once = store.measured_curve(profile)
        cut = planned_array_size(alone, at_once, None)
        if cut is None:
            # cut only to spread over devices and fit memory, at the walk's size over one
            # array alone (as before); in one pack, one array (array_numbers)
            whole.add(key)
            sizes[key] = best_array_size(alone, cap)
        else:
            sizes[key] = cut  # plan_packs caps it at max_pack_size
    plan = plan_packs(
        units,
        free,
        memory,
        sizes,
        default_memory=DEFAULT_MEMORY,
        max_pack_size=cap,
        max_packs_per_device=1,
        # shared packs would put every study's work on the first free device; one study per
        # pack (PACKTUNE_SHARE_PACKS=false) plans as packtune did before, first fit
        spread=settings.share_packs,
        # a unit too large for every device trains alone, spilled (PACKTUNE_SPILL)
        spill=settings.spill,
        # ...for every live device, that is: one that fits a device with no slot open now
        # waits for it, rather than failing or training spilled on a smaller one
        largest_live=max(dev.capacity for dev, _ in devices.values()),
    )
    plan.deferred += later
    queued: list[int] = []
    new: list[store.NewPack] = []
    for planned in plan.packs:
        # the arrays as cut by the measured array size: the worker trains them apart
        numbers = array_numbers(planned, whole)
        members = [
            (u.trial_id, u.fusion_key, u.from_resource, u.to_resource, u.segment, numbers[n])
            for n, array in enumerate(planned.arrays)
            for u in array.units
        ]
        study_id = min(study_of[u.trial_id] for u in planned.units)
        new.append(store.NewPack(study_id, members, planned.device, planned.estimated_bytes))
        queued += [u.trial_id for u in planned.units]
    store.add_packs(s, new)
    store.move_trials(s, sorted(set(queued)), TrialStatus.queued, only_from=(TrialStatus.pending,))
    store.move_trials(
        s,
        [u.trial_id for u in plan.unplaceable],
        TrialStatus.failed,
        only_from=(TrialStatus.pending,),
        error="fits no device: its estimated memory exceeds every live device's free memory "
        "(PACKTUNE_SPILL=true would train it spilled, if its model is an nn.Sequential)",
    )
    s.flush()
    placed = Counter(p.device for p in plan.packs)
    room = any(busy[dev.name] + placed[dev.name] < QUEUE_DEPTH for dev in free)
    # a plan that placed nothing would place nothing again before something changes
    return len(plan.packs), bool(plan.packs and plan.deferred) and room


def dispatch_order(
    s: Session,
    packs: Sequence[Pack],
    settings: Settings,
    now: datetime,
    used_memo: dict[int, float] | None = None,
) -> list[Pack]:
    """``packs`` (pending) in the order to dispatch them: ``id`` order, or with
    ``fair``: the pack of the least-served study first (its best band), then the one
    with the longest expected remaining work of a member, then id. ``used_memo``: see
    :func:`study_loads`."""
    if settings.dispatch_order == "id" or len(packs) < 2:
        return sorted(packs, key=lambda pack: pack.id)
    members = store.member_places(s, [pack.id for pack in packs])
    ids = sorted({m.study_id for places in members.values() for m in places})
    studies = {i: store.get_study(s, i) for i in ids}
    specs = {i: StoredSpec.of(study.spec) for i, study in studies.items()}
    loads = study_loads(s, list(studies.values()), settings, now, used_memo)
    quantum = fair_share_quantum(s, settings)
    bands = {i: band(loads[i], quantum) for i in ids}

    @cache
    def remaining(study_id: int, bracket: int, rung: int, done: float) -> float:
        brackets = specs[study_id].brackets
        return expected_remaining(brackets[len(brackets) - 1 - bracket], rung, done)

    def key(pack: Pack) -> tuple[Any, ...]:
        places = members[pack.id]
        best = min((bands[m.study_id] for m in places), default=(0, 0))
        left = max(
            (remaining(m.study_id, m.bracket, m.rung, m.from_resource) for m in places),
            default=0.0,
        )
        return (best, -left, pack.id)

    return sorted(packs, key=key)
