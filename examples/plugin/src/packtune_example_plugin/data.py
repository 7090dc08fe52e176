"""The torch parts of ``rings-files``: imported inside its methods, never at the plugin's
import (the API and the scheduler list workloads without loading torch). Module-level
classes, so that DataLoader workers started by spawn or forkserver can pickle them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


class RingPoints(Dataset[dict[str, Any]]):
    """One ``{index}_{label}.npy`` point per file: a dict batch of point, label, radius."""

    def __init__(self, folder: Path) -> None:
        self.files = sorted(folder.glob("*.npy"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        point = torch.from_numpy(np.load(self.files[i]))
        label = int(self.files[i].stem.split("_")[1])
        return {"point": point, "label": label, "radius": point.norm()}


class TwoHeads(nn.Module):
    """A trunk, a ring head and a radius head; returns the trial's loss weight too."""

    def __init__(self, hidden: int, aux_weight: float) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, hidden))
        self.ring, self.radius = nn.Linear(hidden, 2), nn.Linear(hidden, 1)
        self.register_buffer("aux_weight", torch.tensor(aux_weight))

    def forward(self, point: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(self.trunk(point))
        return self.ring(h), self.radius(h).squeeze(-1), self.aux_weight
