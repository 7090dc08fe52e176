"""Tiny test-only workloads: an MLP and a CNN on seeded random data.

They are built on :class:`packtune.workloads.base.Workload` like the built-ins,
small enough that a test trains a fused array in milliseconds, and default to
float64 so fused and plain runs can be compared to tight tolerances.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from packtune.workloads.base import OPTIMIZER_PARAMS, Split, Workload

CLASSES = 3


def _dtype(config: Mapping[str, Any]) -> torch.dtype:
    return getattr(torch, str(config["dtype"]))


def _classification(shape: tuple[int, ...], n: int, seed: int, dtype: torch.dtype) -> Split:
    """Seeded inputs with labels from a fixed random linear map (learnable, not trivial)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    w = torch.randn(
        x[0].numel(), CLASSES, generator=torch.Generator().manual_seed(7), dtype=torch.float64
    )
    y = (x.flatten(1) @ w).argmax(1)
    return Split(x.to(dtype), y)


class _Tiny(Workload):
    """Shared data, loss and metrics of the tiny workloads."""

    input_shape: tuple[int, ...]
    sizes = (96, 40)  # train, validation examples

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        cfg = self.resolve(config)
        train, val = (
            _classification(self.input_shape, n, seed, _dtype(cfg))
            for n, seed in zip(self.sizes, (1, 2), strict=True)
        )
        return (
            Split(train.x.to(device), train.y.to(device)),
            Split(val.x.to(device), val.y.to(device)),
        )

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return {"val_accuracy": float((outputs.argmax(1) == targets).double().mean())}

    def train_size(self, config: Mapping[str, Any]) -> int:
        return self.sizes[0]


class TinyMLP(_Tiny):
    """MLP on 8 features: Linear [BatchNorm1d] ReLU [Dropout] per hidden layer."""

    name = "tiny-mlp"
    input_shape = (8,)
    structural = frozenset(
        {
            "hidden",
            "layers",
            "batch_norm",
            "dropout",
            "batch_size",
            "optimizer",
            "nesterov",
            "dtype",
        }
    )
    params = {
        **OPTIMIZER_PARAMS,
        "hidden": 16,
        "layers": 2,
        "batch_norm": False,
        "dropout": 0.0,
        "batch_size": 16,
        "dtype": "float64",
    }

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        cfg = self.resolve(config)
        layers: list[nn.Module] = []
        width = self.input_shape[0]
        for _ in range(int(cfg["layers"])):
            layers.append(nn.Linear(width, int(cfg["hidden"])))
            if cfg["batch_norm"]:
                layers.append(nn.BatchNorm1d(int(cfg["hidden"])))
            layers.append(nn.ReLU())
            if cfg["dropout"]:
                layers.append(nn.Dropout(float(cfg["dropout"])))
            width = int(cfg["hidden"])
        layers.append(nn.Linear(width, CLASSES))
        return nn.Sequential(*layers).to(_dtype(cfg))


class TinyCNN(_Tiny):
    """Conv [BatchNorm2d] ReLU MaxPool, then Linear, on 1x6x6 inputs."""

    name = "tiny-cnn"
    input_shape = (1, 6, 6)
    structural = frozenset(
        {"channels", "batch_norm", "batch_size", "optimizer", "nesterov", "dtype"}
    )
    params = {
        **OPTIMIZER_PARAMS,
        "channels": 4,
        "batch_norm": False,
        "batch_size": 16,
        "dtype": "float64",
    }

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        cfg = self.resolve(config)
        c = int(cfg["channels"])
        layers: list[nn.Module] = [nn.Conv2d(1, c, 3, padding=1)]
        if cfg["batch_norm"]:
            layers.append(nn.BatchNorm2d(c))
        layers += [nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(c * 9, CLASSES)]
        return nn.Sequential(*layers).to(_dtype(cfg))


class Ramp(nn.Module):
    """A warm-up over ``steps`` training forwards, kept as a Python counter on the module
    (state a checkpoint does not hold, which packing must not share between trials)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps, self.calls = steps, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return x * min(1.0, self.calls / self.steps)
