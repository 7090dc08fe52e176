"""The shard planner of spilled training: consecutive layers, each shard within half the
budget left, the fewest shards."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from packtune.spilling import Unspillable, plan_shards


def test_cuts_where_the_next_layer_would_overflow_half_the_budget() -> None:
    assert plan_shards([3, 3, 3, 3, 3], budget=12) == [range(0, 2), range(2, 4), range(4, 5)]
    assert plan_shards([1, 1, 1], budget=100) == [range(0, 3)]
    # the reserve (batch, kept activations) comes off the budget first
    assert plan_shards([3, 3, 3], budget=14, reserved=2) == [range(0, 2), range(2, 3)]


def test_a_layer_larger_than_half_the_budget_cannot_be_spilled() -> None:
    with pytest.raises(Unspillable, match="layer 1 would take 9 bytes"):
        plan_shards([2, 9, 2], budget=16)
    with pytest.raises(Unspillable, match="layer 0"):
        plan_shards([1], budget=10, reserved=10)
    with pytest.raises(ValueError, match="at least one layer"):
        plan_shards([], budget=10)


@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=40),
    st.integers(1, 400),
    st.integers(0, 100),
)
def test_shards_cover_the_chain_in_order_within_the_limit_and_are_fewest(
    costs: list[int], budget: int, reserved: int
) -> None:
    limit = (budget - reserved) // 2
    if max(costs) > limit:
        with pytest.raises(Unspillable):
            plan_shards(costs, budget, reserved)
        return
    shards = plan_shards(costs, budget, reserved)
    assert [i for shard in shards for i in shard] == list(range(len(costs)))
    assert all(len(shard) > 0 for shard in shards)
    assert all(sum(costs[i] for i in shard) <= limit for shard in shards)
    # fewest: no two neighbouring shards could have been one
    for a, b in zip(shards, shards[1:], strict=False):
        assert sum(costs[i] for i in a) + costs[b.start] > limit
