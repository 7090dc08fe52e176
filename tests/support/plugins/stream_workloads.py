"""Plugin workloads beyond in-memory ``(x, y)`` tensors, installed as a user would install
them (entry points): data streamed from files through a ``DataLoader``, batches that differ
per trial, a custom per-batch step with several inputs and outputs, a step vmap cannot
batch, and a BatchNorm model (gradients of float rounding, seen in training: no probe runs on
streamed data).

The images are written by the test (:func:`write_image_folder`): 1x8x8 pictures of four
classes (a bright row, column, diagonal or anti-diagonal, in noise), one ``.npy`` file
each, the label in the file's name. The folder is the structural parameter ``root``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from packtune.workloads.base import OPTIMIZER_PARAMS, Split, Workload, epoch_generator

N_TRAIN, N_VAL, CLASSES = 2400, 600, 4


def write_image_folder(root: Path, n_train: int = N_TRAIN, n_val: int = N_VAL) -> Path:
    """``root/train`` and ``root/val``: one ``{index}_{label}.npy`` file per 8x8 image."""
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        (root / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            label = int(rng.integers(CLASSES))
            image = rng.normal(0.0, 0.6, size=(8, 8)).astype(np.float32)
            pattern = np.zeros((8, 8), dtype=np.float32)
            k = int(rng.integers(8))
            if label == 0:
                pattern[k] = 1.0
            elif label == 1:
                pattern[:, k] = 1.0
            elif label == 2:
                np.fill_diagonal(pattern, 1.0)
            else:
                np.fill_diagonal(pattern[:, ::-1], 1.0)
            np.save(root / split / f"{i:05d}_{label}.npy", image + pattern)
    return root


class ImageFiles(Dataset[Any]):
    """The ``.npy`` images of one split; ``augment``: a seed for per-example flips and noise."""

    def __init__(self, root: str, split: str, augment: int | None = None) -> None:
        self.files = sorted((Path(root) / split).glob("*.npy"))
        if not self.files:
            raise FileNotFoundError(f"no .npy images under {Path(root) / split}")
        self.augment = augment

    def __len__(self) -> int:
        return len(self.files)

    def image(self, i: int) -> tuple[torch.Tensor, int]:
        path = self.files[i]
        image = torch.from_numpy(np.load(path)).unsqueeze(0)
        if self.augment is not None:
            gen = torch.Generator().manual_seed(self.augment * 7919 + i)
            if bool(torch.rand((), generator=gen) < 0.5):
                image = image.flip(-1)
            image = image + 0.1 * torch.randn(image.shape, generator=gen)
        return image, int(path.stem.split("_")[1])

    def __getitem__(self, i: int) -> Any:
        return self.image(i)


class FolderImages(Workload):
    """An MLP on 8x8 images read from files by a DataLoader (one loader per array)."""

    name = "folder-images"
    params: Mapping[str, Any] = {"root": "", "hidden": 32, "batch_size": 64, **OPTIMIZER_PARAMS}
    reports = {"val_accuracy": "max"}
    workers = 1  # the loader reads in a worker process of its own

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        hidden = int(self.resolve(config)["hidden"])
        return nn.Sequential(
            nn.Flatten(), nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, CLASSES)
        )

    def dataset(self, config: Mapping[str, Any], split: str, epoch: int | None) -> Dataset[Any]:
        return ImageFiles(str(config["root"]), split)

    def generator(self, config: Mapping[str, Any], epoch: int) -> torch.Generator:
        return epoch_generator(config, epoch)  # type: ignore[no-any-return]

    def train_batches(self, config: Mapping[str, Any], epoch: int) -> Iterable[Any]:
        cfg = self.resolve(config)
        return DataLoader(
            self.dataset(cfg, "train", epoch), batch_size=int(cfg["batch_size"]), shuffle=True,
            drop_last=True, generator=self.generator(cfg, epoch), num_workers=self.workers,
        )  # fmt: skip

    def val_batches(self, config: Mapping[str, Any]) -> Iterable[Any]:
        cfg = self.resolve(config)
        return DataLoader(self.dataset(cfg, "val", None), batch_size=100)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return {"val_accuracy": float((outputs.argmax(-1) == targets).float().mean())}

    def train_size(self, config: Mapping[str, Any]) -> int:
        """The images in the folder's ``train`` (the test decides how many it writes)."""
        return _count(str(self.resolve(config)["root"]))


@functools.cache
def _count(root: str) -> int:
    return len(list((Path(root) / "train").glob("*.npy"))) if root else N_TRAIN


class AugmentedImages(FolderImages):
    """Each trial its own batch order and augmentation (flips, noise), seeded by its seed."""

    name = "augmented-images"
    per_member_batches = True
    workers = 0  # one loader per member: read in the training process

    def dataset(self, config: Mapping[str, Any], split: str, epoch: int | None) -> Dataset[Any]:
        if epoch is None:
            return ImageFiles(str(config["root"]), split)
        seed = int(epoch_generator(config, epoch, per_trial=True).initial_seed())
        return ImageFiles(str(config["root"]), split, augment=seed % 2**31)

    def generator(self, config: Mapping[str, Any], epoch: int) -> torch.Generator:
        return epoch_generator(config, epoch, per_trial=True)  # type: ignore[no-any-return]


