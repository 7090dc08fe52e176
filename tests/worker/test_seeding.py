"""Seeding torch's global generator: what ``torch.manual_seed`` does, at a fraction of its
cost on a host with no accelerator (a stochastic array reseeds before every member's step)."""

from __future__ import annotations

import traceback

import pytest
import torch

from packtune.workloads import get_workload
from worker.fused import FusedArray
from worker.rng import _accelerator_present, seed_torch


@pytest.mark.parametrize("seed", [0, 7, 2**62 + 12345, 2**63 - 1, -5])
def test_seed_torch_leaves_the_generators_as_manual_seed_does(seed: int) -> None:
    torch.manual_seed(seed)
    expected = torch.get_rng_state()
    drawn = torch.rand(5)
    torch.manual_seed(seed + 1)
    seed_torch(seed)
    assert torch.equal(torch.get_rng_state(), expected)
    assert torch.equal(torch.rand(5), drawn)


def test_a_stochastic_array_trains_without_capturing_a_stack_per_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.manual_seed queues lazy CUDA/XPU/MTIA seeds with a copy of the caller's stack
    where none of them has started: ~0.6 ms a call, 40% of a dropout model's step on a CPU."""
    if _accelerator_present():
        pytest.skip("an accelerator is present: torch.manual_seed is what seeds it")
    captured = []
    real = traceback.format_stack

    def counting(*args: object, **kwargs: object) -> list[str]:
        captured.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(traceback, "format_stack", counting)
    # declared to draw some other way than its Dropout modules: stacks of one, reseeded
    workload = type("DrawingMLP", (type(get_workload("digits-mlp")),), {"stochastic": True})()
    config = {"lr": 0.05, "momentum": 0.5, "weight_decay": 1e-5, "hidden": 16, "dropout": 0.2}
    array = FusedArray(workload, [(j, {**config, "seed": j}) for j in range(3)])
    for batch in array.epoch_inputs(0, 0, 3):
        array.train_step(batch)
    assert all(group.stochastic for group in array.groups)  # each member reseeded per step
    assert captured == []
