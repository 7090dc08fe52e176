"""Workloads whose model comes from a factory of another module of their package
(:mod:`tests.support.factory_net`), imported as a function, not as a module: the factory sets
that module's ``SCALE`` for some trials only; or sets a third module's
(:mod:`tests.support.deep_factory`, :mod:`tests.support.deep_layers`)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from torch import nn

from tests.support.deep_factory import make_deep_net
from tests.support.factory_net import make_net
from tests.support.tiny_workloads import TinyMLP


class FactoryGlobal(TinyMLP):
    name = "factory-global"
    params = {**TinyMLP.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        return make_net(float(self.resolve(config)["scale"])).double()

    def fresh(self) -> None:
        """Put ``SCALE`` where a fresh process has it."""
        importlib.import_module("tests.support.factory_net").SCALE = 1.0


class DeepFactoryGlobal(FactoryGlobal):
    """The same through a factory whose module sets a global of a third module, which this
    module does not import."""

    name = "deep-factory-global"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        return make_deep_net(float(self.resolve(config)["scale"])).double()

    def fresh(self) -> None:
        importlib.import_module("tests.support.deep_layers").SCALE = 1.0
