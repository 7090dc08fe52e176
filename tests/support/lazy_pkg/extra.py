"""Imported inside a forward (:mod:`tests.worker.test_outside_edges`)."""

from __future__ import annotations

import torch


def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 1.5
