"""A small ResNet on CIFAR-10, or on seeded CIFAR-shaped tensors where there is none.

Real data: the python version of CIFAR-10 (``cifar-10-batches-py`` with
``data_batch_1`` ... ``data_batch_5`` and ``test_batch``) inside the
settings' ``data_dir`` (``PACKTUNE_DATA_DIR``). It is never downloaded. The
batches are pickles, so ``data_dir`` must be a folder the operator trusts.
The first ``n_train`` training images and the first ``n_val`` test images
are used, normalised per channel.

Otherwise: ``n_train`` + ``n_val`` Gaussian 3x32x32 images from fixed
seeds, labelled by a fixed random projection of their 4x4-pooled pixels, so
that there is something to learn.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packtune.workloads.base import OPTIMIZER_PARAMS, OPTIMIZER_STRUCTURAL, Split
from worker.workloads.parts import (
    ClassificationWorkload,
    builds_own_model,
    device_name,
    positive_int,
)

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
N_CLASSES = 10
RANDOM_DATA_SEED = 31_337


def cifar_root() -> Path | None:
    """The CIFAR-10 python folder under the settings' ``data_dir``, if it is there."""
    from packtune.settings import get_settings

    data_dir = get_settings().data_dir
    if data_dir is None:
        return None
    root = Path(data_dir) / CIFAR_FOLDER
    if (root / "test_batch").is_file() and any(root.glob("data_batch_*")):
        return root
    return None


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    with path.open("rb") as f:
        batch = pickle.load(f, encoding="bytes")
    data = batch[b"data"] if b"data" in batch else batch["data"]
    labels = batch[b"labels"] if b"labels" in batch else batch["labels"]
    images = np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32)
    return images, np.asarray(labels, dtype=np.int64)


@functools.lru_cache(maxsize=2)
def cifar_arrays(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels); images uint8 N x 3 x 32 x 32."""
    import numpy as np

    paths = sorted(root.glob("data_batch_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    parts = [_read_batch(p) for p in paths]
    x_test, y_test = _read_batch(root / "test_batch")
    return (
        np.concatenate([x for x, _ in parts]),
        np.concatenate([y for _, y in parts]),
        x_test,
        y_test,
    )


@functools.lru_cache(maxsize=4)
def cifar_splits(root: Path | None, n_train: int, n_val: int, device: str) -> tuple[Split, Split]:
    """Train and validation splits (real when ``root`` is given), built once per process."""
    import torch

    if root is not None:
        x_train, y_train, x_test, y_test = cifar_arrays(root)
        mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)

        def real(x: np.ndarray, y: np.ndarray, n: int) -> Split:
            images = (torch.from_numpy(x[:n]).float() / 255.0 - mean) / std
            return Split(images.to(device), torch.from_numpy(y[:n]).to(device))

        return real(x_train, y_train, n_train), real(x_test, y_test, n_val)

    projection = torch.randn(
        3 * 4 * 4, N_CLASSES, generator=torch.Generator().manual_seed(RANDOM_DATA_SEED)
    )

    def fake(stream: int, n: int) -> Split:
        gen = torch.Generator().manual_seed(RANDOM_DATA_SEED + stream)
        images = torch.randn(n, 3, 32, 32, generator=gen)
        pooled = torch.nn.functional.avg_pool2d(images, 8).flatten(1)
        return Split(images.to(device), (pooled @ projection).argmax(dim=1).to(device))

    return fake(1, n_train), fake(2, n_val)


class ResNetCifar(ClassificationWorkload):
    """Small ResNet (BatchNorm) on CIFAR-10, or on seeded random 3x32x32 images."""

    name = "resnet-cifar"
    params: Mapping[str, Any] = {
        "width": 16,
        "blocks": 1,
        "n_train": 5000,
        "n_val": 1000,
        "batch_size": 128,
        **OPTIMIZER_PARAMS,
    }
    structural = frozenset({"width", "blocks", "n_train", "n_val", "batch_size"}) | (
        OPTIMIZER_STRUCTURAL
    )
    bounds: Mapping[str, tuple[float, float]] = {
        "width": (1, 1024), "blocks": (1, 64), "n_train": (1, 50_000), "n_val": (1, 10_000),
        "batch_size": (1, 50_000),
    }  # fmt: skip

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        from worker.workloads.resnet_model import ResNet

        cfg = self.resolve(config)
        return ResNet(positive_int(cfg, "width"), positive_int(cfg, "blocks"), N_CLASSES)

    def max_segments(self, config: Mapping[str, Any]) -> int | None:
        # a ResNet module (its blocks add shortcuts), not a plain nn.Sequential
        return 0 if builds_own_model(self, ResNetCifar) else None

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        cfg = self.resolve(config)
        root = cifar_root()
        n_train, n_val = self._sizes(cfg, root)
        return cifar_splits(root, n_train, n_val, device_name(device))

    def train_size(self, config: Mapping[str, Any]) -> int:
        return self._sizes(self.resolve(config), cifar_root())[0]

    @staticmethod
    def _sizes(cfg: Mapping[str, Any], root: Path | None) -> tuple[int, int]:
        """(n_train, n_val), capped by what the real data hold."""
        n_train, n_val = positive_int(cfg, "n_train"), positive_int(cfg, "n_val")
        if root is None:
            return n_train, n_val
        x_train, _, x_test, _ = cifar_arrays(root)
        return min(n_train, len(x_train)), min(n_val, len(x_test))
