"""Python state a training step changes is each member's own and survives a resume.

A counter a workload's loss (or metrics) keeps on the workload object, one kept as a small
tensor, one counted only with gradients on, a step counter a model's forward keeps on its
module, and a value outside the model (a module global, a settings object's attribute)
that build_model sets and each step changes: an array of three members, cut at epoch
boundaries and mid-epoch (each cut a real checkpoint written and read back, as a rung or a
give-up does), ends with each member exactly where it ends trained alone, straight through.
Spilled and decoupled arrays too, whose shape passes on the meta device run a forward of
their own.
"""

from __future__ import annotations

import copy
import random
import threading
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from packtune.spec import TrainingSettings
from tests.support.tiny_workloads import Ramp, TinyMLP
from worker.checkpoints import load_checkpoint, save_checkpoint
from worker.fused import FusedArray, train

EPOCHS = 3


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).double()


def _scale(count: Any) -> Any:
    return 1.0 + 3.0 / (1.0 + count)


class LossCounter(TinyMLP):
    name = "loss-counter"

    def build_model(self, config: Any) -> nn.Module:
        self.calls = 0
        return _mlp()

    def loss(self, outputs: Any, targets: Any) -> Any:
        self.calls += 1
        return F.cross_entropy(outputs, targets) * _scale(self.calls)


class GradOnlyCounter(LossCounter):
    """Counts training calls only (gradients on): a probe under no_grad saw nothing."""

    name = "grad-only-counter"

    def loss(self, outputs: Any, targets: Any) -> Any:
        if torch.is_grad_enabled():
            self.calls += 1
        return F.cross_entropy(outputs, targets) * _scale(self.calls)


class EvalCounter(LossCounter):
    """Counts evaluations in metrics() and reads the count in loss()."""

    name = "eval-counter"

    def loss(self, outputs: Any, targets: Any) -> Any:
        return F.cross_entropy(outputs, targets) * _scale(self.calls)

    def metrics(self, outputs: Any, targets: Any) -> dict[str, float]:
        self.calls += 1
        return super().metrics(outputs, targets)


class TensorCounter(TinyMLP):
    """A counter kept as a tensor, changed in place (identity never changes)."""

    name = "tensor-counter"

    def build_model(self, config: Any) -> nn.Module:
        self.t = torch.zeros((), dtype=torch.float64)
        return _mlp()

    def loss(self, outputs: Any, targets: Any) -> Any:
        self.t += 1
        return F.cross_entropy(outputs, targets) * _scale(self.t)


class RampModel(TinyMLP):
    """A warm-up counted by the forward, on its module (Python state of the model)."""

    name = "ramp-model"

    def build_model(self, config: Any) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Ramp(40), nn.Linear(16, 3)).double()


#: set by GlobalTemperature.build_model per trial, cooled by each of its training steps
TEMPERATURE = 1.0


class GlobalTemperature(TinyMLP):
    """A value kept outside the model (a module global) that build_model sets per trial and
    each training step changes: each member's own, and saved with its checkpoint."""

    name = "global-temperature"

    def build_model(self, config: Any) -> nn.Module:
        global TEMPERATURE
        TEMPERATURE = 2.0 + config["lr"]
        return _mlp()

    def loss(self, outputs: Any, targets: Any) -> Any:
        global TEMPERATURE
        if torch.is_grad_enabled():
            TEMPERATURE *= 0.97
        return F.cross_entropy(outputs, targets) * TEMPERATURE


class Schedule:
    """A settings object of the user's (held field by field)."""

    temperature = 1.0


#: its temperature set per trial by SettingsTemperature.build_model, cooled by each step
SCHEDULE = Schedule()


class SettingsTemperature(GlobalTemperature):
    """The same, kept on a settings object changed in place."""

    name = "settings-temperature"

    def build_model(self, config: Any) -> nn.Module:
        SCHEDULE.temperature = 2.0 + config["lr"]
        return _mlp()

    def loss(self, outputs: Any, targets: Any) -> Any:
        if torch.is_grad_enabled():
            SCHEDULE.temperature *= 0.97
        return F.cross_entropy(outputs, targets) * SCHEDULE.temperature


#: seeded per trial by SeededCoin.build_model, drawn from by each training step
COIN = random.Random()


class SeededCoin(GlobalTemperature):
    """A random generator kept outside the model, seeded per trial: where its draws stood
    goes into the checkpoint."""

    name = "seeded-coin"

    def build_model(self, config: Any) -> nn.Module:
        COIN.seed(int(config["seed"]))
        return _mlp()

    def loss(self, outputs: Any, targets: Any) -> Any:
        scale = 1.0 + COIN.random() if torch.is_grad_enabled() else 1.0
        return F.cross_entropy(outputs, targets) * scale


class CoinOnWorkload(SeededCoin):
    """The same generator on the workload object, made once and seeded per trial in place."""

    name = "coin-on-workload"

    def __init__(self) -> None:
        super().__init__()
        self.coin = random.Random()

    def build_model(self, config: Any) -> nn.Module:
        self.coin.seed(int(config["seed"]))
        return _mlp()

    def loss(self, outputs: Any, targets: Any) -> Any:
        scale = 1.0 + self.coin.random() if torch.is_grad_enabled() else 1.0
        return F.cross_entropy(outputs, targets) * scale


