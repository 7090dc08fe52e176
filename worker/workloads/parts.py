"""Pieces the built-in workloads share: classification loss and metrics, layers.

Like every module of this package it imports torch only inside functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from packtune.workloads.base import Workload

if TYPE_CHECKING:
    import torch
    from torch import nn

ACTIVATIONS = ("relu", "tanh", "gelu")


def device_name(device: Any) -> str:
    """A canonical string for ``device`` ("cpu", "cuda:0"), usable as a cache key."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def activation(name: str) -> nn.Module:
    """A fresh activation module by name."""
    from torch import nn

    layers: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}
    if name not in layers:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, not {name!r}")
    return layers[name]()


def positive_int(config: Mapping[str, Any], key: str, minimum: int = 1) -> int:
    """``config[key]`` as an int, ``ValueError`` naming the key when below ``minimum``."""
    value = int(config[key])
    if value < minimum:
        raise ValueError(f"{key} must be >= {minimum}, not {value}")
    return value


def builds_own_model(workload: Workload, cls: type[Workload]) -> bool:
    """Whether ``workload`` builds the model of ``cls`` (a subclass may build another one,
    of which ``cls``'s ``max_segments`` knows nothing: it then declares nothing)."""
    return type(workload).build_model is cls.build_model


class ClassificationWorkload(Workload):
    """A workload whose outputs are logits and whose targets are int64 class labels."""

    reports: Mapping[str, str] | None = {"val_accuracy": "max"}

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return F.cross_entropy(outputs, targets)

    def stacked_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return stacked_cross_entropy(outputs, targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return classification_metrics(outputs, targets)

    def class_targets(self, config: Mapping[str, Any]) -> bool:
        return True


def stacked_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(outputs[i], targets)`` for every i of ``[k, B, C]`` logits, in one call."""
    import torch.nn.functional as F

    k, batch = outputs.shape[:2]
    per_example = F.cross_entropy(outputs.flatten(0, 1), targets.repeat(k), reduction="none")
    return per_example.view(k, batch).mean(1)


def classification_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Validation loss and accuracy of one model's logits."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        loss = F.cross_entropy(outputs.float(), targets)
        accuracy = (outputs.argmax(dim=-1) == targets).float().mean()
    return {"val_loss": float(loss), "val_accuracy": float(accuracy)}
