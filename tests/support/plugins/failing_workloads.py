"""A plugin whose trials fail for some configs, as a user's buggy workload would: an odd
``hidden`` raises in ``build_model``; and two whose ``metrics()`` return tensors, one of a
single element (a number: it is taken as one) and one of two (not a number)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from trap_workloads import HiddenActMLP  # type: ignore[import-not-found]


class OddFails(HiddenActMLP):
    """The trap MLP, but an odd width is refused with the user's own error."""

    name = "odd-fails"
    params: Mapping[str, Any] = {**HiddenActMLP.params, "width": 8}

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        width = int(self.resolve(config)["width"])
        if width % 2:
            raise ValueError(f"this layer needs an even width, got {width}")
        return super().build_model(config)


class TensorMetrics(HiddenActMLP):
    """Its accuracy as a 0-d tensor, as ``(pred == y).float().mean()`` gives it."""

    name = "tensor-metrics"

    def metrics(self, outputs: Any, targets: Any) -> dict[str, Any]:
        return {"accuracy": (outputs.argmax(-1) == targets).float().mean()}


class ShapedMetrics(HiddenActMLP):
    """Its per-class counts of two classes as one metric: not a number."""

    name = "shaped-metrics"

    def metrics(self, outputs: Any, targets: Any) -> dict[str, Any]:
        return {"accuracy": (outputs.argmax(-1)[:2] == targets[:2]).float()}


class ListModel(HiddenActMLP):
    """Its build_model returns the layers as a list."""

    name = "list-model"

    def build_model(self, config: Mapping[str, Any]) -> Any:
        return list(super().build_model(config))


class TupleData(HiddenActMLP):
    """Its data() returns (x, y) pairs, not Splits."""

    name = "tuple-data"

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> Any:
        train, val = super().data(config, device)
        return (train.x, train.y), (val.x, val.y)


class FloatTrainSize(HiddenActMLP):
    """Its train_size() is a product of a float."""

    name = "float-train-size"

    def train_size(self, config: Mapping[str, Any]) -> Any:
        return super().train_size(config) * 0.9
