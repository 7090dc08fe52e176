"""Draws in evaluation: a model or loss that draws random numbers in eval mode too.

Its members train one per stack, each step reseeded from the member's own stream; its
evaluation drew from wherever torch's generator stood, after the array's last stack's step,
so a member's validation loss depended on its pack-mates. Each
stack's evaluation is now reseeded from its members' streams (read, not advanced): the
same alone as in any pack, and the training draws are those of a run without evaluation.
A model that draws in eval mode only is none a probe of its training forwards sees: its
evaluation is checked, as a step is, and the pack trains again knowing it.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Hashable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.support.tiny_workloads import TinyMLP
from worker.fused import FusedArray, train
from worker.probe import UnseenDraws

EPOCHS = 2


class NoisyLoss(TinyMLP):
    """A loss that draws, in training and in evaluation alike."""

    name = "noisy-eval-loss"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().loss(outputs, targets) * (1 + 0.2 * torch.rand(()))


class CoinLoss(TinyMLP):
    """A loss that draws from Python's ``random``, in training and in evaluation alike."""

    name = "coin-eval-loss"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().loss(outputs, targets) * (1 + 0.2 * random.random())


class StreamedNoisyLoss(NoisyLoss):
    """The same, streamed: evaluated batch by batch, each stack in turn on each batch."""

    name = "streamed-noisy-eval-loss"

    def train_batches(self, config: Any, epoch: int) -> Any:
        from packtune.workloads.base import epoch_generator

        cfg = self.resolve(config)
        train_split, _ = super().data(cfg)
        pairs = list(zip(train_split.x, train_split.y, strict=True))
        return DataLoader(pairs, batch_size=int(cfg["batch_size"]), shuffle=True,
                          drop_last=True, generator=epoch_generator(cfg, epoch))  # fmt: skip

    def val_batches(self, config: Any) -> Any:
        _, val_split = super().data(self.resolve(config))
        return DataLoader(list(zip(val_split.x, val_split.y, strict=True)), batch_size=16)

    def data(self, config: Any, device: Any = "cpu") -> Any:  # streamed: no in-memory data
        raise NotImplementedError


def members(n: int = 3) -> list[tuple[Hashable, dict[str, Any]]]:
    return [(f"t{i}", {"seed": 40 + i, "data_seed": 4, "lr": 0.1, "dtype": "float64"})
            for i in range(n)]  # fmt: skip


@pytest.mark.parametrize("workload", [NoisyLoss, CoinLoss, StreamedNoisyLoss], ids=lambda w: w.name)
def test_a_member_s_evaluation_draws_the_same_alone_as_in_a_pack(workload: type[TinyMLP]) -> None:
    w = workload()
    array = FusedArray(copy.copy(w), members())
    assert array.stochastic and [len(keys) for keys, _ in array.stacks] == [1, 1, 1]
    steps = array.steps_per_epoch
    packed = []
    for _ in range(EPOCHS):
        train(array, array.step + steps)
        packed.append(array.evaluate())
    for key, config in members():
        solo = FusedArray(copy.copy(w), [(key, config)])
        for epoch in range(EPOCHS):
            train(solo, solo.step + steps)
            assert solo.evaluate()[key] == packed[epoch][key], (key, epoch)
        for name, tensor in solo.member_state(key)["params"].items():
            assert torch.equal(array.member_state(key)["params"][name], tensor), (key, name)


def test_evaluating_does_not_change_what_training_draws() -> None:
    """An array evaluated at every epoch ends where one never evaluated ends."""
    w = NoisyLoss()
    evaluated, plain = FusedArray(copy.copy(w), members(2)), FusedArray(copy.copy(w), members(2))
    for _ in range(EPOCHS):
        train(evaluated, evaluated.step + evaluated.steps_per_epoch)
        evaluated.evaluate()
    for epoch in range(EPOCHS):  # the same steps, never evaluated
        for batch in plain.epoch_inputs(epoch, 0, plain.steps_per_epoch):
            plain.train_step(batch)
    for key in plain.keys:
        for name, tensor in plain.member_state(key)["params"].items():
            assert torch.equal(evaluated.member_state(key)["params"][name], tensor), (key, name)


class EvalOnlyNoise(TinyMLP):
    """A loss that draws in evaluation only (under no_grad): its training draws nothing."""

    name = "eval-only-noise"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        noise = 0.0 if torch.is_grad_enabled() else 0.2 * torch.rand(())
        return super().loss(outputs, targets) * (1 + noise)


class EvalOnlyCoin(TinyMLP):
    """The same, from Python's ``random``."""

    name = "eval-only-coin"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        noise = 0.0 if torch.is_grad_enabled() else 0.2 * random.random()
        return super().loss(outputs, targets) * (1 + noise)


@pytest.mark.parametrize(
    ("workload", "source"),
    [(EvalOnlyNoise, "torch's generators"), (EvalOnlyCoin, "Python's or NumPy's generator")],
    ids=["torch", "host"],
)
def test_a_draw_in_eval_mode_only_is_caught_and_the_pack_trains_again_drawing_its_own(
    workload: type[TinyMLP], source: str
) -> None:
    w = workload()
    first = FusedArray(copy.copy(w), members())
    assert not first.stochastic  # its probe saw training forwards draw nothing
    with pytest.raises(UnseenDraws, match=f"evaluation drew from {source}"):
        train(first, first.steps_per_epoch)
    array = FusedArray(copy.copy(w), members())  # the pack again, in the same process
    assert array.stochastic
    train(array, EPOCHS * array.steps_per_epoch)
    packed = array.evaluate()
    for key, config in members():
        solo = FusedArray(copy.copy(w), [(key, config)])
        train(solo, EPOCHS * solo.steps_per_epoch)
        assert solo.evaluate()[key] == packed[key], key
