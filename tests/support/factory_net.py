"""A plugin's model module, apart from its workload's: a factory that sets the module's
``SCALE`` for some trials only, and the model whose forward reads it.
(:mod:`tests.worker.test_fresh_builds` imports the factory, not this module.)"""

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


def make_net(scale: float) -> nn.Module:
    """The model; ``SCALE`` set only where ``scale`` is not the default."""
    global SCALE
    if scale != 1.0:
        SCALE = scale
    return Net()
