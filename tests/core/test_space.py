"""Search-space parsing, seeded sampling, config splitting and fusion keys."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from packtune.errors import SpecError
from packtune.space import (
    Choice,
    Int,
    LogUniform,
    Uniform,
    fusion_key,
    parse_space,
    sample_config,
    split_config,
    trial_seed,
)

SPACE_JSON = {
    "lr": {"type": "loguniform", "low": 1e-4, "high": 0.3},
    "momentum": {"type": "uniform", "low": 0.0, "high": 0.99},
    "hidden": {"type": "choice", "values": [64, 128]},
    "layers": {"type": "int", "low": 1, "high": 4, "log": False},
    "width": {"type": "int", "low": 8, "high": 512, "log": True},
}


def test_parse_space_builds_each_dimension() -> None:
    space = parse_space(SPACE_JSON)
    assert space == {
        "lr": LogUniform(1e-4, 0.3),
        "momentum": Uniform(0.0, 0.99),
        "hidden": Choice((64, 128)),
        "layers": Int(1, 4, False),
        "width": Int(8, 512, True),
    }


def test_int_accepts_integral_floats_and_a_single_value() -> None:
    space = parse_space({"n": {"type": "int", "low": 2.0, "high": 2}})
    assert space["n"] == Int(2, 2)
    assert isinstance(space["n"].low, int)
    assert sample_config(space, 0, 0) == {"n": 2}


def test_choice_allows_every_json_scalar() -> None:
    space = parse_space({"c": {"type": "choice", "values": ["a", 2, 2.5, True, None]}})
    assert space["c"] == Choice(("a", 2, 2.5, True, None))


@pytest.mark.parametrize("values", [[1, 1.0], [1, True], [0, False]])
def test_choice_values_equal_in_python_are_refused(values: list[object]) -> None:
    """A sampler looks a value up by equality (Optuna's categorical: ``index``): ``true``
    after ``1`` was drawn as ``1``, and never tried."""
    with pytest.raises(SpecError, match="equals") as caught:
        parse_space({"c": {"type": "choice", "values": values}})
    assert caught.value.field == "space.c.values.1"


@pytest.mark.parametrize(
    ("dimension", "field"),
    [
        ({"type": "uniform", "low": -1e308, "high": 1e308}, "space.c.high"),
        ({"type": "int", "low": 0, "high": 2**70}, "space.c.high"),
        ({"type": "int", "low": 0, "high": 10**400}, "space.c.high"),  # was an OverflowError
        ({"type": "uniform", "low": -(10**400), "high": 0}, "space.c.low"),
    ],
)
def test_ranges_too_wide_to_sample_are_refused(dimension: dict[str, object], field: str) -> None:
    """Such a range passed, and TPE raised on it at every tick: the study stalled, running."""
    with pytest.raises(SpecError) as caught:
        parse_space({"c": dimension})
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"lr": {"type": "normal", "low": 0, "high": 1}}, "space.lr.type"),
        ({"lr": {"low": 0, "high": 1}}, "space.lr.type"),
        ({"lr": {"type": ["uniform"], "low": 0, "high": 1}}, "space.lr.type"),
        ({"lr": {"type": "uniform", "high": 1}}, "space.lr.low"),
        ({"lr": {"type": "uniform", "low": 0}}, "space.lr.high"),
        ({"lr": {"type": "uniform", "low": "0", "high": 1}}, "space.lr.low"),
        ({"lr": {"type": "uniform", "low": True, "high": 1}}, "space.lr.low"),
        ({"lr": {"type": "uniform", "low": 0, "high": math.inf}}, "space.lr.high"),
        ({"lr": {"type": "uniform", "low": math.nan, "high": 1}}, "space.lr.low"),
        ({"lr": {"type": "uniform", "low": 2, "high": 1}}, "space.lr.low"),
        ({"lr": {"type": "uniform", "low": 1, "high": 1}}, "space.lr.high"),
        ({"lr": {"type": "loguniform", "low": 0.1, "high": 0.1}}, "space.lr.high"),
        ({"lr": {"type": "loguniform", "low": 0, "high": 1}}, "space.lr.low"),
        ({"lr": {"type": "loguniform", "low": -1, "high": 1}}, "space.lr.low"),
        ({"lr": {"type": "uniform", "low": 0, "high": 1, "step": 2}}, "space.lr.step"),
        ({"n": {"type": "int", "low": 1.5, "high": 4}}, "space.n.low"),
        ({"n": {"type": "int", "low": 1, "high": 4.5}}, "space.n.high"),
        ({"n": {"type": "int", "low": 5, "high": 4}}, "space.n.low"),
        ({"n": {"type": "int", "low": 0, "high": 4, "log": True}}, "space.n.low"),
        ({"n": {"type": "int", "low": 1, "high": 4, "log": "yes"}}, "space.n.log"),
        ({"c": {"type": "choice", "values": []}}, "space.c.values"),
        ({"c": {"type": "choice", "values": "ab"}}, "space.c.values"),
        ({"c": {"type": "choice"}}, "space.c.values"),
        ({"c": {"type": "choice", "values": [1, [2]]}}, "space.c.values.1"),
        ({"c": {"type": "choice", "values": [{"a": 1}]}}, "space.c.values.0"),
        ({"c": {"type": "choice", "values": [1, math.nan]}}, "space.c.values.1"),
        ({"c": {"type": "choice", "values": [1, 2, 1]}}, "space.c.values.2"),
        ({"c": {"type": "choice", "values": [1], "low": 0}}, "space.c.low"),
        ({"lr": [0, 1]}, "space.lr"),
        ({"": {"type": "uniform", "low": 0, "high": 1}}, "space"),
        ([1, 2], "space"),
    ],
)
def test_parse_space_rejects_with_the_field_named(raw: Any, field: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_space(raw)
    assert caught.value.field == field


def test_prefix_is_used_in_field_names() -> None:
    with pytest.raises(SpecError) as caught:
        parse_space({"lr": {"type": "uniform", "low": 1, "high": 0}}, prefix="study.space")
    assert caught.value.field == "study.space.lr.low"


def test_sampling_is_deterministic_and_independent_of_other_indices() -> None:
    space = parse_space(SPACE_JSON)
    forward = [sample_config(space, 7, i) for i in range(20)]
    backward = [sample_config(space, 7, i) for i in reversed(range(20))][::-1]
    assert forward == backward
    assert sample_config(space, 7, 3) == forward[3]
    assert sample_config(space, 8, 3) != forward[3]
    assert len({json.dumps(config, sort_keys=True) for config in forward}) == 20
    assert list(forward[0]) == sorted(SPACE_JSON)


def test_sampling_is_pinned_across_machines() -> None:
    """The streams are part of the contract: a study resumed elsewhere must agree."""
    space = parse_space(
        {
            "c": {"type": "choice", "values": list(range(1000))},
            "n": {"type": "int", "low": 0, "high": 99},
            "u": {"type": "uniform", "low": 0, "high": 1},
        }
    )
    assert [sample_config(space, 0, index) for index in range(3)] == [
        {"c": 350, "n": 90, "u": 0.13753520097417316},
        {"c": 798, "n": 58, "u": 0.4651407875811223},
        {"c": 587, "n": 60, "u": 0.8480975305806199},
    ]
    assert (trial_seed(0, 0), trial_seed(5, 17)) == (2050680261, 1750468019)


def test_sampled_values_are_json_native_and_in_bounds() -> None:
    space = parse_space(SPACE_JSON)
    for index in range(300):
        config = sample_config(space, 1, index)
        assert json.loads(json.dumps(config)) == config
        assert type(config["lr"]) is float and 1e-4 <= config["lr"] <= 0.3
        assert type(config["momentum"]) is float and 0.0 <= config["momentum"] <= 0.99
        assert config["hidden"] in (64, 128)
        assert type(config["layers"]) is int and 1 <= config["layers"] <= 4
        assert type(config["width"]) is int and 8 <= config["width"] <= 512


def test_every_value_of_small_discrete_dimensions_is_reached() -> None:
    space = parse_space(
        {
            "layers": {"type": "int", "low": 1, "high": 4},
            "k": {"type": "int", "low": 1, "high": 3, "log": True},
            "c": {"type": "choice", "values": ["a", "b", "c"]},
        }
    )
    seen: dict[str, set[Any]] = {"layers": set(), "k": set(), "c": set()}
    for index in range(200):
        for name, value in sample_config(space, 0, index).items():
            seen[name].add(value)
    assert seen == {"layers": {1, 2, 3, 4}, "k": {1, 2, 3}, "c": {"a", "b", "c"}}


def test_loguniform_is_uniform_in_log_space() -> None:
    space = {"lr": LogUniform(1e-4, 1.0)}
    draws = [sample_config(space, 3, i)["lr"] for i in range(4000)]
    below = sum(1 for value in draws if value < 1e-2)  # half of the log range
    assert 0.45 < below / len(draws) < 0.55
    assert sum(1 for value in draws if value < 1e-3) / len(draws) < 0.30


def test_int_log_favours_small_values() -> None:
    space = {"width": Int(1, 1024, log=True)}
    draws = [sample_config(space, 0, i)["width"] for i in range(4000)]
    assert 0.4 < sum(1 for value in draws if value <= 32) / len(draws) < 0.6


@given(seed=st.integers(0, 2**63), index=st.integers(0, 10**9))
def test_trial_seed_is_31_bit_and_deterministic(seed: int, index: int) -> None:
    value = trial_seed(seed, index)
    assert 0 <= value < 2**31
    assert trial_seed(seed, index) == value


def test_trial_seeds_differ_between_trials() -> None:
    assert len({trial_seed(0, index) for index in range(1000)}) == 1000


@given(
    low=st.floats(-1e300, 1e300),
    width=st.floats(1e-300, 1e300),
    seed=st.integers(0, 2**32),
    index=st.integers(0, 10**6),
)
def test_uniform_stays_in_bounds(low: float, width: float, seed: int, index: int) -> None:
    high = low + width
    if not high > low or not math.isfinite(high):
        return
    value = sample_config({"x": Uniform(low, high)}, seed, index)["x"]
    assert low <= value <= high


def test_split_config() -> None:
    config = {"lr": 0.1, "hidden": 64, "batch_size": 32, "optimizer": "sgd"}
    shape, fusible = split_config(config, {"hidden", "batch_size", "optimizer", "layers"})
    assert shape == {"hidden": 64, "batch_size": 32, "optimizer": "sgd"}
    assert fusible == {"lr": 0.1}


def test_fusion_key_format_and_canonical_values() -> None:
    structural = {"batch_size", "hidden", "optimizer"}
    config = {"optimizer": "sgd", "lr": 0.01, "hidden": 128, "batch_size": 64}
    key = fusion_key("digits-mlp", config, structural)
    assert key == 'digits-mlp|{"batch_size":64,"hidden":128,"optimizer":"sgd"}'
    same = {"batch_size": 64.0, "hidden": 128, "optimizer": "sgd", "lr": 0.3}
    assert fusion_key("digits-mlp", same, structural) == key
    assert fusion_key("digits-mlp", {**config, "hidden": 64}, structural) != key
    assert fusion_key("digits-cnn", config, structural) != key


def test_fusion_key_keeps_booleans_and_nested_values() -> None:
    structural = {"nesterov", "sizes"}
    true_key = fusion_key("w", {"nesterov": True, "sizes": (64, 32.0)}, structural)
    assert true_key == 'w|{"nesterov":true,"sizes":[64,32]}'
    assert fusion_key("w", {"nesterov": 1, "sizes": [64, 32]}, structural) != true_key


@pytest.mark.parametrize("first", [True, 1, 1.0])
def test_fusion_key_memo_tells_values_python_calls_equal_apart(first: Any) -> None:
    """True == 1 == 1.0 (and (True,) == (1,)): shapes are encoded once each, and a shape
    seen first must not answer for an equal one of another type."""
    for value in (first, *(v for v in (True, 1, 1.0) if v is not first)):
        json_value = "true" if value is True else "1"
        assert fusion_key("w", {"x": value}, {"x"}) == f'w|{{"x":{json_value}}}'
        assert fusion_key("w", {"x": (value,)}, {"x"}) == f'w|{{"x":[{json_value}]}}'


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text()),
        max_size=6,
    )
)
def test_fusion_key_ignores_insertion_order_and_fusible_values(config: dict[str, Any]) -> None:
    structural = set(list(config)[::2])
    reordered = dict(reversed(list(config.items())))
    fusible_changed = {k: (v if k in structural else "changed") for k, v in config.items()}
    key = fusion_key("w", config, structural)
    assert fusion_key("w", reordered, structural) == key
    assert fusion_key("w", fusible_changed, structural) == key
