"""Learning-rate schedules as pure functions of the step (packtune.schedules)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from packtune.schedules import Schedule, check_schedule, schedule_of


def test_each_kind_by_hand() -> None:
    spe = 10
    step = schedule_of({"schedule": "step", "decay_epochs": 2, "gamma": 0.5}, spe, 9)
    assert [step.factor(t) for t in (0, 19, 20, 39, 40)] == [1, 1, 0.5, 0.5, 0.25]
    cosine = schedule_of({"schedule": "cosine", "final_lr_ratio": 0.1}, spe, 4)
    assert cosine.factor(0) == 1.0
    assert cosine.factor(20) == pytest.approx(0.55)  # half-way: (1 + 0.1) / 2
    assert cosine.factor(40) == cosine.factor(400) == pytest.approx(0.1)  # the floor after R
    warm = schedule_of({"schedule": "cosine", "warmup_epochs": 1}, spe, 4)
    assert [warm.factor(t) for t in (0, 4, 9)] == [0.1, 0.5, 1.0]  # (t + 1) / 10
    assert warm.factor(10) == 1.0 and warm.factor(40) == pytest.approx(0.0)
    assert Schedule().constant and not warm.constant
    assert not schedule_of({"warmup_epochs": 0.5}, spe, 4).constant  # warm-up on constant


@given(
    kind=st.sampled_from(["constant", "step", "cosine"]),
    warmup=st.floats(0, 3),
    decay=st.floats(0.1, 5),
    gamma=st.floats(0, 1),
    final=st.floats(0, 1),
    spe=st.integers(1, 50),
    epochs=st.floats(1, 30),
    t=st.integers(0, 5000),
)
def test_a_factor_is_finite_and_never_above_one(kind, warmup, decay, gamma, final, spe, epochs, t):
    plan = schedule_of(
        {"schedule": kind, "warmup_epochs": warmup, "decay_epochs": decay, "gamma": gamma,
         "final_lr_ratio": final},
        spe, epochs,
    )  # fmt: skip
    f = plan.factor(t)
    assert math.isfinite(f) and 0.0 <= f <= 1.0 + 1e-12
    if kind == "cosine" and t >= plan.warmup_steps:
        assert f >= final - 1e-12  # never below its floor


@pytest.mark.parametrize(
    "params,field",
    [
        ({"schedule": "poly"}, "schedule"),
        ({"gamma": 1.5}, "gamma"),
        ({"final_lr_ratio": -0.1}, "final_lr_ratio"),
        ({"decay_epochs": 0}, "decay_epochs"),
        ({"warmup_epochs": -1}, "warmup_epochs"),
    ],
)
def test_a_bad_value_is_named(params, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        check_schedule(params)
