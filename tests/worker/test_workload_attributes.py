"""Values ``build_model`` keeps on the workload object that its model reads through it (the
model holds a bound method of the workload): changed in place (a settings object, a random
generator seeded per trial) or set anew. An array's workload object is one for all its
members (and shares those objects with every array of the process: each holds a shallow
copy of one), and copies of the model copied it: before, packed members trained with the
last member's values, or with values frozen in the copy. Each member now ends exactly as it
ends trained alone."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.tiny_workloads import TinyMLP
from tests.worker.test_outside_state import (
    at_once_as_alone,
    members,
    trained_as_alone,
)
from worker.fused import FusedArray


class _Net(nn.Module):
    """Scales its hidden layer by what ``read`` (a bound method of the workload) gives."""

    def __init__(self, read: Callable[[bool], Any]) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * self.read(self.training))


class _Scaled(TinyMLP):
    params = {**TinyMLP.params, "scale": 1.0}
    fusible = frozenset({"scale"})


class SeededOnWorkload(_Scaled):
    """A generator made once, seeded per trial in place."""

    name = "seeded-on-workload"

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator()

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        self.gen.manual_seed(int(config["seed"]))
        return _Net(self.noise).double()

    def noise(self, training: bool) -> Any:
        if not training:
            return 1.0
        return 1.0 + 0.3 * torch.rand(16, generator=self.gen, dtype=torch.float64)


@dataclass
class Settings:
    scale: float = 1.0


class SettingsOnWorkload(_Scaled):
    """A settings object made once, changed per trial in place."""

    name = "settings-on-workload"

    def __init__(self) -> None:
        super().__init__()
        self.settings = Settings()

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        self.settings.scale = float(self.resolve(config)["scale"])
        return _Net(self.read).double()

    def read(self, training: bool) -> Any:
        return self.settings.scale


class ScaleOnWorkload(_Scaled):
    """A value set anew per trial, read through the bound method the model holds."""

    name = "scale-on-workload"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        self.scale = float(self.resolve(config)["scale"])
        return _Net(self.read).double()

    def read(self, training: bool) -> Any:
        return self.scale


WORKLOADS = [SeededOnWorkload, SettingsOnWorkload, ScaleOnWorkload]


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_members_end_as_trained_alone(workload: type[TinyMLP]) -> None:
    array = trained_as_alone(workload(), [0.5, 1.0, 2.0])
    assert [len(keys) for keys, _ in array.stacks] == [1, 1, 1]


@pytest.mark.parametrize("workload", WORKLOADS[:2], ids=lambda w: w.name)
def test_two_arrays_trained_at_once_each_read_their_own_values(workload: type[TinyMLP]) -> None:
    """The arrays' workload objects are shallow copies of one: the settings object or the
    generator is the same object in both."""
    at_once_as_alone(workload(), [members([0.5]), members([2.0], first=2)])


def test_an_array_built_before_another_changed_the_object_reads_its_own_value() -> None:
    """The first array's build left the settings object as it was (its member's value is
    the default), so it learned nothing; the second's build changed it in place. The first
    array then read the second's value while both trained at once."""

    class Late(SettingsOnWorkload):
        name = "late-settings"  # a class of its own: nothing learned of it yet

    at_once_as_alone(Late(), [members([1.0]), members([2.0], first=2)], built_first=True)


class LossSettings(SettingsOnWorkload):
    """Its loss reads the settings object (the model is a plain MLP, which fuses)."""

    name = "loss-settings"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        self.settings.scale = float(self.resolve(config)["scale"])
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).double()

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().loss(outputs, targets) * self.settings.scale


def test_a_loss_reading_the_settings_object_trains_each_members_value() -> None:
    array = trained_as_alone(LossSettings(), [0.5, 1.0, 2.0])
    assert [len(keys) for keys, _ in array.stacks] == [1, 1, 1]


def test_equal_values_changed_in_place_still_fuse() -> None:
    w = LossSettings()
    FusedArray(copy.copy(w), members([3.0]))  # a build of another value first: learned
    array = trained_as_alone(w, [1.5, 1.5, 1.5])
    assert [len(keys) for keys, _ in array.stacks] == [3]