class BatchNormNet(nn.Module):
    """Flatten, Linear, BatchNorm, ReLU, Linear: a module of its own class (stacked through
    vmap, not the hand-fused path); trained with Adam, the first Linear's bias gradient is
    float rounding (the BatchNorm cancels it)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
            nn.Linear(hidden, CLASSES),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


class BatchNormImages(FolderImages):
    """:class:`FolderImages` with a BatchNorm after its hidden Linear, read in this process."""

    name = "batch-norm-images"
    workers = 0

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        return BatchNormNet(int(self.resolve(config)["hidden"]))


class CountingNet(nn.Module):
    """:class:`BatchNormNet` without the BatchNorm, whose training forward counts its steps
    (a Python counter) and scales its input by them, as a warm-up might."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(),
                                 nn.Linear(hidden, CLASSES))  # fmt: skip
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
            x = x * (1.0 + 4.0 / (1.0 + self.steps))
        return self.net(x)  # type: ignore[no-any-return]


class CountingImages(BatchNormImages):
    """:class:`FolderImages` with a step-counting model (stacked through vmap)."""

    name = "counting-images"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        return CountingNet(int(self.resolve(config)["hidden"]))


class TwoHeads(nn.Module):
    """A trunk and two heads: class logits and the image's mean brightness; it also gives
    the trial's loss weight, carried as a buffer so that it may differ inside an array."""

    def __init__(self, hidden: int, aux_weight: float) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU())
        self.classes = nn.Linear(hidden, CLASSES)
        self.brightness = nn.Linear(hidden, 1)
        self.register_buffer("aux_weight", torch.tensor(aux_weight))

    def forward(self, image: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.trunk(image * scale.view(-1, 1, 1, 1))
        return self.classes(h), self.brightness(h).squeeze(-1), self.aux_weight


class DictImages(Dataset[Any]):
    def __init__(self, files: ImageFiles) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        image, label = self.files.image(i)
        return {"image": image, "scale": torch.tensor(1.0), "label": label,
                "brightness": image.mean()}  # fmt: skip


class MultiTask(FolderImages):
    """A custom per-batch step: dict batches, a model of two inputs and two outputs, the
    loss a weighted sum of a classification and a regression loss."""

    name = "multi-task"
    workers = 0
    params: Mapping[str, Any] = {**FolderImages.params, "aux_weight": 0.5}
    fusible = frozenset({"aux_weight"})  # a per-trial tensor of the model (a buffer)

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        cfg = self.resolve(config)
        return TwoHeads(int(cfg["hidden"]), float(cfg["aux_weight"]))

    def dataset(self, config: Mapping[str, Any], split: str, epoch: int | None) -> Dataset[Any]:
        return DictImages(ImageFiles(str(config["root"]), split))

    def training_loss(self, model: Callable[..., Any], batch: Any) -> torch.Tensor:
        logits, brightness, weight = model(batch["image"], batch["scale"])
        classify = F.cross_entropy(logits, batch["label"])
        return classify + weight * F.mse_loss(brightness, batch["brightness"])

    def validation_metrics(self, model: Callable[..., Any], batch: Any) -> dict[str, Any]:
        logits, brightness, _ = model(batch["image"], batch["scale"])
        return {
            "val_loss": F.cross_entropy(logits, batch["label"]),
            "val_accuracy": (logits.argmax(-1) == batch["label"]).float().mean(),
            "val_brightness_mse": F.mse_loss(brightness, batch["brightness"]),
        }


class Unbatchable(Workload):
    """In-memory data and a custom step whose Python control flow reads a tensor's value,
    which vmap cannot batch: a fused array must train its members one at a time."""

    name = "unbatchable"
    params: Mapping[str, Any] = {"hidden": 16, "batch_size": 50, **OPTIMIZER_PARAMS}

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        hidden = int(self.resolve(config)["hidden"])
        return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(600, 8, generator=gen)
        y = (x[:, :4].sum(1) - x[:, 4:].prod(1)).unsqueeze(1)
        return Split(x[:500].to(device), y[:500].to(device)), Split(
            x[500:].to(device), y[500:].to(device)
        )

    def training_loss(self, model: Callable[..., Any], batch: Any) -> torch.Tensor:
        x, y = batch
        err = model(x) - y
        if float(err.detach().abs().max()) > 3.0:  # vmap cannot batch this: a value read in Python
            return F.huber_loss(model(x), y)
        return (err**2).mean()

    def validation_metrics(self, model: Callable[..., Any], batch: Any) -> dict[str, Any]:
        x, y = batch
        return {"val_loss": F.mse_loss(model(x), y)}

    def train_size(self, config: Mapping[str, Any]) -> int:
        return 500
