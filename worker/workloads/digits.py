"""scikit-learn's 8x8 handwritten digits: an MLP and a small CNN.

The data ship inside scikit-learn (no download): they are read from its
``digits.csv.gz`` with numpy, without importing scikit-learn (~1.3 s of the
first load). Pixels are scaled to [0, 1]; the train/validation split is
stratified and fixed (scikit-learn's seed-0 split, kept in ``digits_split``),
the same for every study and every trial, so trials are compared on the same
examples.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packtune.workloads.base import OPTIMIZER_PARAMS, OPTIMIZER_STRUCTURAL, Split
from worker.workloads.parts import (
    ACTIVATIONS,
    ClassificationWorkload,
    activation,
    builds_own_model,
    device_name,
    positive_int,
)

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

N_EXAMPLES = 1797  # size of sklearn.datasets.load_digits
N_VAL = 360  # 20%, rounded up
N_TRAIN = N_EXAMPLES - N_VAL
N_CLASSES = 10
SPLIT_SEED = 0


def _digits_csv() -> Path | None:
    """scikit-learn's ``digits.csv.gz``, found without importing scikit-learn; None if absent."""
    spec = importlib.util.find_spec("sklearn")  # finds the package, does not run it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def load_digits_table() -> np.ndarray:
    """The 1797 x 65 table of scikit-learn's digits (64 pixels in 0..16, then the label)."""
    import numpy as np

    path = _digits_csv()
    if path is None:  # an unusual scikit-learn layout: let it read its own file
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        return np.column_stack([x, y]).astype(np.float64)
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float64)
    if table.shape != (N_EXAMPLES, 65):
        raise ValueError(f"{path}: expected {N_EXAMPLES} rows of 65 values, got {table.shape}")
    return table


@functools.cache
def _digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_val, y_val) as numpy arrays; features in [0, 1]."""
    import numpy as np

    from worker.workloads.digits_split import TRAIN, VAL

    table = load_digits_table()
    x = (table[:, :-1] / 16.0).astype(np.float32)
    y = table[:, -1].astype(np.int64)
    train, val = np.asarray(TRAIN), np.asarray(VAL)
    return x[train], y[train], x[val], y[val]


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
    structural = (
        frozenset({"hidden", "layers", "batch_norm", "dropout", "activation", "batch_size"})
        | OPTIMIZER_STRUCTURAL
    )
    bounds: Mapping[str, tuple[float, float]] = {
        "hidden": (1, 65_536), "layers": (0, 64), "dropout": (0, 0.999),
        "batch_size": (1, N_TRAIN),
    }  # fmt: skip
    choices: Mapping[str, Sequence[Any]] = {"activation": ACTIVATIONS}

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

    def max_segments(self, config: Mapping[str, Any]) -> int | None:
        """A Linear (and with ``batch_norm`` a BatchNorm1d) per hidden layer, and the head."""
        if not builds_own_model(self, DigitsMLP):
            return None
        cfg = self.resolve(config)
        return int(cfg["layers"]) * (2 if cfg["batch_norm"] else 1) + 1

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        self.resolve(config)
        return digits_splits(device_name(device))

    def train_size(self, config: Mapping[str, Any]) -> int:
        return N_TRAIN


class DigitsCNN(ClassificationWorkload):
    """Small CNN on the digits as 1x8x8 images.

    conv3x3(1->channels) -> [bn] -> relu -> conv3x3(channels->2*channels) ->
    [bn] -> relu -> maxpool2 -> [dropout] -> linear(2*channels*4*4 -> 10), as one
    ``nn.Sequential``. ``dropout`` is structural, its Dropout layer present only above 0.
    """

    name = "digits-cnn"
    params: Mapping[str, Any] = {
        "channels": 16,
        "batch_norm": False,
        "dropout": 0.0,
        "batch_size": 64,
        **OPTIMIZER_PARAMS,
    }
    structural = (
        frozenset({"channels", "batch_norm", "dropout", "batch_size"}) | OPTIMIZER_STRUCTURAL
    )
    bounds: Mapping[str, tuple[float, float]] = {
        "channels": (1, 4096), "dropout": (0, 0.999), "batch_size": (1, N_TRAIN),
    }  # fmt: skip

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        from torch import nn

        cfg = self.resolve(config)
        channels = positive_int(cfg, "channels")
        bn = bool(cfg["batch_norm"])
        dropout = float(cfg["dropout"])
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), not {dropout}")

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
            *([nn.Dropout(dropout)] if dropout > 0 else []),
            nn.Linear(2 * channels * 4 * 4, N_CLASSES),
        )

    def max_segments(self, config: Mapping[str, Any]) -> int | None:
        """Two convolutions (each with its BatchNorm2d, with ``batch_norm``) and the head."""
        if not builds_own_model(self, DigitsCNN):
            return None
        return 5 if self.resolve(config)["batch_norm"] else 3

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        self.resolve(config)
        train, val = digits_splits(device_name(device))
        return (
            Split(train.x.view(-1, 1, 8, 8), train.y),
            Split(val.x.view(-1, 1, 8, 8), val.y),
        )

    def train_size(self, config: Mapping[str, Any]) -> int:
        return N_TRAIN
