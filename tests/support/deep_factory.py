"""A plugin's model factory that sets a global of another of its modules
(:mod:`tests.support.deep_layers`) for some trials only."""

from __future__ import annotations

from torch import nn

from tests.support import deep_layers


def make_deep_net(scale: float) -> nn.Module:
    """The model; ``deep_layers.SCALE`` set only where ``scale`` is not the default."""
    if scale != 1.0:
        deep_layers.SCALE = scale
    return deep_layers.Net()
