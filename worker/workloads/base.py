"""The workload interface.

A workload says how to build one trial's model from its config, what data it
trains on, how loss and metrics are computed, and how many optimizer steps
make one epoch (the study's resource unit).

This module must stay importable without torch: the API process lists and
validates workloads but never imports torch. Workloads import torch inside
their methods.

Config keys every built-in workload shares (see :data:`OPTIMIZER_PARAMS`):

- ``optimizer`` (structural): ``"sgd"``, ``"adam"`` or ``"adamw"``
- ``nesterov`` (structural): SGD only
- ``batch_size`` (structural)
- ``lr``, ``momentum``, ``weight_decay``, ``beta1``, ``beta2``, ``eps``:
  fusible, per-trial ``[k]`` tensors in a fused array

The worker adds ``seed`` (the trial's own initialisation seed) and
``data_seed`` (shared by every trial of a study, so that an array's members
see the same batches) before calling the workload.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

OPTIMIZERS = ("sgd", "adam", "adamw")

OPTIMIZER_PARAMS: dict[str, Any] = {
    "optimizer": "sgd",
    "nesterov": False,
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
}
OPTIMIZER_STRUCTURAL = frozenset({"optimizer", "nesterov"})

# Keys the worker injects; a study's space may not set them.
RESERVED = frozenset({"seed", "data_seed"})


@dataclass(frozen=True)
class Split:
    """Inputs and targets of one split, already on the target device."""

    x: torch.Tensor
    y: torch.Tensor


class Workload(abc.ABC):
    """Base class of packtune workloads.

    Subclasses set ``name``, ``structural`` and ``params`` as class attributes
    and implement the abstract methods, importing torch inside them.
    """

    name: str
    structural: frozenset[str]
    params: Mapping[str, Any]

    def resolve(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` on top of the defaults; unknown keys raise ``KeyError``."""
        unknown = set(config) - set(self.params) - RESERVED
        if unknown:
            raise KeyError(f"{self.name} does not take parameter(s) {sorted(unknown)}")
        return {**self.params, **config}

    @abc.abstractmethod
    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        """One trial's model; the caller seeds torch with ``config['seed']`` first."""

    @abc.abstractmethod
    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        """(train, validation) tensors; the same for every trial with the same structure."""

    @abc.abstractmethod
    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of one model's ``outputs``; must work under ``torch.func.vmap``."""

    def stacked_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Optional: the ``[k]`` losses of k models' stacked ``outputs`` (``[k, B, ...]``).

        Each must equal ``loss(outputs[i], targets)`` to float rounding. A fused
        array calls this every step; ``None`` (the default) makes it call
        :meth:`loss` per member (or under ``vmap``), which costs a few ops per
        member where one batched call would do.
        """
        return None

    @abc.abstractmethod
    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Extra validation metrics (e.g. ``{"val_accuracy": 0.93}``) for one model."""

    def steps_per_epoch(self, config: Mapping[str, Any]) -> int:
        """Optimizer steps in one epoch: the train split in batches (last partial batch dropped)."""
        cfg = self.resolve(config)
        return max(1, self.train_size(cfg) // int(cfg["batch_size"]))

    @abc.abstractmethod
    def train_size(self, config: Mapping[str, Any]) -> int:
        """Number of training examples (no torch needed)."""

    def batch_indices(self, config: Mapping[str, Any], epoch: int) -> Iterator[torch.Tensor]:
        """Index batches of one epoch: a permutation seeded by ``data_seed`` and ``epoch``."""
        import torch

        cfg = self.resolve(config)
        n, bs = self.train_size(cfg), int(cfg["batch_size"])
        gen = torch.Generator().manual_seed(int(cfg.get("data_seed", 0)) * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=gen)
        for step in range(self.steps_per_epoch(cfg)):
            yield perm[step * bs : (step + 1) * bs]

    def describe(self) -> dict[str, Any]:
        """What ``GET /api/workloads`` shows."""
        return {
            "name": self.name,
            "params": dict(self.params),
            "structural": sorted(self.structural),
            "doc": (self.__doc__ or "").strip().splitlines()[0] if self.__doc__ else "",
        }
