"""The pack planner: which ready units of work train together, on which device.

A *unit* is (trial, from_resource, to_resource). Units with the same fusion
key and the same resource span can be trained as one *fused array*; a *pack*
is the arrays one job runs on one device. :func:`plan_packs` decides, from
plain values only:

1. Group units by ``(fusion_key, lane, from_resource, to_resource)``, in that
   sorted order, by ``rank`` then trial id within a group. A unit's ``lane`` holds
   what else its trial must share with the others of an array (the scheduler puts
   the data seed and training of the trial's study there, so that trials of
   different studies fuse only where that is exact); ``rank`` is the caller's
   priority (lower first; by default all equal).
2. Cut each group into arrays no larger than the array size given for its key
   (:func:`planned_array_size` or :func:`best_array_size`, from the measured curves),
   the study's ``max_pack_size``, and the largest size whose estimated memory
   fits the roomiest device: the fewest arrays, of sizes differing by one at most
   (:func:`balanced_chunks`), unless memory is what limits them (then as large as fit,
   in order). A unit that fits none of the given devices even alone waits (is
   deferred) where it fits a live device that has no slot open now (``largest_live``);
   one that fits no live device is
   *unplaceable*: the caller must say so, not wait for it; or, with ``spill``, it
   becomes an array of its own marked ``spilled`` (trained shard by shard through
   a device: :mod:`packtune.spilling`), which takes a device whole, in a pack of its
   own, on a device nothing else was planned onto in this call; with every device
   taken, it joins a pack of spilled arrays (up to :data:`SPILL_ALTERNATE`), which
   alternate on their device; else it is deferred.
3. First-fit-decreasing: arrays by rank (their best unit's), then estimated bytes,
   largest first, go into the
   first open pack whose device still has room (and whose trial count stays
   within ``max_pack_size``); otherwise into a new pack on the device with
   the most room left that fits the array, within ``max_packs_per_device``;
   otherwise they are *deferred* to a later plan.

A device's room is its capacity, ``int(free_bytes * HEADROOM)``, shared by
every pack planned onto it in one call: packs on one device may run at once.
With no devices at all nothing is unplaceable; everything is deferred.

Memory per array of k trials follows ``MemoryModel.bytes(k) = base + k *
per_trial``, one model per fusion key (``default_memory`` for keys not yet
probed). A pack's estimate is the sum of its arrays'. Models only grow:
:meth:`MemoryModel.corrected` after a measured peak, :meth:`MemoryModel.after_oom`
after a CUDA out-of-memory error (the caller re-queues both halves of
:func:`split_in_two`).

A trial trained as decoupled segments may be several units, one per segment
(``Unit.segment``, its own key: :func:`segment_key`); they are planned like any units,
together or across calls.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter
from typing import Any, TypeVar

from packtune.tuning import HEADROOM, MIN_GAIN_PERCENT, RETRY_BACKOFF_MAX_S, SPILL_ALTERNATE

T = TypeVar("T")


@dataclass(frozen=True)
class Unit:
    """Train ``trial_id`` from cumulative resource ``from_resource`` to ``to_resource``;
    ``lane`` and ``rank``: see the module docstring; ``segment``: only that segment of the
    trial's decoupled model (``-1``: the whole trial; the caller puts the segment in the
    lane, so that an array holds one segment of its trials)."""

    trial_id: int
    fusion_key: str
    from_resource: float
    to_resource: float
    lane: str = ""
    rank: tuple[float, ...] = ()
    segment: int = -1

    @property
    def group(self) -> tuple[str, float, float]:
        return (self.fusion_key, self.from_resource, self.to_resource)

    @property
    def array_key(self) -> tuple[str, str, float, float]:
        """Units with equal keys may train as one fused array."""
        return (self.fusion_key, self.lane, self.from_resource, self.to_resource)


@dataclass(frozen=True)
class MemoryModel:
    """Estimated peak device bytes of a fused array of ``k`` trials: ``base + k * per_trial``."""

    base: int
    per_trial: int

    def bytes(self, k: int) -> int:
        return self.base + k * self.per_trial

    @classmethod
    def from_probe(cls, peak_one: int, peak_two: int) -> MemoryModel:
        """The model through the peaks measured at k=1 and k=2 (never negative)."""
        per_trial = max(0, peak_two - peak_one)
        return cls(base=max(0, peak_one - per_trial), per_trial=per_trial)

    def corrected(self, k: int, peak_bytes: int) -> MemoryModel:
        """A model that predicts at least ``peak_bytes`` for ``k`` trials; never lower."""
        _check_k(k)
        if self.bytes(k) >= peak_bytes:
            return self
        return MemoryModel(self.base, -(-(peak_bytes - self.base) // k))

    def after_oom(self, k: int, capacity_bytes: int) -> MemoryModel:
        """A model under which ``k`` trials no longer fit ``capacity_bytes``; never lower."""
        _check_k(k)
        if self.bytes(k) > capacity_bytes:
            return self
        return MemoryModel(self.base, (capacity_bytes - self.base) // k + 1)

    def max_fit(self, capacity_bytes: int, limit: int) -> int:
        """The largest ``k <= limit`` with ``bytes(k) <= capacity_bytes`` (0 if none)."""
        if self.base + self.per_trial > capacity_bytes:
            return 0
        if self.per_trial <= 0:
            return limit
        return min(limit, (capacity_bytes - self.base) // self.per_trial)


def _check_k(k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


@dataclass(frozen=True)
class Device:
    """A device a pack can run on, with the free memory it last reported."""

    name: str
    free_bytes: int

    @property
    def capacity(self) -> int:
        return int(self.free_bytes * HEADROOM)


def best_array_size(throughput: Mapping[int, float], cap: int | None) -> int:
    """The array size to use next, from measured trial-steps/second by array size.

    The whole measured curve decides (Omnivore: measure, then choose): from the smallest
    measured k, each larger measured k in turn becomes the choice when it gains at least
    10 % over the choice so far, so a dip at some k (noise, a cache boundary) does not hide
    a larger k that is much faster. When the choice is the largest k measured, the curve
    still rises there: propose 2k, to explore. An empty table proposes 2. The result is
    clamped to ``[1, cap]``.
    """
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    if not throughput:
        choice = 2
    else:
        sizes = sorted(throughput)
        choice = sizes[0]
        for k in sizes[1:]:
            if _gains(throughput[choice], throughput[k]):
                choice = k
        if choice == sizes[-1]:
            choice *= 2
    return max(1, choice if cap is None else min(choice, cap))


def execution_curve(alone: Mapping[int, float], at_once: Mapping[int, float]) -> dict[int, float]:
    """Trial-steps/second by array size, the better of the two ways arrays of that size
    were measured to run: one array alone, or a pack's arrays of that size several at once
    (threads; on a GPU each its own stream). The curve :func:`best_array_size` chooses from:
    where k arrays of one trial at once beat a fused array of k (a CNN through vmap's rule
    on a GPU), or two large arrays at once beat one twice their size (a CPU, one core per
    array), the size of the faster way wins."""
    return {k: max(alone.get(k, 0.0), at_once.get(k, 0.0)) for k in sorted({*alone, *at_once})}


def planned_array_size(
    alone: Mapping[int, float], at_once: Mapping[int, float], cap: int | None
) -> int | None:
    """The size to cut a fusion key's ready units to, from its two measured curves, or
    None: not cut by measurement (a group's chunks train as one array in a pack); with
    ``cap``, a size is never above it, and a group not cut by measurement gets ``cap`` (a
    pack holds no more).

    A group is cut only where one array alone peaks: Omnivore's walk (:func:`best_array_size`)
    over ``alone`` picks a measured size, and every larger size measured alone was slower
    by the walk's margin (10%), as vmap's convolution rule can be. The cut is then the walk
    over the better of the two curves at each size up to that peak (:func:`execution_curve`):
    smaller arrays several at once may beat the peak (one-trial models in streams against
    vmap on a GPU). Where the alone curve rises at its end or is flat past its choice (on a
    CPU, one core's limit, where the worker halves a large array for its threads), or nothing
    is measured, None: readings at once against readings alone at larger sizes would
    compare two cores with one, and cutting there made a fleet slower (bench g).
    """
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    peak = best_array_size(alone, None)
    if peak not in alone or not all(_gains(v, alone[peak]) for k, v in alone.items() if k > peak):
        return cap
    up_to_peak = {k: v for k, v in execution_curve(alone, at_once).items() if k <= peak}
    choice = min(best_array_size(up_to_peak, None), peak)
    return choice if cap is None else min(choice, cap)


def _gains(old: float, new: float) -> bool:
    # In percent, so that exactly +10 % counts (1.10 * 100 is 110.00000000000001).
    return 100 * new >= (100 + MIN_GAIN_PERCENT) * old


def split_for_threads(arrays: Sequence[Sequence[T]], threads: int, min_part: int) -> list[list[T]]:
    """``arrays`` with the largest cut in halves (the first half gets the odd one), again and
    again, while there are fewer than ``threads`` and the largest holds ``2 * min_part`` or
    more; the order of the arrays and of their members is kept."""
    out = [list(a) for a in arrays]
    while len(out) < threads and out:
        at = max(range(len(out)), key=lambda i: len(out[i]))
        big = out[at]
        if len(big) < 2 * min_part:
            break
        middle = (len(big) + 1) // 2
        out[at : at + 1] = [big[:middle], big[middle:]]
    return out


def array_numbers(pack: PlannedPack, whole: Collection[str]) -> list[int]:
    """The number of each of ``pack``'s arrays as its worker will train them: its own
    position, except that the arrays of one group of units (``Unit.array_key``) whose key is
    in ``whole`` share the first one's: a group not cut by a measured size
    (:func:`planned_array_size` is None) is cut only to spread over devices and to fit
    memory, and within one pack trains as one array. Spilled arrays keep their own."""
    numbers: list[int] = []
    first: dict[tuple[Any, ...], int] = {}
    for n, array in enumerate(pack.arrays):
        group = array.units[0].array_key
        if array.spilled or array.fusion_key not in whole:
            numbers.append(n)
        else:
            numbers.append(first.setdefault(group, n))
    return numbers


def split_in_two(units: Sequence[T]) -> tuple[list[T], list[T]]:
    """Halves of a pack's units (or members) that ran out of memory; the first half gets
    the odd one."""
    if len(units) < 2:
        raise ValueError("a single unit cannot be split; its memory model must rule it out")
    middle = (len(units) + 1) // 2
    return list(units[:middle]), list(units[middle:])


@dataclass(frozen=True)
class PlannedArray:
    """Units of one ``(fusion_key, from_resource, to_resource)`` trained as one model."""

    fusion_key: str
    from_resource: float
    to_resource: float
    units: tuple[Unit, ...]
    estimated_bytes: int
    spilled: bool = False

    @property
    def rank(self) -> tuple[float, ...]:
        return min(unit.rank for unit in self.units)


@dataclass(frozen=True)
class PlannedPack:
    """What one job runs on ``device``."""

    device: str
    arrays: tuple[PlannedArray, ...]

    @property
    def estimated_bytes(self) -> int:
        return sum(array.estimated_bytes for array in self.arrays)

    @property
    def units(self) -> tuple[Unit, ...]:
        return tuple(unit for array in self.arrays for unit in array.units)

    @property
    def spilled(self) -> bool:
        return any(array.spilled for array in self.arrays)


@dataclass
class PackPlan:
    """Every input unit lands in exactly one of ``packs``, ``deferred``, ``unplaceable``."""

    packs: list[PlannedPack] = field(default_factory=list)
    deferred: list[Unit] = field(default_factory=list)
    unplaceable: list[Unit] = field(default_factory=list)


def _sort_key(unit: Unit) -> tuple[Any, ...]:
    return (*unit.array_key, unit.rank, unit.trial_id, unit.segment)


def _arrays(
    units: Sequence[Unit],
    memory: Mapping[str, MemoryModel],
    array_size: Mapping[str, int],
    default_memory: MemoryModel,
    max_pack_size: int | None,
    largest_capacity: int,
    unplaceable: list[Unit],
    spill: bool,
    largest_live: int,
    waiting: list[Unit],
) -> list[PlannedArray]:
    arrays = []
    for (key, _, start, stop), members in groupby(
        sorted(units, key=_sort_key), key=attrgetter("array_key")
    ):
        group = list(members)
        model = memory.get(key, default_memory)
        wanted = max(1, array_size.get(key, 1))
        if max_pack_size is not None:
            wanted = min(wanted, max_pack_size)
        limit = model.max_fit(largest_capacity, wanted)
        if limit == 0 and model.max_fit(largest_live, 1) > 0:
            waiting.extend(group)  # a live device without a slot now fits it: wait for it
            continue
        if limit == 0 and spill:
            arrays += [PlannedArray(key, start, stop, (u,), model.bytes(1), True) for u in group]
            continue
        if limit == 0:
            unplaceable.extend(group)
            continue
        # memory-bound: arrays as large as fit (what does not fit this call waits for the next)
        cut = balanced_chunks(group, limit) if limit == wanted else _full_chunks(group, limit)
        for chunk in cut:
            arrays.append(PlannedArray(key, start, stop, chunk, model.bytes(len(chunk))))
    return arrays


def _full_chunks(items: Sequence[T], limit: int) -> list[tuple[T, ...]]:
    return [tuple(items[first : first + limit]) for first in range(0, len(items), limit)]


def balanced_chunks(items: Sequence[T], limit: int) -> list[tuple[T, ...]]:
    """``items`` in order, cut into the fewest chunks of at most ``limit``, their sizes
    differing by one at most (the larger first): 17 at 4 is 4, 4, 3, 3, 3, not
    4, 4, 4, 4, 1, whose last array would train far from the measured size and, at once
    beside the others, finish long before them.

    >>> [len(c) for c in balanced_chunks(range(20), 8)]
    [7, 7, 6]
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    count = -(-len(items) // limit)
    out: list[tuple[T, ...]] = []
    first = 0
    for n in range(count):
        size = len(items) // count + (n < len(items) % count)
        out.append(tuple(items[first : first + size]))
        first += size
    return out


@dataclass
class _OpenPack:
    device: Device
    arrays: list[PlannedArray]

    def trials(self) -> int:
        return sum(len(array.units) for array in self.arrays)

    def work(self) -> float:
        """Trial-resource of its units (what it will take, roughly, on one device)."""
        return sum(u.to_resource - u.from_resource for a in self.arrays for u in a.units)


def plan_packs(
    units: Iterable[Unit],
    devices: Sequence[Device],
    memory: Mapping[str, MemoryModel],
    array_size: Mapping[str, int],
    *,
    default_memory: MemoryModel,
    max_pack_size: int | None = None,
    max_packs_per_device: int | None = None,
    spread: bool = False,
    spill: bool = False,
    largest_live: int | None = None,
) -> PackPlan:
    """Bin-pack ready units into packs that fit their devices (see the module docstring).

    ``spread``: keep several devices busy rather than fill the first: an array goes to a
    device that has no pack yet while one is free, else to the open pack with the least
    work (trial-resource) that has room; first-fit otherwise. ``largest_live``: the
    largest capacity of every live device, ``devices`` or not (those with no slot open
    now): a unit too large for ``devices`` that fits it is deferred until that device has
    a slot, neither unplaceable nor spilled."""
    units = list(units)
    if len({(unit.trial_id, unit.segment) for unit in units}) != len(units):
        raise ValueError("a trial (or a segment of one) may have only one ready unit of work")
    if len({device.name for device in devices}) != len(devices):
        raise ValueError("device names must be unique")
    for name, value in (
        ("max_pack_size", max_pack_size),
        ("max_packs_per_device", max_packs_per_device),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {value}")
    if not devices:
        return PackPlan(deferred=sorted(units, key=_sort_key))

    plan = PackPlan()
    largest = max(device.capacity for device in devices)
    deferred: list[Unit] = []
    arrays = _arrays(
        units, memory, array_size, default_memory, max_pack_size, largest, plan.unplaceable,
        spill, max(largest, largest_live or 0), deferred,
    )  # fmt: skip
    used = {device.name: 0 for device in devices}
    count = {device.name: 0 for device in devices}
    open_packs: list[_OpenPack] = []
    # sorted() is stable: equal ranks and estimates keep the deterministic group order.
    for array in sorted(arrays, key=lambda array: (array.rank, -array.estimated_bytes)):
        if array.spilled:  # a device of its own, or alternating with other spilled arrays
            empty = [device for device in devices if count[device.name] == 0]
            sharing = [
                pack for pack in open_packs
                if pack.arrays[0].spilled and len(pack.arrays) < SPILL_ALTERNATE
                and (max_pack_size is None or pack.trials() + len(array.units) <= max_pack_size)
            ]  # fmt: skip
            if empty:
                device = max(empty, key=attrgetter("capacity"))
                open_packs.append(_OpenPack(device, [array]))
                count[device.name] += 1
                used[device.name] = device.capacity
            elif sharing:
                sharing[0].arrays.append(array)
            else:
                deferred.extend(array.units)
            continue
        size = array.estimated_bytes
        room = [
            pack
            for pack in open_packs
            if not pack.arrays[0].spilled
            and used[pack.device.name] + size <= pack.device.capacity
            and (max_pack_size is None or pack.trials() + len(array.units) <= max_pack_size)
        ]
        candidates = [
            device
            for device in devices
            if used[device.name] + size <= device.capacity
            and (max_packs_per_device is None or count[device.name] < max_packs_per_device)
        ]
        if spread and any(count[device.name] == 0 for device in candidates):
            target = None  # a device with nothing to do yet: start a pack there
            candidates = [device for device in candidates if count[device.name] == 0]
        elif spread and room:
            target = min(room, key=lambda pack: (pack.work(), open_packs.index(pack)))
        else:
            target = room[0] if room else None
        if target is None:
            if not candidates:
                deferred.extend(array.units)
                continue
            device = max(candidates, key=lambda device: device.capacity - used[device.name])
            target = _OpenPack(device, [])
            open_packs.append(target)
            count[device.name] += 1
        target.arrays.append(array)
        used[target.device.name] += size

    plan.packs = [PlannedPack(pack.device.name, tuple(pack.arrays)) for pack in open_packs]
    plan.deferred = sorted(deferred, key=_sort_key)
    return plan


def retry_delay(base: float, attempt: int, jitter: float) -> float:
    """Seconds before retrying a pack whose ``attempt``-th attempt failed: ``base`` doubled
    per attempt up to :data:`~packtune.tuning.RETRY_BACKOFF_MAX_S`, scaled by ``jitter``
    (0..1, drawn by the caller) into its upper half, so that packs failed together do not
    all come back at once."""
    capped = min(RETRY_BACKOFF_MAX_S, base * 2 ** max(0, attempt - 1))
    return capped * (0.5 + 0.5 * jitter)


def segment_key(fusion_key: str, segment: int, segments: int) -> str:
    """The fusion key of segment ``segment`` of ``segments`` of a trial keyed ``fusion_key``:
    segments differ in memory and speed, so each has its own profile."""
    return f"{fusion_key}|segment {segment} of {segments}"