def members(n: int = 3) -> list[tuple[Hashable, dict[str, Any]]]:
    return [
        (f"t{i}", {"seed": 20 + i, "data_seed": 4, "lr": 0.05 * (i + 1), "dtype": "float64"})
        for i in range(n)
    ]


class GiveUpAt(threading.Event):
    """Set once ``array`` has trained to ``step`` (a give-up asked mid-epoch)."""

    def __init__(self, array: FusedArray, step: int) -> None:
        super().__init__()
        self.array, self.step = array, step

    def is_set(self) -> bool:
        return self.array.step >= self.step


def resumed(array: FusedArray, workload: Any, folder: Path, **kw: Any) -> FusedArray:
    states = [
        load_checkpoint(save_checkpoint(folder, 1, key, array.member_state(key)))
        for key in array.keys
    ]
    return FusedArray(workload, members(len(states)), states=states, **kw)


def final(array: FusedArray) -> dict[Hashable, dict[str, Any]]:
    return {key: array.member_state(key) for key in array.keys}


@pytest.mark.parametrize(
    "workload",
    [
        LossCounter, GradOnlyCounter, EvalCounter, TensorCounter, RampModel, GlobalTemperature,
        SettingsTemperature, SeededCoin, CoinOnWorkload,
    ],
)  # fmt: skip
@pytest.mark.parametrize("cut", ["epochs", "mid-epoch"])
def test_a_member_cut_and_resumed_in_an_array_ends_as_one_trained_alone_straight_through(
    workload: type[TinyMLP], cut: str, tmp_path: Path
) -> None:
    w = workload()
    spe = FusedArray(copy.copy(w), members(1)).steps_per_epoch
    alone = {}
    for member in members():
        solo = FusedArray(copy.copy(w), [member])
        train(solo, EPOCHS * spe)
        alone.update(final(solo))
    array = FusedArray(w, members())
    for stop in [spe, 2 * spe] if cut == "epochs" else [spe // 2 + 1, spe + 3]:
        if cut == "epochs":
            train(array, stop)
        else:
            train(array, EPOCHS * spe, give_up=GiveUpAt(array, stop))
        assert array.step == stop
        array = resumed(array, w, tmp_path)
    train(array, EPOCHS * spe)
    for key, state in final(array).items():
        assert state.get("python") == alone[key].get("python"), key
        assert state.get("python"), "the state was not seen"
        for name, tensor in alone[key]["params"].items():
            torch.testing.assert_close(state["params"][name], tensor, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "kw",
    [{"spill_budget": 120_000}, {"training": TrainingSettings(mode="decoupled", segments=2)}],
    ids=["spilled", "decoupled"],
)
def test_a_shape_pass_of_a_spilled_or_decoupled_array_is_no_training_step(
    kw: dict[str, Any], tmp_path: Path
) -> None:
    """Spilled and decoupled arrays run a forward on the meta device for shapes; a step
    counter on a module counted it, and with the counter in checkpoints every resume added
    one (21 against 19 after 18 steps cut twice: an audit)."""
    w = RampModel()
    straight = FusedArray(copy.copy(w), members(1), **kw)
    spe = straight.steps_per_epoch
    train(straight, EPOCHS * spe)
    array = FusedArray(w, members(1), **kw)
    for stop in (spe, 2 * spe):
        train(array, stop)
        array = resumed(array, w, tmp_path, **kw)
    train(array, EPOCHS * spe)
    (want,), (got,) = final(straight).values(), final(array).values()
    assert got["python"] == want["python"]
    assert want["python"]["model"] == {"2.calls": EPOCHS * spe}
    for name, tensor in want["params"].items():
        torch.testing.assert_close(got["params"][name], tensor, rtol=0, atol=1e-12)


def test_a_trials_merged_segments_keep_each_modules_python_state_from_its_segment() -> None:
    """Segment units' checkpoints each hold the whole model's Python state; the trial's
    merged state dropped it (the next span started from build_model's counters)."""
    from worker.decoupled import merge_segments

    def segment(j: int, params: list[str], python: dict[str, Any]) -> dict[str, Any]:
        return {"segment": j, "key": "t0", "config": {}, "rng": torch.zeros(1), "steps_done": 12,
                "params": dict.fromkeys(params, torch.zeros(1)), "buffers": {},
                "optimizer": {"step": 12, "state": {}}, "python": python}  # fmt: skip

    merged = merge_segments([
        segment(0, ["0.weight"], {"model": {"1.calls": 12, "2.calls": 0}}),
        segment(1, ["2.weight"], {"model": {"1.calls": 0, "2.calls": 12},
                                  "workload": {"calls": 24}, "outside": {"m.T": {"value": 0.5}}}),
    ])  # fmt: skip
    # module 1 holds no weights: the first segment's (where it runs, before module 2)
    assert merged["python"] == {"model": {"1.calls": 12, "2.calls": 12}, "workload": {"calls": 24},
                                "outside": {"m.T": {"value": 0.5}}}  # fmt: skip


def test_a_metric_is_a_number_not_a_string_of_one() -> None:
    from worker.fused_group import metric_values

    w = TinyMLP()
    assert metric_values(w, "metrics", {"a": torch.tensor(0.5), "b": 1}) == {"a": 0.5, "b": 1.0}
    with pytest.raises(TypeError, match=r"metrics\(\) returned a=str; a metric must be a number"):
        metric_values(w, "metrics", {"a": "0.5"})
