"""A plugin whose trials fail for some configs, as a user's buggy workload would: an odd
``hidden`` raises in ``build_model``."""

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
