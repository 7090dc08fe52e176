"""Dropout in a model of the user's own (not a hand-fusable ``nn.Sequential``): its members
fuse through vmap, each drawing its masks from its own stream.

Before, such a model trained one member per stack (each reseeding torch's generator before
its step), since under vmap every member's dropout drew from the one generator. Its members
now stack in one vmap stack whose dropout modules take each member's own masks: packed, a
member ends exactly (to vmap's float rounding) where it ends alone.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.tiny_workloads import Ramp, TinyMLP
from worker.fused import FusedArray, train
from worker.probe import UnseenDraws
from worker.rng import torch_states

EPOCHS = 2


class _Net(nn.Module):
    """An MLP of its own class: two dropout modules, one called twice (a shared module)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.drop, self.drop_in = nn.Dropout(p), nn.Dropout(p / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc1(self.drop_in(x))))
        return self.fc3(self.drop(torch.relu(self.fc2(h))))


class _ConvNet(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 4, 3, padding=1), nn.Linear(4 * 4 * 2, 3)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x.reshape(-1, 1, 4, 2)))
        return self.fc(self.drop(h.flatten(1)))


class DropoutNet(TinyMLP):
    name = "dropout-net"
    params = {**TinyMLP.params, "dropout": 0.3}

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        return _Net(float(self.resolve(config)["dropout"])).double()


class DropoutConvNet(DropoutNet):
    name = "dropout-conv-net"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        return _ConvNet(float(self.resolve(config)["dropout"])).double()


class DropoutRamp(DropoutNet):
    """A Sequential the hand-fused path cannot run (a warm-up counter on a module of its own):
    the counter advances once a step in a vmap stack, as alone, not at the masks' reading."""

    name = "dropout-ramp"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        p = float(self.resolve(config)["dropout"])
        return nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Dropout(p), Ramp(7), nn.Linear(16, 3)
        ).double()


def members(n: int = 3) -> list[tuple[Hashable, dict[str, Any]]]:
    return [(f"t{i}", {"seed": 50 + i, "data_seed": 4, "lr": 0.05 * (i + 1), "dtype": "float64"})
            for i in range(n)]  # fmt: skip


@pytest.mark.parametrize(
    "workload", [DropoutNet, DropoutConvNet, DropoutRamp], ids=lambda w: w.name
)
def test_members_fuse_through_vmap_each_with_masks_of_its_own(workload: type[TinyMLP]) -> None:
    w = workload()
    array = FusedArray(copy.copy(w), members())
    assert array.stacks == [(["t0", "t1", "t2"], "vmap")]
    assert not array.stochastic  # no member reseeds torch's generator
    before = torch_states(array.device)
    train(array, EPOCHS * array.steps_per_epoch)
    assert all(torch.equal(a, b) for a, b in zip(before, torch_states(array.device), strict=True))
    packed = array.evaluate()
    for key, config in members():
        solo = FusedArray(copy.copy(w), [(key, config)])
        assert solo.stacks == [([key], "serial")]
        train(solo, EPOCHS * solo.steps_per_epoch)
        for name, tensor in solo.member_state(key)["params"].items():
            torch.testing.assert_close(
                array.member_state(key)["params"][name], tensor, rtol=0, atol=1e-12
            )
        assert solo.evaluate()[key]["val_loss"] == pytest.approx(packed[key]["val_loss"], 1e-12)


def test_the_masks_are_dropout_s_own_masks() -> None:
    """Not vacuous: the masks drop units (trained with p=0 a member ends elsewhere), and they
    are each member's stream's: two members of one seed (one init, one stream) in one stack
    draw the same masks, where vmap's own draws would give each member others."""
    w = DropoutNet()
    group = [(key, {**config, "lr": 0.1, "seed": 50}) for key, config in members(2)]
    array = FusedArray(copy.copy(w), group)
    quiet = FusedArray(copy.copy(w), [(k, {**c, "dropout": 0.0}) for k, c in group])
    for a in (array, quiet):
        train(a, a.steps_per_epoch)
    (a0, a1), (q0, _) = (
        [a.member_state(k)["params"]["fc1.weight"] for k, _ in group] for a in (array, quiet)
    )
    assert not torch.equal(a0, q0)
    assert torch.equal(a0, a1)


class _EveryOtherStep(nn.Module):
    """Applies its dropout on odd training steps only (a Python counter decides): its
    dropout calls differ from step to step, which a reading of one forward cannot know."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop, self.calls = (
            nn.Linear(8, 16),
            nn.Linear(16, 3),
            nn.Dropout(p),
            0,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.training:
            self.calls += 1
            if self.calls % 2:
                h = self.drop(h)
        return self.fc2(h)


class EveryOtherStep(DropoutNet):
    name = "every-other-step-dropout"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        return _EveryOtherStep(float(self.resolve(config)["dropout"])).double()


def test_a_forward_that_calls_its_dropout_otherwise_trains_again_one_member_per_stack() -> None:
    """Its vmap stack's second step found a mask it did not use: the trial failed with a
    MaskMismatch. Now the process learns the model draws otherwise, and the pack trains
    again (UnseenDraws, as for any draw a probe missed), one member per stack."""
    w = EveryOtherStep()
    array = FusedArray(copy.copy(w), members())
    assert array.stacks == [(["t0", "t1", "t2"], "vmap")]
    with pytest.raises(UnseenDraws, match="called its dropout modules otherwise"):
        train(array, array.steps_per_epoch)
    again = FusedArray(copy.copy(w), members())
    assert [mode for _, mode in again.stacks] == ["serial"] * 3
    train(again, EPOCHS * again.steps_per_epoch)
    for key, config in members():
        solo = FusedArray(copy.copy(w), [(key, config)])
        train(solo, EPOCHS * solo.steps_per_epoch)
        for name, tensor in solo.member_state(key)["params"].items():
            assert torch.equal(again.member_state(key)["params"][name], tensor), (key, name)
