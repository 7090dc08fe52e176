"""An example packtune workload: an MLP that tells two noisy concentric rings apart.

The data are made here from a fixed seed (nothing to download). Copy this package, rename
it, and replace the model and the data with yours; docs/workloads.md in packtune's
repository explains each rule.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from packtune import OPTIMIZER_PARAMS, Split, Workload

N_TRAIN, N_VAL = 2048, 512


@functools.lru_cache(maxsize=4)
def rings(device: str) -> tuple[Split, Split]:
    """Points on two rings (radius 1 and 2) with Gaussian noise; label = the ring. Made once
    per process and device, the same for every trial (torch imported here, not at import)."""
    import torch

    gen = torch.Generator().manual_seed(1234)

    def split(n: int) -> Split:
        label = torch.randint(0, 2, (n,), generator=gen)
        angle = 2 * torch.pi * torch.rand(n, generator=gen)
        radius = 1.0 + label.float() + 0.25 * torch.randn(n, generator=gen)
        x = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
        return Split(x.to(device), label.to(device))

    return split(N_TRAIN), split(N_VAL)


class RingsMLP(Workload):
    """MLP telling two noisy concentric rings apart (an example plugin)."""

    name = "rings-mlp"
    params: Mapping[str, Any] = {
        "hidden": 32, "layers": 2, "activation": "tanh", "batch_size": 64, **OPTIMIZER_PARAMS,
    }  # fmt: skip
    # Everything not fusible is structural anyway; listing it documents the intent.
    structural = frozenset({"hidden", "layers", "activation", "batch_size"})
    reports = {"val_accuracy": "max"}
    bounds = {"hidden": (1, 4096), "layers": (1, 16), "batch_size": (1, N_TRAIN)}

    def build_model(self, config: Mapping[str, Any]) -> Any:
        from torch import nn

        cfg = self.resolve(config)
        act = {"tanh": nn.Tanh, "relu": nn.ReLU}[str(cfg["activation"])]
        width, modules = 2, []
        for _ in range(int(cfg["layers"])):
            modules += [nn.Linear(width, int(cfg["hidden"])), act()]
            width = int(cfg["hidden"])
        return nn.Sequential(*modules, nn.Linear(width, 2))

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        import torch

        self.resolve(config)
        return rings(str(torch.device(device)))

    def loss(self, outputs: Any, targets: Any) -> Any:
        import torch.nn.functional as F

        return F.cross_entropy(outputs, targets)

    def metrics(self, outputs: Any, targets: Any) -> dict[str, float]:
        return {"val_accuracy": float((outputs.argmax(-1) == targets).float().mean())}

    def train_size(self, config: Mapping[str, Any]) -> int:
        return N_TRAIN
