"""scikit-learn's 8x8 handwritten digits: an MLP and a small CNN.

The data ship inside scikit-learn (no download). Pixels are scaled to [0, 1];
the train/validation split is stratified and fixed (seed 0), the same for
every study and every trial, so trials are compared on the same examples.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from worker.workloads._common import ClassificationWorkload, activation, device_name, positive_int
from worker.workloads.base import OPTIMIZER_PARAMS, OPTIMIZER_STRUCTURAL, Split

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

N_EXAMPLES = 1797  # size of sklearn.datasets.load_digits
N_VAL = 360  # 20%, rounded up
N_TRAIN = N_EXAMPLES - N_VAL
N_CLASSES = 10
SPLIT_SEED = 0


@functools.cache
def _digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_val, y_val) as numpy arrays; features in [0, 1]."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    x_train, x_val, y_train, y_val = train_test_split(
        x, y, test_size=N_VAL, stratify=y, random_state=SPLIT_SEED
    )
    return x_train, y_train, x_val, y_val


@functools.lru_cache(maxsize=4)
def digits_splits(device: str) -> tuple[Split, Split]:
    """Flat (64-feature) train and validation splits on ``device``, loaded once per device.

    The tensors are shared by every caller: treat them as read-only.
    """
    import torch

    x_train, y_train, x_val, y_val = _digits_arrays()
    return (
        Split(torch.from_numpy(x_train).to(device), torch.from_numpy(y_train).to(device)),
        Split(torch.from_numpy(x_val).to(device), torch.from_numpy(y_val).to(device)),
    )


class DigitsMLP(ClassificationWorkload):
    """MLP on the 8x8 digits (64 features, 10 classes).

    The model is a plain ``nn.Sequential`` of Linear, optional BatchNorm1d,
    activation and optional Dropout per hidden layer, then a Linear head, so
    that a hand-fused path can recognise its layers. ``dropout`` is
    structural: a Dropout layer is present only when it is above 0, and its
    rate is a Python float, not a per-trial tensor.
    """

    name = "digits-mlp"
    params: Mapping[str, Any] = {
        "hidden": 64,
        "layers": 2,
        "batch_norm": False,
        "dropout": 0.0,
        "activation": "relu",
        "batch_size": 64,
        **OPTIMIZER_PARAMS,
    }
    structural = frozenset(
        {"hidden", "layers", "batch_norm", "dropout", "activation", "batch_size"}
    ) | OPTIMIZER_STRUCTURAL

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        from torch import nn

        cfg = self.resolve(config)
        hidden = positive_int(cfg, "hidden")
        layers = positive_int(cfg, "layers", minimum=0)
        dropout = float(cfg["dropout"])
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), not {dropout}")
        modules: list[nn.Module] = []
        width = 64
        for _ in range(layers):
            modules.append(nn.Linear(width, hidden))
            if cfg["batch_norm"]:
                modules.append(nn.BatchNorm1d(hidden))
            modules.append(activation(str(cfg["activation"])))
            if dropout > 0:
                modules.append(nn.Dropout(dropout))
            width = hidden
        modules.append(nn.Linear(width, N_CLASSES))
        return nn.Sequential(*modules)

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        self.resolve(config)
        return digits_splits(device_name(device))

    def train_size(self, config: Mapping[str, Any]) -> int:
        return N_TRAIN


class DigitsCNN(ClassificationWorkload):
    """Small CNN on the digits as 1x8x8 images.

    conv3x3(1->channels) -> [bn] -> relu -> conv3x3(channels->2*channels) ->
    [bn] -> relu -> maxpool2 -> linear(2*channels*4*4 -> 10), as one
    ``nn.Sequential``.
    """

    name = "digits-cnn"
    params: Mapping[str, Any] = {
        "channels": 16,
        "batch_norm": False,
        "batch_size": 64,
        **OPTIMIZER_PARAMS,
    }
    structural = frozenset({"channels", "batch_norm", "batch_size"}) | OPTIMIZER_STRUCTURAL

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        from torch import nn

        cfg = self.resolve(config)
        channels = positive_int(cfg, "channels")
        bn = bool(cfg["batch_norm"])

        def conv_block(c_in: int, c_out: int) -> list[nn.Module]:
            block: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, padding=1)]
            if bn:
                block.append(nn.BatchNorm2d(c_out))
            block.append(nn.ReLU())
            return block

        return nn.Sequential(
            *conv_block(1, channels),
            *conv_block(channels, 2 * channels),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * channels * 4 * 4, N_CLASSES),
        )

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        self.resolve(config)
        train, val = digits_splits(device_name(device))
        return (
            Split(train.x.view(-1, 1, 8, 8), train.y),
            Split(val.x.view(-1, 1, 8, 8), val.y),
        )

    def train_size(self, config: Mapping[str, Any]) -> int:
        return N_TRAIN
