"""A workload of the test package that sets a value of its settings module
(:mod:`tests.support.knobs`) per trial in ``build_model`` and reads it in its forward: a value
kept outside the model, in a module that defines neither the workload's class nor the
model's, as a plugin package's ``config.py`` would."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tests.support import knobs
from tests.support.tiny_workloads import TinyMLP


class _ImportedScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * knobs.SCALE)


class ImportedScaled(TinyMLP):
    """Declares ``scale`` fusible, yet keeps it in ``knobs.SCALE``."""

    name = "imported-scaled"
    params = {**TinyMLP.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        knobs.SCALE = float(self.resolve(config)["scale"])
        return _ImportedScaled().double()
