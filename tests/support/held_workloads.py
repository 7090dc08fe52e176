"""Workloads whose ``build_model`` changes, in place, a value kept outside the model: a dict
the model holds too, a settings object, a namespace, a settings object with
``__slots__``, a small tensor, a small NumPy array, a dict of tensors, and
random generators seeded per trial (torch's and Python's) that the training forward draws
from."""

from __future__ import annotations

import random
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from torch import nn

from tests.support.tiny_workloads import TinyMLP

#: a settings dict changed in place per trial; the model holds it as ``self.config`` too
CONFIG: dict[str, float] = {"scale": 1.0}


@dataclass
class Settings:
    scale: float = 1.0


#: a settings object changed per trial (``SETTINGS.scale = ...``)
SETTINGS = Settings()
#: a namespace of settings
OPTIONS = types.SimpleNamespace(scale=1.0)
#: a small tensor filled per trial
FACTOR = torch.ones((), dtype=torch.float64)
#: a small NumPy array filled per trial
FACTORS = numpy.ones(4)


@dataclass(slots=True)
class SlotSettings:
    scale: float = 1.0


#: a settings object with no ``__dict__`` (its class has ``__slots__``), changed per trial
SLOT_SETTINGS = SlotSettings()
#: a dict of tensors (not a plain value): its entry set per trial
PARTS: dict[str, Any] = {"scale": torch.ones((), dtype=torch.float64)}


#: seeded per trial by build_model, drawn from by the training forward (noise)
NOISE = torch.Generator()
#: the same, Python's
COIN = random.Random()


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def scale(self) -> Any:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * self.scale())


class _FromDict(_Base):
    def __init__(self, config: dict[str, float]) -> None:
        super().__init__()
        self.config = config

    def scale(self) -> Any:
        return self.config["scale"]


class _FromSettings(_Base):
    def scale(self) -> Any:
        return SETTINGS.scale


class _FromOptions(_Base):
    def scale(self) -> Any:
        return OPTIONS.scale


class _FromFactor(_Base):
    def scale(self) -> Any:
        return FACTOR


class _FromFactors(_Base):
    def scale(self) -> Any:
        return float(FACTORS.mean())


class _FromSlots(_Base):
    def scale(self) -> Any:
        return SLOT_SETTINGS.scale


class _FromParts(_Base):
    def scale(self) -> Any:
        return PARTS["scale"]


class _FromNoise(_Base):
    def scale(self) -> Any:
        if not self.training:
            return 1.0
        return 1.0 + 0.3 * torch.randn(16, generator=NOISE, dtype=torch.float64)


class _FromCoin(_Base):
    def scale(self) -> Any:
        return 1.0 + 0.3 * COIN.random() if self.training else 1.0


class _Scaled(TinyMLP):
    params = {**TinyMLP.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def scale(self, config: Mapping[str, Any]) -> float:
        return float(self.resolve(config)["scale"])


class DictInPlace(_Scaled):
    name = "dict-in-place"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        CONFIG["scale"] = self.scale(config)
        return _FromDict(CONFIG).double()


class SettingsObject(_Scaled):
    name = "settings-object"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        SETTINGS.scale = self.scale(config)
        return _FromSettings().double()


class OptionsNamespace(_Scaled):
    name = "options-namespace"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        OPTIONS.scale = self.scale(config)
        return _FromOptions().double()


class FactorTensor(_Scaled):
    name = "factor-tensor"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        FACTOR.fill_(self.scale(config))
        return _FromFactor().double()


class FactorArray(_Scaled):
    name = "factor-array"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        FACTORS[:] = self.scale(config)
        return _FromFactors().double()


class SlotsObject(_Scaled):
    name = "slots-object"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        SLOT_SETTINGS.scale = self.scale(config)
        return _FromSlots().double()


class PartsDict(_Scaled):
    name = "parts-dict"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        PARTS["scale"] = torch.tensor(self.scale(config), dtype=torch.float64)
        return _FromParts().double()


class SeededNoise(_Scaled):
    name = "seeded-noise"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        NOISE.manual_seed(int(config["seed"]))
        return _FromNoise().double()


class SeededCoin(_Scaled):
    name = "seeded-coin"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        COIN.seed(int(config["seed"]))
        return _FromCoin().double()


HELD = [DictInPlace, SettingsObject, OptionsNamespace, FactorTensor, FactorArray, SlotsObject,
        PartsDict, SeededNoise, SeededCoin]  # fmt: skip
