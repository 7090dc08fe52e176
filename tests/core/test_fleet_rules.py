"""packtune.fleet: fair share between studies and longest-remaining-first, as pure rules;
and the planner's lanes and ranks (packtune.packing)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from packtune.fleet import (
    StudyLoad,
    band,
    covered_seconds,
    entitled_shares,
    expected_remaining,
    packs_to_yield,
    seconds_to_leave_band,
    split_seconds,
    study_order,
    unit_key,
    with_owners,
)
from packtune.hyperband import plan_brackets
from packtune.packing import Device, MemoryModel, Unit, plan_packs

BRACKETS = plan_brackets(27, eta=3)  # s = 3, 2, 1, 0


def test_expected_remaining_weighs_later_rungs_by_the_chance_of_reaching_them() -> None:
    most_aggressive, least = BRACKETS[0], BRACKETS[-1]
    # 1 epoch, then 2 more for 9 of 27, 6 more for 3 of 27, 18 more for 1 of 27
    assert expected_remaining(most_aggressive, 0, 0.0) == pytest.approx(3.0)
    assert expected_remaining(least, 0, 0.0) == 27.0
    assert expected_remaining(least, 0, 9.0) == 18.0  # a resumed trial: what is left
    assert expected_remaining(most_aggressive, 3, 27.0) == 0.0
    with pytest.raises(ValueError, match="rung 4"):
        expected_remaining(most_aggressive, 4, 0.0)


def test_study_order_serves_the_least_served_study_per_unit_of_priority() -> None:
    loads = [
        StudyLoad(1, priority=1.0, used_seconds=100.0),  # level 100
        StudyLoad(2, priority=4.0, used_seconds=200.0),  # level 50: more priority, served first
        StudyLoad(3, priority=1.0, used_seconds=0.0),  # just submitted
    ]
    assert study_order(loads, quantum=10.0) == [3, 2, 1]
    assert study_order(loads, quantum=10.0, order="id") == [1, 2, 3]
    # within one quantum studies are equal: id (and, for units, remaining work) decides
    assert study_order(loads, quantum=1000.0) == [1, 2, 3]
    with pytest.raises(ValueError, match="quantum"):
        band(loads[0], 0.0)


def test_an_infinite_level_is_the_last_band_not_an_error() -> None:
    """A priority too small for a float (1e-320, taken before priorities had a lower bound
    and still in a database) made its study's level infinite: ``band`` raised
    OverflowError, and planning failed every tick for every running study."""
    loads = [StudyLoad(1, priority=1e-320, used_seconds=1.0), StudyLoad(2, 1.0, 50.0)]
    assert math.isinf(loads[0].level)
    assert band(loads[0], 1.0) > band(loads[1], 1.0)
    assert study_order(loads, quantum=1.0) == [2, 1]
    assert study_order(with_owners([*loads, StudyLoad(3, 1.0, 0.0, owner="a")]), 1.0) == [3, 2, 1]


def test_unit_key_takes_the_fair_band_then_the_longest_remaining_work() -> None:
    keys = {
        "short, band 0": unit_key("fair", 0, 2, 3.0, 10),
        "long, band 0": unit_key("fair", 0, 1, 27.0, 11),
        "long, band 1": unit_key("fair", 1, 3, 27.0, 1),
    }
    assert sorted(keys, key=keys.__getitem__) == ["long, band 0", "short, band 0", "long, band 1"]
    assert unit_key("id", 5, 2, 27.0, 11) > unit_key("id", 0, 1, 3.0, 99)  # study id first


@given(
    st.lists(st.tuples(st.floats(0.01, 100), st.floats(0, 1e4)), min_size=1, max_size=8).map(
        lambda rows: [StudyLoad(i, p, u) for i, (p, u) in enumerate(rows)]
    )
)
def test_entitled_shares_sum_to_one_in_proportion_to_priority(loads: list[StudyLoad]) -> None:
    shares = entitled_shares(loads)
    assert sum(shares.values()) == pytest.approx(1.0)
    first = loads[0]
    for load in loads[1:]:
        ratio = shares[load.study_id] / shares[first.study_id]
        assert ratio == pytest.approx(load.priority / first.priority)


@given(
    st.floats(0, 1e4),
    st.dictionaries(st.integers(1, 5), st.floats(0, 100), min_size=1, max_size=5),
)
def test_a_shared_pack_is_split_by_work_and_nothing_is_lost(
    seconds: float, work: dict[int, float]
) -> None:
    split = split_seconds(seconds, work)
    if sum(work.values()) <= 0:
        assert split == {}
    else:
        assert sum(split.values()) == pytest.approx(seconds)
        assert all(split[i] >= 0 for i in work)


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 50)), max_size=10))
def test_covered_seconds_counts_overlaps_once(raw: list[tuple[float, float]]) -> None:
    spans = [(a, a + d) for a, d in raw]
    covered = covered_seconds(spans)
    assert covered <= sum(b - a for a, b in spans) + 1e-9
    assert covered >= max((b - a for a, b in spans), default=0.0) - 1e-9
    if spans:
        assert covered <= max(b for _, b in spans) - min(a for a, _ in spans) + 1e-9
    assert covered_seconds([(0, 2), (1, 3), (5, 6)]) == 4.0
    assert math.isclose(covered_seconds([]), 0.0)


# -- the planner's lanes and ranks ------------------------------------------------------------

MEMORY = MemoryModel(base=0, per_trial=1)


def test_a_waiting_pack_of_a_better_band_takes_the_worst_served_running_pack() -> None:
    # pack ids -> bands; one device free takes the best waiting pack, the next best (band 0)
    # preempts the worst running pack (band 3, the newest of the two at 3), band 2 the other
    assert packs_to_yield({1: 3, 2: 1, 3: 3}, [2, 0, 0], free_devices=1) == [3, 1]
    assert packs_to_yield({1: 3}, [0], free_devices=1) == []  # a free device takes it
    assert packs_to_yield({1: 0}, [0, 0], free_devices=0) == []  # equal bands never preempt
    assert packs_to_yield({1: 2, 2: 1}, [1], free_devices=0) == [1]
    assert packs_to_yield({}, [0], free_devices=0) == []


@given(
    running=st.dictionaries(st.integers(1, 50), st.integers(0, 5), max_size=8),
    waiting=st.lists(st.integers(0, 5), max_size=8),
    free=st.integers(0, 3),
)
def test_preemption_only_ever_serves_a_strictly_better_band(
    running: dict[int, int], waiting: list[int], free: int
) -> None:
    """Each pack asked to yield is running, asked once, and matched to its own waiting pack
    (one no free device takes) of a strictly better band; no running pack kept is worse
    than a waiting pack left without a device."""
    out = packs_to_yield(running, waiting, free)
    assert len(set(out)) == len(out) and set(out) <= set(running)
    left = sorted(waiting)[free:]
    assert len(out) <= len(left)
    for pack, want in zip(out, left, strict=False):
        assert running[pack] > want
    kept = [b for p, b in running.items() if p not in out]
    unserved = left[len(out) :]
    if kept and unserved:
        assert max(kept) <= min(unserved)


def test_a_study_leaves_its_band_when_its_level_reaches_the_next_quantum() -> None:
    # level 0.88 (0.88 device-s at priority 1), quantum 1: 0.12 s at a whole device
    assert seconds_to_leave_band(StudyLoad(1, 1.0, 0.88), 1.0, 1.0) == pytest.approx(0.12)
    # half of a shared pack, priority 2 (level 0.44): twice the seconds for each
    assert seconds_to_leave_band(StudyLoad(1, 2.0, 0.88), 1.0, 0.5) == pytest.approx(2.24)
    # on two devices at once it gets there twice as fast
    assert seconds_to_leave_band(StudyLoad(1, 1.0, 0.5), 1.0, 2.0) == pytest.approx(0.25)
    assert seconds_to_leave_band(StudyLoad(1, 1.0, 0.5), 1.0, 0.0) == math.inf  # not training


@given(
    used=st.floats(0, 1e4), priority=st.floats(0.1, 10), rate=st.floats(0.01, 8),
    quantum=st.floats(0.01, 100),
)  # fmt: skip
def test_after_that_many_seconds_the_study_is_in_a_worse_band(
    used: float, priority: float, rate: float, quantum: float
) -> None:
    load = StudyLoad(1, priority, used)
    wait = seconds_to_leave_band(load, quantum, rate)
    assert wait >= 0
    later = StudyLoad(1, priority, used + rate * wait * 1.000001 + 1e-9)
    assert band(later, quantum) > band(load, quantum)


def test_units_of_different_lanes_never_share_an_array() -> None:
    units = [Unit(i, "k", 0, 1, lane="seed-1") for i in range(3)]
    units += [Unit(i, "k", 0, 1, lane="seed-2") for i in range(3, 5)]
    plan = plan_packs(units, [Device("d", 10**9)], {"k": MEMORY}, {"k": 8},
                      default_memory=MEMORY)  # fmt: skip
    (pack,) = plan.packs
    lanes = sorted(tuple(sorted(u.lane for u in a.units)) for a in pack.arrays)
    assert lanes == [("seed-1",) * 3, ("seed-2",) * 2]


def test_what_a_device_cannot_take_is_the_worst_ranked_work() -> None:
    """Room for 4 trials: the best-ranked arrays go first (by bytes alone, the largest array,
    of the study over its share, would take the device)."""
    units = [Unit(i, "a", 0, 1, rank=(1, -3.0, i)) for i in range(4)]  # band 1
    units += [Unit(i, "b", 0, 1, rank=(0, -27.0, i)) for i in range(4, 7)]  # band 0, long
    units += [Unit(7, "c", 0, 1, rank=(0, -3.0, 7))]  # band 0, short
    devices = [Device("d", int(4 / 0.9) + 1)]
    keys = ("a", "b", "c")
    plan = plan_packs(units, devices, dict.fromkeys(keys, MEMORY), dict.fromkeys(keys, 8),
                      default_memory=MEMORY)  # fmt: skip
    (pack,) = plan.packs
    assert sorted(u.trial_id for u in pack.units) == [4, 5, 6, 7]
    assert sorted(u.trial_id for u in plan.deferred) == [0, 1, 2, 3]


def test_spread_keeps_every_free_device_busy() -> None:
    """Two free CPU workers with room for everything: first-fit gives one all the work and
    the other nothing; spread starts a pack on each and balances the work between them."""
    units = [Unit(i, "a", 0, 1) for i in range(4)] + [Unit(i, "b", 0, 3) for i in range(4, 6)]
    units += [Unit(i, "c", 1, 3) for i in range(6, 9)]
    devices = [Device("w1/cpu", 10**12), Device("w2/cpu", 10**12)]
    keys = ("a", "b", "c")
    args = (units, devices, dict.fromkeys(keys, MEMORY), dict.fromkeys(keys, 8))
    packed = plan_packs(*args, default_memory=MEMORY)
    assert len(packed.packs) == 1
    spread = plan_packs(*args, default_memory=MEMORY, spread=True)
    assert sorted(p.device for p in spread.packs) == ["w1/cpu", "w2/cpu"]
    work = sorted(sum(u.to_resource - u.from_resource for u in p.units) for p in spread.packs)
    assert work == [6.0, 10.0]  # c (6) | a (4) + b (6): whole arrays, the lighter pack first
    assert sorted(u.trial_id for p in spread.packs for u in p.units) == list(range(9))


@given(
    st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=2, max_size=4),
    st.lists(st.floats(0.5, 2.0), min_size=4, max_size=4),
)
def test_served_in_fair_order_device_time_follows_priority(
    priorities: list[float], pack_seconds: list[float]
) -> None:
    """One device, studies that always have work, one pack at a time to the first study of
    ``study_order`` (each study's packs take its own time): over a long run each study's
    device time is its priority's share, within a pack per study."""
    used = [0.0] * len(priorities)
    for _ in range(400):
        loads = [StudyLoad(i, p, u) for i, (p, u) in enumerate(zip(priorities, used, strict=True))]
        first = study_order(loads, quantum=1e-9)[0]
        used[first] += pack_seconds[first]
    total = sum(used)
    for i, share in entitled_shares(StudyLoad(i, p, 0.0) for i, p in enumerate(priorities)).items():
        assert abs(used[i] - share * total) <= max(pack_seconds) * len(priorities) + 1e-9


# -- owners: a fair-share claim per owner first, then per study ------------------------------


def test_an_owner_who_splits_a_search_into_studies_is_served_as_one_user() -> None:
    """Alice's three studies have used 10 s each, Bob's one 15 s: each of hers is less
    served than his, but she (30 s) more than he. With owners his goes first; without
    labels, hers do (plain weighted fair queuing between studies)."""
    alice = [StudyLoad(i, 1.0, 10.0, owner="alice") for i in (1, 2, 3)]
    bob = StudyLoad(4, 1.0, 15.0, owner="bob")
    loads = with_owners([*alice, bob])
    assert [load.owner_seconds for load in loads] == [30.0, 30.0, 30.0, 15.0]
    assert study_order(loads, quantum=1.0) == [4, 1, 2, 3]
    assert band(loads[0], 1.0) == (30, 10) and band(loads[3], 1.0) == (15, 15)
    unlabelled = [StudyLoad(i, 1.0, 10.0) for i in (1, 2, 3)] + [StudyLoad(4, 1.0, 15.0)]
    assert with_owners(unlabelled) == unlabelled  # nothing to fill
    assert study_order(unlabelled, quantum=1.0) == [1, 2, 3, 4]
    # her shares: one user's half, split between her studies by priority
    shares = entitled_shares([*alice, bob])
    assert shares == pytest.approx({1: 1 / 6, 2: 1 / 6, 3: 1 / 6, 4: 1 / 2})
    # an owner's weight is its largest priority: a priority-3 study of hers weighs 3 to 1
    heavy = [StudyLoad(1, 3.0, 0.0, owner="alice"), StudyLoad(2, 1.0, 0.0, owner="alice"), bob]
    assert entitled_shares(heavy) == pytest.approx({1: 0.75 * 0.75, 2: 0.75 * 0.25, 4: 0.25})


@given(st.lists(st.tuples(st.floats(0, 1e4), st.floats(0.1, 10)), min_size=1, max_size=6))
def test_without_owners_the_bands_are_the_studies_own(rows: list[tuple[float, float]]) -> None:
    """No labels: each study is an owner of its own, and the order is plain weighted fair
    queuing by ``floor(used / priority / quantum)`` (what packtune did before owners)."""
    loads = with_owners(StudyLoad(i, p, u) for i, (u, p) in enumerate(rows))
    for load in loads:
        own = math.floor(load.level / 2.0)
        assert band(load, 2.0) == (own, own)
    expected = sorted(
        range(len(rows)), key=lambda i: (math.floor(rows[i][0] / rows[i][1] / 2.0), i)
    )
    assert study_order(loads, quantum=2.0) == expected


@given(
    st.lists(st.tuples(st.sampled_from([None, "a", "b"]), st.sampled_from([1.0, 2.0, 3.0])),
             min_size=2, max_size=5),
    st.lists(st.floats(0.5, 2.0), min_size=5, max_size=5),
)  # fmt: skip
def test_served_in_fair_order_device_time_follows_owners_then_priority(
    rows: list[tuple[str | None, float]], pack_seconds: list[float]
) -> None:
    """One device, studies with and without owners that always have work, one pack at a
    time to the first study of ``study_order``: over a long run each study's device time is
    its entitled share (its owner's weight, then its priority within the owner)."""
    used = [0.0] * len(rows)
    for _ in range(600):
        loads = with_owners(
            StudyLoad(i, p, used[i], owner=owner) for i, (owner, p) in enumerate(rows)
        )
        first = study_order(loads, quantum=1e-9)[0]
        used[first] += pack_seconds[first]
    total = sum(used)
    shares = entitled_shares(StudyLoad(i, p, 0.0, owner=o) for i, (o, p) in enumerate(rows))
    assert sum(shares.values()) == pytest.approx(1.0)
    for i, share in shares.items():
        assert abs(used[i] - share * total) <= 2 * max(pack_seconds) * len(rows) + 1e-9


def test_an_owner_leaves_its_band_as_all_its_studies_train() -> None:
    """Alice's level 0.9 (1.8 s over weight 2), her study's own 0.2: at one device-second
    per second for the study and two for her (another of her studies trains too), her band
    changes first, after 0.1 s; the study's own after 0.8 s."""
    (load,) = [
        x for x in with_owners([StudyLoad(1, 1.0, 0.2, owner="alice"),
                                StudyLoad(2, 2.0, 1.6, owner="alice")])
        if x.study_id == 1
    ]  # fmt: skip
    assert load.owner_level == pytest.approx(0.9)
    assert seconds_to_leave_band(load, 1.0, 1.0, owner_rate=2.0) == pytest.approx(0.1)
    assert seconds_to_leave_band(load, 1.0, 1.0, owner_rate=0.0) == pytest.approx(0.8)
    assert seconds_to_leave_band(load, 1.0, 0.0, owner_rate=0.0) == math.inf


def test_a_running_pack_of_a_worse_served_owner_gives_way_first() -> None:
    """Bands compare owner first: a pack whose owner is behind yields even though its own
    study's band is better than another running pack's."""
    running = {1: (3, 0), 2: (1, 5)}
    assert packs_to_yield(running, [(0, 9)], free_devices=0) == [1]
    assert packs_to_yield(running, [(1, 5)], free_devices=0) == [1]  # (1, 5) < (3, 0)
    assert packs_to_yield(running, [(3, 0)], free_devices=0) == []  # equal: no turns


@given(
    used=st.floats(0, 1e4), other=st.floats(0, 1e4), priority=st.floats(0.1, 10),
    rate=st.floats(0.01, 8), extra=st.floats(0, 8), quantum=st.floats(0.01, 100),
)  # fmt: skip
def test_after_that_many_seconds_a_study_with_an_owner_is_in_a_worse_band(
    used: float, other: float, priority: float, rate: float, extra: float, quantum: float
) -> None:
    """Its owner's other study gains ``extra`` device-seconds per second beside it."""

    def loads(a: float, b: float) -> StudyLoad:
        return with_owners([StudyLoad(1, priority, a, owner="o"), StudyLoad(2, 1.0, b, "o")])[0]

    load = loads(used, other)
    wait = seconds_to_leave_band(load, quantum, rate, owner_rate=rate + extra)
    assert wait >= 0
    step = wait * 1.000001 + 1e-9
    assert band(loads(used + rate * step, other + extra * step), quantum) > band(load, quantum)
