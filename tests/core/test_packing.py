"""The pack planner, with made-up devices and memory models."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from packtune.packing import (
    HEADROOM,
    Device,
    MemoryModel,
    PackPlan,
    PlannedArray,
    Unit,
    array_numbers,
    balanced_chunks,
    best_array_size,
    execution_curve,
    plan_packs,
    planned_array_size,
    split_for_threads,
    split_in_two,
)
from packtune.tuning import SPILL_ALTERNATE

MiB = 2**20
GPU = Device("gpu0", 1000 * MiB)  # capacity 900 MiB
SMALL = MemoryModel(base=100 * MiB, per_trial=50 * MiB)


def units(key: str, ids: range, start: float = 0.0, stop: float = 1.0) -> list[Unit]:
    return [Unit(trial, key, start, stop) for trial in ids]


def placed(plan: PackPlan) -> list[Unit]:
    return [unit for pack in plan.packs for unit in pack.units]


def test_device_capacity_keeps_headroom() -> None:
    assert GPU.capacity == int(1000 * MiB * HEADROOM) == 900 * MiB


def test_memory_model_corrected_only_raises() -> None:
    model = MemoryModel(base=100, per_trial=10)
    assert model.bytes(4) == 140
    assert model.corrected(4, 120) is model
    raised = model.corrected(4, 151)
    assert raised.base == 100 and raised.bytes(4) >= 151
    assert raised.bytes(4) - 151 < 4  # the smallest per_trial that covers the peak
    with pytest.raises(ValueError):
        model.corrected(0, 200)


def test_memory_model_after_oom() -> None:
    model = MemoryModel(base=100, per_trial=10)
    raised = model.after_oom(4, 200)
    assert raised.bytes(4) > 200 and raised.per_trial > model.per_trial
    assert raised.bytes(2) <= 200  # the halves fit again
    already = MemoryModel(base=300, per_trial=10)
    assert already.after_oom(4, 200) is already


def test_memory_model_from_probe() -> None:
    assert MemoryModel.from_probe(150, 200) == MemoryModel(base=100, per_trial=50)
    assert MemoryModel.from_probe(150, 140) == MemoryModel(base=150, per_trial=0)


@given(
    base=st.integers(0, 10**9),
    per_trial=st.integers(0, 10**9),
    k=st.integers(1, 64),
    target=st.integers(0, 10**11),
)
def test_memory_model_properties(base: int, per_trial: int, k: int, target: int) -> None:
    model = MemoryModel(base, per_trial)
    corrected = model.corrected(k, target)
    assert corrected.bytes(k) >= target and corrected.per_trial >= per_trial
    assert corrected.base == base
    oom = model.after_oom(k, target)
    assert oom.bytes(k) > target and oom.per_trial >= per_trial
    fit = model.max_fit(target, 64)
    assert fit == 0 or model.bytes(fit) <= target
    assert fit == 64 or model.bytes(fit + 1) > target


@pytest.mark.parametrize(
    ("table", "cap", "expected"),
    [
        ({}, None, 2),
        ({}, 1, 1),
        ({1: 100.0}, None, 2),  # the only entry: explore
        ({1: 100.0, 2: 150.0}, None, 4),  # gained: explore further
        ({1: 100.0, 2: 150.0, 4: 200.0}, None, 8),
        ({1: 100.0, 2: 150.0, 4: 160.0}, None, 2),  # +6.7 %: stop
        ({1: 100.0, 2: 110.0}, None, 4),  # exactly +10 % counts as a gain
        ({1: 100.0, 2: 109.0}, None, 1),
        ({1: 100.0, 2: 80.0, 4: 90.0}, None, 1),  # k=1 is best
        ({1: 100.0, 2: 150.0, 4: 300.0}, 4, 4),  # capped by max_pack_size
        ({1: 100.0, 2: 150.0, 8: 400.0}, None, 16),  # rising at its largest: explore
        ({2: 100.0, 4: 200.0}, None, 8),
        # the whole curve: a dip at 2 does not hide a much faster 4 (the doubling walk
        # stopped at the dip and kept 1); 8 gains too little over 4 to be worth it
        ({1: 100.0, 2: 95.0, 4: 300.0, 8: 320.0}, None, 4),
        ({1: 100.0, 2: 95.0, 4: 300.0, 8: 320.0, 16: 500.0}, 8, 8),
    ],
)
def test_best_array_size(table: dict[int, float], cap: int | None, expected: int) -> None:
    assert best_array_size(table, cap) == expected


def test_the_execution_curve_takes_the_faster_way_at_each_size() -> None:
    alone = {1: 100.0, 2: 180.0, 4: 300.0, 8: 320.0}
    assert execution_curve(alone, {}) == alone
    at_once = {1: 350.0, 8: 600.0, 16: 610.0}  # singles side by side; two arrays of 8, of 16
    assert execution_curve(alone, at_once) == {
        1: 350.0, 2: 180.0, 4: 300.0, 8: 600.0, 16: 610.0
    }  # fmt: skip
    assert list(execution_curve(alone, at_once)) == [1, 2, 4, 8, 16]


@pytest.mark.parametrize(
    ("alone", "at_once", "cap", "expected"),
    [
        # nothing measured, or the curve still rising at its end: no cut (None), or the cap
        ({}, {}, None, None),
        ({1: 100.0, 2: 190.0}, {}, None, None),
        ({1: 100.0, 2: 190.0}, {}, 6, 6),
        ({1: 100.0, 2: 190.0}, {4: 400.0}, None, None),
        # larger sizes measured slower (by 10% or more): cut at the best
        ({1: 100.0, 2: 190.0, 4: 350.0, 8: 300.0}, {}, None, 4),
        ({1: 100.0, 2: 190.0, 4: 350.0, 8: 300.0}, {}, 2, 2),
        # ... flat past the best (not 10% faster, nor slower): no cut
        ({1: 100.0, 2: 190.0, 4: 350.0, 8: 340.0}, {}, None, None),
        # at once slower than alone: the alone curve decides
        ({1: 100.0, 2: 190.0, 4: 350.0, 8: 300.0}, {4: 200.0}, None, 4),
        # a vmapped CNN on a GPU, peaking alone at 4: one-trial arrays side by side beat it
        ({1: 100.0, 2: 120.0, 4: 150.0, 8: 130.0}, {1: 330.0, 2: 290.0}, None, 1),
        # ... arrays at once faster only past the peak alone: the peak
        ({1: 100.0, 2: 120.0, 4: 150.0, 8: 130.0}, {8: 600.0}, None, 4),
        # arrays at once faster, but one array alone still rising: no cut
        ({1: 100.0, 2: 120.0, 4: 150.0, 8: 180.0}, {1: 330.0}, None, None),
        # a CPU, one core per array: flat past 8 alone, two of 16 at once as fast as two of
        # 32: no cut (the worker halves a large array for its two threads)
        ({1: 8e3, 2: 14e3, 4: 20e3, 8: 24e3, 16: 26e3, 32: 25e3}, {16: 40e3, 32: 41e3}, None, None),
    ],
)
def test_the_planned_size_comes_from_both_curves(
    alone: dict[int, float], at_once: dict[int, float], cap: int | None, expected: int | None
) -> None:
    assert planned_array_size(alone, at_once, cap) == expected


def test_arrays_of_a_group_not_cut_by_measurement_share_a_number_in_their_pack() -> None:
    """Keys in ``whole`` were cut only to spread and fit: in one pack, one array."""
    ready = units("a", range(10)) + units("b", range(10, 16)) + units("a", range(16, 20), 1, 3)
    sizes = {"a": 4, "b": 4}
    (pack,) = plan_packs(ready, [GPU], {}, sizes, default_memory=MemoryModel(0, MiB)).packs
    trained: dict[int, list[PlannedArray]] = {}
    for n, array in zip(array_numbers(pack, {"a"}), pack.arrays, strict=True):
        trained.setdefault(n, []).append(array)
    # a's span 0-1, cut 4 + 3 + 3, is one array; its span 1-3 another; b (cut by
    # measurement) 3 and 3 apart
    assert sorted(
        (group[0].fusion_key, group[0].from_resource, sum(len(a.units) for a in group))
        for group in trained.values()
    ) == [("a", 0.0, 10), ("a", 1.0, 4), ("b", 0.0, 3), ("b", 0.0, 3)]
    assert array_numbers(pack, set()) == list(range(len(pack.arrays)))


def test_best_array_size_rejects_a_bad_cap() -> None:
    with pytest.raises(ValueError):
        best_array_size({}, 0)


def test_split_in_two() -> None:
    five = units("a", range(5))
    first, second = split_in_two(five)
    assert first == five[:3] and second == five[3:]
    with pytest.raises(ValueError):
        split_in_two(five[:1])


def test_groups_by_key_and_resource_span() -> None:
    ready = (
        units("b", range(0, 3), 0, 1)
        + units("a", range(3, 5), 0, 1)
        + units("a", range(5, 7), 1, 3)  # same key, promoted: another group
    )
    plan = plan_packs(ready[::-1], [GPU], {}, {"a": 8, "b": 8}, default_memory=MemoryModel(0, MiB))
    (pack,) = plan.packs
    groups = sorted(
        (array.fusion_key, array.from_resource, [u.trial_id for u in array.units])
        for array in pack.arrays
    )
    assert groups == [("a", 0, [3, 4]), ("a", 1, [5, 6]), ("b", 0, [0, 1, 2])]
    for array in pack.arrays:
        assert {unit.group for unit in array.units} == {
            (array.fusion_key, array.from_resource, array.to_resource)
        }


def test_array_size_defaults_to_one_and_is_capped() -> None:
    ready = units("a", range(10)) + units("b", range(10, 13))
    model = MemoryModel(0, MiB)
    plan = plan_packs(ready, [GPU], {}, {"a": 4}, default_memory=model)
    a_sizes = sorted(len(x.units) for p in plan.packs for x in p.arrays if x.fusion_key == "a")
    b_sizes = [len(x.units) for p in plan.packs for x in p.arrays if x.fusion_key == "b"]
    assert a_sizes == [3, 3, 4] and b_sizes == [1, 1, 1]  # balanced: not 4, 4, 2

    capped = plan_packs(ready, [GPU], {}, {"a": 4}, default_memory=model, max_pack_size=3)
    assert all(len(pack.units) <= 3 for pack in capped.packs)
    capped_a = [len(x.units) for p in capped.packs for x in p.arrays if x.fusion_key == "a"]
    assert sorted(capped_a) == [2, 2, 3, 3]
    assert sorted(u.trial_id for u in placed(capped)) == list(range(13))


def test_a_table_that_prefers_one_gives_one_trial_arrays() -> None:
    size = best_array_size({1: 100.0, 2: 80.0, 4: 90.0}, None)
    plan = plan_packs(units("a", range(4)), [GPU], {"a": SMALL}, {"a": size}, default_memory=SMALL)
    assert [len(array.units) for pack in plan.packs for array in pack.arrays] == [1, 1, 1, 1]
    assert not plan.deferred and not plan.unplaceable


def test_first_fit_decreasing_fills_packs() -> None:
    big = MemoryModel(base=400 * MiB, per_trial=100 * MiB)  # k=1: 500 MiB
    small = MemoryModel(base=0, per_trial=100 * MiB)  # k=1: 100 MiB
    ready = units("big", range(0, 2)) + units("small", range(2, 8))
    two = [Device("gpu0", 1000 * MiB), Device("gpu1", 1000 * MiB)]  # 900 MiB each
    plan = plan_packs(
        ready, two, {"big": big, "small": small}, {"big": 1, "small": 2}, default_memory=small
    )
    # Arrays: big 500, big 500, small 200 x3. FFD: big->gpu0, big->gpu1 (most room on
    # a tie goes to the first), smalls fill gpu0 (400 left: two of them), then gpu1.
    assert [pack.device for pack in plan.packs] == ["gpu0", "gpu1"]
    assert [pack.estimated_bytes // MiB for pack in plan.packs] == [900, 700]
    assert [[len(a.units) for a in pack.arrays] for pack in plan.packs] == [[1, 2, 2], [1, 2]]
    assert not plan.deferred and not plan.unplaceable


def test_new_pack_goes_to_the_roomiest_device() -> None:
    devices = [Device("small", 200 * MiB), Device("large", 2000 * MiB)]
    plan = plan_packs(units("a", range(1)), devices, {}, {}, default_memory=SMALL)
    assert [pack.device for pack in plan.packs] == ["large"]


def test_oversized_arrays_shrink_to_fit() -> None:
    # k=8 would need 100 + 8 * 150 = 1300 MiB; 900 MiB holds k <= 5.
    model = MemoryModel(base=100 * MiB, per_trial=150 * MiB)
    plan = plan_packs(units("a", range(8)), [GPU], {"a": model}, {"a": 8}, default_memory=model)
    arrays = [array for pack in plan.packs for array in pack.arrays]
    assert [len(array.units) for array in arrays] == [5]
    assert arrays[0].estimated_bytes == model.bytes(5) <= GPU.capacity
    assert [unit.trial_id for unit in plan.deferred] == [5, 6, 7]


def test_arrays_limited_by_memory_are_as_large_as_fit_not_balanced() -> None:
    """Balanced cuts would leave fewer units on the device now (two arrays of 4 do not fit
    where one of 5 does); where memory limits an array, the rest waits for the next plan."""
    model = MemoryModel(base=0, per_trial=150 * MiB)  # 900 MiB: 6 trials
    plan = plan_packs(units("a", range(8)), [GPU], {"a": model}, {"a": 8}, default_memory=model)
    assert [len(array.units) for pack in plan.packs for array in pack.arrays] == [6]
    assert [unit.trial_id for unit in plan.deferred] == [6, 7]


@given(st.integers(0, 60), st.integers(1, 20))
def test_balanced_chunks(n: int, limit: int) -> None:
    chunks = balanced_chunks(range(n), limit)
    assert [i for chunk in chunks for i in chunk] == list(range(n))  # all, in order
    assert len(chunks) == -(-n // limit)  # the fewest
    sizes = [len(chunk) for chunk in chunks]
    assert all(1 <= size <= limit for size in sizes)
    assert sizes == sorted(sizes, reverse=True) and (not sizes or sizes[0] - sizes[-1] <= 1)


def test_balanced_chunks_examples() -> None:
    assert [len(c) for c in balanced_chunks(range(17), 4)] == [4, 4, 3, 3, 3]
    assert [len(c) for c in balanced_chunks(range(20), 8)] == [7, 7, 6]
    assert [len(c) for c in balanced_chunks(range(8), 8)] == [8]
    with pytest.raises(ValueError, match="limit"):
        balanced_chunks(range(3), 0)


def test_a_unit_that_fits_nowhere_is_unplaceable() -> None:
    huge = MemoryModel(base=2000 * MiB, per_trial=MiB)
    ready = units("huge", range(2)) + units("ok", range(2, 4))
    plan = plan_packs(ready, [GPU], {"huge": huge}, {"huge": 2}, default_memory=SMALL)
    assert [unit.trial_id for unit in plan.unplaceable] == [0, 1]
    assert sorted(unit.trial_id for unit in placed(plan)) == [2, 3]


@pytest.mark.parametrize("spill", [False, True])
def test_a_unit_that_fits_only_a_busy_device_waits_for_it(spill: bool) -> None:
    """The 900 MiB device is free; a live 4 GiB one has no slot open now (not given). A unit
    of 2 GiB waits for the large one: neither unplaceable (its trials would be failed) nor
    spilled through the small one; one too large for both is still unplaceable (or spilled)."""
    huge = MemoryModel(base=2000 * MiB, per_trial=MiB)
    giant = MemoryModel(base=9000 * MiB, per_trial=MiB)
    ready = units("huge", range(2)) + units("giant", range(2, 3)) + units("ok", range(3, 5))
    big = Device("big", 4096 * MiB)
    plan = plan_packs(
        ready, [GPU], {"huge": huge, "giant": giant}, {"huge": 2}, default_memory=SMALL,
        spill=spill, largest_live=big.capacity,
    )  # fmt: skip
    assert {0, 1} <= {unit.trial_id for unit in plan.deferred}
    spilled = [u.trial_id for p in plan.packs for a in p.arrays if a.spilled for u in a.units]
    assert ([u.trial_id for u in plan.unplaceable], spilled) == (([], [2]) if spill else ([2], []))
    if not spill:  # (the spilled array takes the small device whole)
        assert sorted(u.trial_id for u in placed(plan)) == [3, 4]


def test_with_spill_a_unit_that_fits_nowhere_takes_a_device_or_alternates() -> None:
    huge = MemoryModel(base=2000 * MiB, per_trial=MiB)
    other = Device("other", 1024 * MiB)
    ready = units("huge", range(3)) + units("ok", range(3, 5))
    plan = plan_packs(
        ready, [GPU, other], {"huge": huge}, {"huge": 2}, default_memory=SMALL, spill=True
    )
    assert plan.unplaceable == []
    # the largest arrays first: two spilled units take a device each, whole; the third
    # joins the first device's pack to alternate with its unit; the small units wait for
    # a later plan (no device has room left)
    assert [(pack.device, [u.trial_id for u in pack.units]) for pack in plan.packs] == [
        ("other", [0, 2]),
        ("gpu0", [1]),  # the roomiest device first
    ]
    assert all(pack.spilled and all(len(a.units) == 1 for a in pack.arrays)
               for pack in plan.packs)  # fmt: skip
    assert plan.packs[0].arrays[0].estimated_bytes == huge.bytes(1)
    assert [unit.trial_id for unit in plan.deferred] == [3, 4]
    alone = plan_packs(ready[:3], [GPU], {"huge": huge}, {"huge": 2}, default_memory=SMALL,
                       spill=True)  # fmt: skip
    assert [[u.trial_id for u in p.units] for p in alone.packs] == [[0, 1]]  # SPILL_ALTERNATE
    assert [u.trial_id for u in alone.deferred] == [2]
    again = plan_packs(
        ready, [GPU, other], {"huge": huge}, {"huge": 2}, default_memory=SMALL, spill=False
    )
    assert [unit.trial_id for unit in again.unplaceable] == [0, 1, 2]


def test_deferral_under_max_packs_per_device() -> None:
    ready = units("a", range(6))
    plan = plan_packs(
        ready,
        [GPU],
        {},
        {"a": 2},
        default_memory=SMALL,
        max_pack_size=2,
        max_packs_per_device=2,
    )
    assert len(plan.packs) == 2
    assert [unit.trial_id for unit in placed(plan)] == [0, 1, 2, 3]
    assert [unit.trial_id for unit in plan.deferred] == [4, 5]
    assert plan.unplaceable == []


def test_no_devices_defers_everything() -> None:
    plan = plan_packs(units("a", range(3)), [], {}, {}, default_memory=SMALL)
    assert plan.packs == [] and plan.unplaceable == []
    assert [unit.trial_id for unit in plan.deferred] == [0, 1, 2]


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="one ready unit"):
        plan_packs(units("a", range(2)) * 2, [GPU], {}, {}, default_memory=SMALL)
    with pytest.raises(ValueError, match="unique"):
        plan_packs([], [GPU, GPU], {}, {}, default_memory=SMALL)
    with pytest.raises(ValueError, match="max_pack_size"):
        plan_packs([], [GPU], {}, {}, default_memory=SMALL, max_pack_size=0)


@st.composite
def planner_inputs(draw: st.DrawFn) -> dict:
    keys = draw(st.lists(st.sampled_from("abcde"), min_size=1, max_size=5, unique=True))
    spans = [(0.0, 1.0), (1.0, 3.0), (3.0, 9.0)]
    trial_ids = draw(st.lists(st.integers(0, 10**6), max_size=60, unique=True))
    ready = [
        Unit(trial, draw(st.sampled_from(keys)), *draw(st.sampled_from(spans)))
        for trial in trial_ids
    ]
    model = st.builds(MemoryModel, st.integers(0, 800), st.integers(0, 300))
    devices = [
        Device(f"gpu{i}", free)
        for i, free in enumerate(draw(st.lists(st.integers(0, 2000), max_size=4)))
    ]
    return {
        "units": ready,
        "devices": devices,
        "memory": draw(st.dictionaries(st.sampled_from(keys), model)),
        "array_size": draw(st.dictionaries(st.sampled_from(keys), st.integers(1, 16))),
        "default_memory": draw(model),
        "max_pack_size": draw(st.none() | st.integers(1, 12)),
        "max_packs_per_device": draw(st.none() | st.integers(1, 3)),
        "spill": draw(st.booleans()),
    }


@given(planner_inputs())
def test_plan_properties(inputs: dict) -> None:
    plan = plan_packs(**inputs)
    everything = placed(plan) + plan.deferred + plan.unplaceable
    assert Counter(everything) == Counter(inputs["units"])
    capacity = {device.name: device.capacity for device in inputs["devices"]}
    used: Counter[str] = Counter()
    packs_on: Counter[str] = Counter()
    largest = max(capacity.values(), default=None)
    for pack in plan.packs:
        assert pack.arrays
        if pack.spilled:  # alone on its device, or alternating with other spilled units
            assert inputs["spill"] and 1 <= len(pack.arrays) <= SPILL_ALTERNATE
            for array in pack.arrays:
                assert array.spilled and len(array.units) == 1
                model = inputs["memory"].get(array.fusion_key, inputs["default_memory"])
                assert largest is not None and array.estimated_bytes == model.bytes(1) > largest
            assert [p.device for p in plan.packs].count(pack.device) == 1
            continue
        assert pack.estimated_bytes <= capacity[pack.device]
        used[pack.device] += pack.estimated_bytes
        packs_on[pack.device] += 1
        if inputs["max_pack_size"] is not None:
            assert len(pack.units) <= inputs["max_pack_size"]
        for array in pack.arrays:
            assert {unit.group for unit in array.units} == {
                (array.fusion_key, array.from_resource, array.to_resource)
            }
            model = inputs["memory"].get(array.fusion_key, inputs["default_memory"])
            assert array.estimated_bytes == model.bytes(len(array.units))
            assert len(array.units) <= max(1, inputs["array_size"].get(array.fusion_key, 1))
    for name, total in used.items():
        assert total <= capacity[name]
    if inputs["max_packs_per_device"] is not None:
        assert all(count <= inputs["max_packs_per_device"] for count in packs_on.values())
    assert not (inputs["spill"] and plan.unplaceable)
    for unit in plan.unplaceable:
        model = inputs["memory"].get(unit.fusion_key, inputs["default_memory"])
        assert largest is not None and model.bytes(1) > largest
    # Deterministic, whatever order the units arrive in.
    assert plan_packs(**{**inputs, "units": inputs["units"][::-1]}) == plan


def test_segments_of_one_trial_are_units_of_their_own() -> None:
    """Two segments of a trial are two units (their lanes apart: two arrays); one segment
    twice is refused like a trial twice."""
    ready = [Unit(t, "a", 0, 1, f"lane|segment {j}", segment=j) for t in (1, 2) for j in (0, 1)]
    plan = plan_packs(ready, [GPU], {}, {"a": 8}, default_memory=MemoryModel(0, MiB))
    (pack,) = plan.packs
    assert sorted((a.units[0].segment, [u.trial_id for u in a.units]) for a in pack.arrays) == [
        (0, [1, 2]), (1, [1, 2])]  # fmt: skip
    with pytest.raises(ValueError, match="only one ready unit"):
        plan_packs([*ready, ready[0]], [GPU], {}, {}, default_memory=SMALL)


@given(
    sizes=st.lists(st.integers(1, 80), min_size=1, max_size=6),
    threads=st.integers(1, 8),
    min_part=st.integers(1, 20),
)
def test_arrays_are_cut_in_halves_while_threads_are_left_and_parts_stay_large(
    sizes: list[int], threads: int, min_part: int
) -> None:
    arrays = [[(i, j) for j in range(n)] for i, n in enumerate(sizes)]
    parts = split_for_threads(arrays, threads, min_part)
    # every member once, in order; each part from one array
    assert [m for p in parts for m in p] == [m for a in arrays for m in a]
    assert all(len({i for i, _ in p}) == 1 for p in parts)
    # a part that is not a whole array is at least min_part, and halves differ by one at most
    for p in parts:
        if len(p) != sizes[p[0][0]]:
            assert len(p) >= min_part
    # it stops with every thread used, or nothing left worth cutting, never past the threads
    assert len(parts) >= len(arrays)
    assert len(parts) == len(arrays) or len(parts) <= threads
    assert len(parts) >= threads or max(len(p) for p in parts) < 2 * min_part


def test_a_large_array_is_cut_into_as_many_parts_as_threads() -> None:
    assert [len(p) for p in split_for_threads([list(range(64))], 4, 16)] == [16, 16, 16, 16]
    assert [len(p) for p in split_for_threads([list(range(33)), [0] * 5], 2, 16)] == [33, 5]
    assert [len(p) for p in split_for_threads([list(range(33)), [0] * 5], 3, 16)] == [17, 16, 5]
    assert [len(p) for p in split_for_threads([list(range(31))], 2, 16)] == [31]
