"""A plugin's layers module, two imports away from its workload's: the workload's module
imports a factory from :mod:`tests.support.deep_factory`, which imports this module and sets
its ``SCALE`` for some trials only. Nothing else imports it."""

from __future__ import annotations

import torch
from torch import nn

SCALE = 1.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * SCALE)
