"""ASHA's promotion rule as a pure function (packtune.asha)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from packtune.asha import known_prefix, promotion_order, promotions
from packtune.hyperband import promote

values = st.one_of(st.none(), st.floats(-1e6, 1e6), st.just(math.nan), st.just(math.inf))


def brute_force(results: list[tuple[int, float | None]], eta: int) -> set[int]:
    """The definition: the union over m of the best floor(m / eta) of the first m."""
    out: set[int] = set()
    for m in range(1, len(results) + 1):
        out |= set(promote(results[:m], eta, "min"))
    return out


@given(raw=st.lists(values, max_size=60), eta=st.integers(2, 5))
@settings(max_examples=200, deadline=None)
def test_promotions_are_the_union_of_every_prefix_s_top(raw: list[float | None], eta: int) -> None:
    results = list(enumerate(raw))
    got = promotions(results, eta, "min")
    assert got == brute_force(results, eta)
    finite = {i for i, v in results if v is not None and math.isfinite(v)}
    assert got <= finite  # a diverged or failed trial is never promoted
    # at least what synchronous halving over the whole rung keeps (when enough are finite)
    assert set(promote(results, eta, "min")) <= got
    # decisions only grow as results arrive
    for m in range(len(results)):
        assert promotions(results[:m], eta, "min") <= got


@given(raw=st.lists(values, max_size=60), eta=st.integers(2, 5), cut=st.integers(0, 60))
@settings(max_examples=200, deadline=None)
def test_the_promotion_order_only_grows_as_more_of_a_rung_is_known(
    raw: list[float | None], eta: int, cut: int
) -> None:
    """The next rung reads its results in this order: a longer known prefix of this rung
    appends to it, never puts a trial before one already there; each trial once, as the
    promotions' set."""
    results = list(enumerate(raw))
    full = promotion_order(results, eta, "min")
    assert full[: len(promotion_order(results[:cut], eta, "min"))] == promotion_order(
        results[:cut], eta, "min"
    )
    assert len(full) == len(set(full)) and set(full) == promotions(results, eta, "min")


@given(raw=st.lists(st.floats(-1e3, 1e3), max_size=40), eta=st.integers(2, 4))
@settings(max_examples=100, deadline=None)
def test_maximising_is_minimising_the_negation(raw: list[float], eta: int) -> None:
    results = list(enumerate(raw))
    negated = [(i, -v) for i, v in results]
    assert promotions(results, eta, "max") == promotions(negated, eta, "min")


def test_an_early_trial_is_promoted_before_the_rung_is_full() -> None:
    # after 3 results (eta 3) the best of them goes on, whatever comes later
    assert promotions([(10, 0.5), (11, 0.9), (12, 0.7)], 3, "min") == {10}
    later = [(10, 0.5), (11, 0.9), (12, 0.7), (13, 0.1), (14, 0.2), (15, 0.3)]
    assert promotions(later, 3, "min") == {10, 13, 14}  # 10 stays promoted ("mistaken")


def test_the_known_prefix_stops_at_the_first_result_still_to_come() -> None:
    rows = [(1, 0.3, True), (2, None, True), (3, None, False), (4, 0.1, True)]
    assert known_prefix(rows) == [(1, 0.3), (2, None)]


@settings(max_examples=200, deadline=None)
@given(
    max_resource=st.sampled_from([1, 3, 9, 27, 81]),
    eta=st.integers(2, 4),
    asha=st.booleans(),
    iterations=st.integers(1, 6),
    max_trials=st.none() | st.integers(1, 600),
)
def test_planned_units_are_those_of_the_brackets_the_budget_starts(
    max_resource: int, eta: int, asha: bool, iterations: int, max_trials: int | None
) -> None:
    """The progress bar's total: every bracket (or ASHA batch) that ``max_trials`` lets start,
    counted by whole iterations then the last one's brackets, as walking every slot would."""
    from packtune.hyperband import plan_brackets
    from packtune.iterations import asha_ladder, asha_slots, planned_units, slots

    brackets = plan_brackets(max_resource, eta, 1)
    if asha:
        walked = sum(sum(r.n for r in asha_ladder(brackets, eta, slot.n))
                     for slot in asha_slots(brackets, iterations, max_trials))  # fmt: skip
    else:
        units = {len(brackets) - 1 - j: sum(r.n for r in rungs) for j, rungs in enumerate(brackets)}
        walked = sum(units[slot.s] for slot in slots(brackets, iterations, max_trials))
    assert planned_units(brackets, eta, asha, iterations, max_trials) == walked
