"""A workload that keeps a layer in a module global (so this module imports torch at import,
unlike the trap workloads): ``reset-encoder-mlp``'s build initialises ``ENCODER`` in place,
from the trial's seed (``reset_parameters()``), and its model holds it as a submodule. Each
member's model must start from its own build's weights, not from the last build's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from trap_workloads import _DigitsPlugin

from worker.workloads.digits import N_CLASSES

#: the first layer of every reset-encoder-mlp model, initialised anew by each build
ENCODER = nn.Linear(64, 32)


class _Encoded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.fc2 = ENCODER, nn.Linear(32, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.enc(x)))


class ResetEncoderMLP(_DigitsPlugin):
    """MLP whose first layer is the module's ``ENCODER``, initialised in place per build."""

    name = "reset-encoder-mlp"
    structural = frozenset({"batch_size", "optimizer", "nesterov"})

    def build_model(self, config: Mapping[str, Any]) -> Any:
        self.resolve(config)
        ENCODER.reset_parameters()
        return _Encoded()
