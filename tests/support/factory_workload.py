"""A workload whose model comes from a factory of another module of its package
(:mod:`tests.support.factory_net`), imported as a function, not as a module: the factory sets
that module's ``SCALE`` for some trials only."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from torch import nn

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
