"""Hyperband's bracket arithmetic and rung promotion, against the checks in docs/design.md."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from packtune.hyperband import (
    Rung,
    bracket_s,
    next_stop,
    plan_brackets,
    promote,
    rank,
    rung_resources,
    s_max,
    total_trials,
    total_units,
)


def shape(brackets: list[list[Rung]]) -> list[tuple[int, float]]:
    return [(bracket[0].n, bracket[0].resource) for bracket in brackets]


def sizes(brackets: list[list[Rung]]) -> list[list[int]]:
    return [[rung.n for rung in bracket] for bracket in brackets]


def test_r81_eta3() -> None:
    brackets = plan_brackets(81, eta=3)
    assert shape(brackets) == [(81, 1), (34, 3), (15, 9), (8, 27), (5, 81)]
    assert sizes(brackets) == [[81, 27, 9, 3, 1], [34, 11, 3, 1], [15, 5, 1], [8, 2], [5]]
    assert [[rung.resource for rung in bracket] for bracket in brackets] == [
        [1, 3, 9, 27, 81],
        [3, 9, 27, 81],
        [9, 27, 81],
        [27, 81],
        [81],
    ]
    assert total_trials(brackets) == 143
    assert total_units(brackets) == 121 + 49 + 21 + 10 + 5


def test_r8_eta2() -> None:
    brackets = plan_brackets(8, eta=2)
    assert shape(brackets) == [(8, 1), (6, 2), (4, 4), (4, 8)]
    assert sizes(brackets) == [[8, 4, 2, 1], [6, 3, 1], [4, 2], [4]]


def test_r27_eta3() -> None:
    brackets = plan_brackets(27)
    assert [bracket[0].n for bracket in brackets] == [27, 12, 6, 4]
    assert total_trials(brackets) == 49


def test_single_bracket_when_max_equals_min() -> None:
    assert plan_brackets(5, eta=3, min_resource=5) == [[Rung(1, 5.0)]]


@pytest.mark.parametrize(
    ("max_resource", "eta", "min_resource", "expected"),
    [
        (243, 3, 1, 5),  # floor(log(243, 3)) is 4 in floating point
        (242, 3, 1, 4),
        (1000, 10, 1, 3),  # log10(1000) is 2.9999999999999996
        (999, 10, 1, 2),
        (81, 3, 3, 3),
        (80, 3, 3, 2),
        (1, 3, 1, 0),
        (2, 3, 1, 0),
        (0.9, 3, 0.1, 2),  # as decimals: in binary, 9 * 0.1 > 0.9
        (0.3, 3, 0.1, 1),
        (0.75, 3, 0.25, 1),
        (2**60, 2, 1, 60),
    ],
)
def test_s_max(max_resource: float, eta: int, min_resource: float, expected: int) -> None:
    assert s_max(max_resource, eta, min_resource) == expected


def test_float_resources_are_read_as_decimals() -> None:
    assert Fraction(0.1) * 9 > Fraction(0.9)  # what binary arithmetic would decide
    brackets = plan_brackets(0.9, eta=3, min_resource=0.1)
    assert [[rung.resource for rung in bracket] for bracket in brackets] == [
        [0.1, 0.3, 0.9],
        [0.3, 0.9],
        [0.9],
    ]


def test_min_resource_sets_the_first_rung() -> None:
    brackets = plan_brackets(81, eta=3, min_resource=3)
    assert shape(brackets) == [(27, 3), (12, 9), (6, 27), (4, 81)]


def test_bracket_s() -> None:
    brackets = plan_brackets(81)
    assert [bracket_s(brackets, j) for j in range(len(brackets))] == [4, 3, 2, 1, 0]
    with pytest.raises(IndexError):
        bracket_s(brackets, 5)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_resource": 81, "eta": 1}, "eta"),
        ({"max_resource": 81, "eta": 2.5}, "eta"),
        ({"max_resource": 81, "eta": True}, "eta"),
        ({"max_resource": 81, "min_resource": 0}, "min_resource"),
        ({"max_resource": 81, "min_resource": -1}, "min_resource"),
        ({"max_resource": 81, "min_resource": math.nan}, "min_resource"),
        ({"max_resource": math.inf}, "max_resource"),
        ({"max_resource": 0}, "max_resource"),
        ({"max_resource": "81"}, "max_resource"),
        ({"max_resource": 2, "min_resource": 3}, "max_resource"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], name: str) -> None:
    for function in (s_max, plan_brackets):
        with pytest.raises(ValueError, match=name):
            function(**kwargs)


settings_eta = st.integers(2, 6)


@st.composite
def hyperband_settings(draw: st.DrawFn) -> tuple[float, int, float]:
    eta = draw(settings_eta)
    min_resource = draw(st.sampled_from([1, 2, 0.5, 0.1, 3]))
    max_resource = draw(
        st.one_of(
            st.integers(1, 5000).map(lambda factor: factor * min_resource),
            st.floats(min_resource, 5000.0),
        )
    )
    return max_resource, eta, min_resource


@given(hyperband_settings())
def test_bracket_properties(settings: tuple[float, int, float]) -> None:
    max_resource, eta, min_resource = settings
    top = s_max(max_resource, eta, min_resource)
    low, high = Fraction(repr(min_resource)), Fraction(repr(max_resource))
    assert eta**top * low <= high < eta ** (top + 1) * low
    brackets = plan_brackets(max_resource, eta, min_resource)
    assert len(brackets) == top + 1
    expected_n = []
    for j, bracket in enumerate(brackets):
        s = top - j
        assert len(bracket) == s + 1
        n = math.ceil(Fraction((top + 1) * eta**s, s + 1))
        expected_n.append(n)
        assert [rung.n for rung in bracket] == [n // eta**i for i in range(s + 1)]
        assert bracket[-1].resource == max_resource
        assert bracket[0].resource >= min_resource * (1 - 1e-12)
        for lower, upper in zip(bracket, bracket[1:], strict=False):
            assert upper.n <= lower.n
            assert upper.resource <= max_resource
            assert upper.resource == pytest.approx(lower.resource * eta, rel=1e-12)
        assert all(rung.n >= 1 for rung in bracket)
    assert total_trials(brackets) == sum(expected_n)


def test_rank_orders_by_value_then_id_with_non_finite_last() -> None:
    results = [(5, 0.3), (2, None), (3, 0.1), (1, 0.3), (4, math.nan), (0, math.inf), (6, -1.0)]
    assert rank(results, "min") == [6, 3, 1, 5, 0, 2, 4]
    assert rank(results, "max") == [1, 5, 3, 6, 0, 2, 4]


def test_rank_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="mode"):
        rank([(1, 0.0)], "minimize")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="more than once"):
        rank([(1, 0.0), (1, 0.5)], "min")


def test_promote_keeps_the_best_third() -> None:
    results = [(trial, float(10 - trial)) for trial in range(10)]
    assert promote(results, 3, "min") == [9, 8, 7]
    assert promote(results, 3, "max") == [0, 1, 2]
    assert promote(results[:2], 3, "min") == []


def test_a_rung_left_short_keeps_its_planned_third() -> None:
    """Two trials of a rung planned for 3 (eta 3): the plan keeps floor(3 / 3) = 1, not
    floor(2 / 3) = 0; never more than it has."""
    results = [(1, 0.4), (2, 0.3)]
    assert promote(results, 3, "min") == []
    assert promote(results, 3, "min", planned=3) == [2]
    assert promote(results, 3, "min", planned=9) == [2, 1]


def test_promote_never_takes_a_diverged_trial() -> None:
    results = [(1, 0.5), (2, math.nan), (3, None), (4, math.inf), (5, -math.inf), (6, None)]
    assert promote(results, 2, "min") == [1]
    assert promote(results, 3, "max") == [1]
    with pytest.raises(ValueError, match="eta"):
        promote(results, 1, "min")


metric = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.0, 0.5]),  # ties
)
rung_results = st.lists(
    st.tuples(st.integers(0, 10**6), metric), max_size=60, unique_by=lambda r: r[0]
)


@given(rung_results, settings_eta, st.sampled_from(["min", "max"]))
def test_promote_properties(results: list[tuple[int, float | None]], eta: int, mode: Any) -> None:
    promoted = promote(results, eta, mode)
    values = dict(results)
    finite = [
        (trial, value) for trial, value in results if value is not None and math.isfinite(value)
    ]
    assert len(promoted) == min(len(results) // eta, len(finite))
    assert len(set(promoted)) == len(promoted)
    sign = 1 if mode == "min" else -1
    best = sorted(finite, key=lambda r: (sign * r[1], r[0]))
    assert promoted == [trial for trial, _ in best[: len(promoted)]]
    assert all(math.isfinite(values[trial]) for trial in promoted)  # type: ignore[arg-type]


@given(rung_results)
def test_max_mirrors_min_on_negated_values(results: list[tuple[int, float | None]]) -> None:
    negated = [(trial, None if value is None else -value) for trial, value in results]
    assert rank(results, "max") == rank(negated, "min")
    assert rank(results, "min") == rank(negated, "max")
    assert sorted(rank(results, "min")) == sorted(trial for trial, _ in results)


def test_rung_resources_are_the_common_grid_of_every_bracket() -> None:
    assert rung_resources(plan_brackets(27, eta=3)) == (1.0, 3.0, 9.0, 27.0)
    assert rung_resources(plan_brackets(8, eta=2)) == (1.0, 2.0, 4.0, 8.0)
    assert rung_resources(plan_brackets(0.9, eta=3, min_resource=0.1)) == pytest.approx(
        (0.1, 0.3, 0.9)
    )


def test_next_stop_cuts_a_unit_at_every_rung_on_its_way() -> None:
    stops = rung_resources(plan_brackets(27, eta=3))
    # a bracket-0 trial (0 -> 27) trains in the spans of bracket 3's rungs
    segments, done = [], 0.0
    while done < 27:
        end = next_stop(stops, done, 27.0)
        segments.append((done, end))
        done = end
    assert segments == [(0, 1), (1, 3), (3, 9), (9, 27)]
    assert next_stop(stops, 3.0, 9.0) == 9.0  # already one span
    assert next_stop(stops, 1.0 + 1e-13, 9.0) == 3.0  # a resource read back with rounding
    assert next_stop(stops, 27.0, 81.0) == 81.0  # beyond the grid: the whole span
    assert next_stop((2.0, 4.0), 0.0, 1.5) == 1.5  # never past the target
    with pytest.raises(ValueError, match="nothing to train"):
        next_stop(stops, 9.0, 9.0)
