"""The digits MLP on data streamed from files through a ``torch.utils.data.DataLoader``.

The same model, examples and split as ``digits-mlp``, but the data set is a folder with
one ``.npy`` file per image (written once, on first use, under the settings' ``data_dir``
or ``~/.cache/packtune``), read by a ``Dataset`` and batched by a ``DataLoader``, as a
real data set that does not fit the device would be. It is the built-in example of the
streaming path (``train_batches``/``val_batches``): nothing but the batches in flight is
on the device, the loader's order comes from :func:`epoch_generator`, and with
``augment`` each image is shifted by up to one pixel, drawn per example from the epoch's
seed (the same shifts whichever process of the loader reads it).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packtune.settings import get_settings
from packtune.workloads.base import batch_order_seed, epoch_generator
from worker.workloads.digits import N_TRAIN, DigitsMLP, _digits_arrays
from worker.workloads.parts import positive_int

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FOLDER = "digits-files-v1"


def files_root() -> Path:
    """The folder of the digits as files, written on first use (atomically: a half-written
    folder is never seen, and workers starting at once each write their own and keep one):
    under the settings' ``data_dir``, or where that cannot be written (a data volume
    mounted read-only, as compose mounts ``/data``) ``~/.cache/packtune``, with a warning."""
    cache = Path.home() / ".cache" / "packtune"
    bases = [Path(d) for d in (get_settings().data_dir,) if d] + [cache]
    for base in bases:
        if (base / FOLDER).is_dir():
            return base / FOLDER
    for base in bases[:-1]:
        try:
            return _write_files(base / FOLDER)
        except OSError as exc:
            log.warning("cannot write the digits files under %s (%s); writing them under %s",
                        base, exc, cache)  # fmt: skip
    return _write_files(cache / FOLDER)


def _write_files(root: Path) -> Path:
    import numpy as np

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER}-", dir=root.parent))
    x_train, y_train, x_val, y_val = _digits_arrays()
    for split, xs, ys in (("train", x_train, y_train), ("val", x_val, y_val)):
        (tmp / split).mkdir()
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            np.save(tmp / split / f"{i:05d}_{int(y)}.npy", x.reshape(8, 8))
    try:
        os.rename(tmp, root)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return root


class DigitFiles:
    """One ``.npy`` image per example, the label in its name (``00042_7.npy``): a map-style
    dataset for a ``DataLoader``. A module-level class, so that it pickles for loader
    workers started by spawn or forkserver; it imports torch only when it reads."""

    def __init__(self, folder: Path, augment_seed: int | None) -> None:
        self.files = sorted(folder.glob("*.npy"))
        self.augment_seed = augment_seed

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import numpy as np
        import torch

        path = self.files[i]
        image = torch.from_numpy(np.load(path))
        if self.augment_seed is not None:
            gen = torch.Generator().manual_seed(self.augment_seed * 4099 + i)
            dy, dx = torch.randint(-1, 2, (2,), generator=gen).tolist()
            image = torch.roll(image, shifts=(dy, dx), dims=(0, 1))
        return image.reshape(64), int(path.stem.split("_")[1])


class DigitsFiles(DigitsMLP):
    """The digits MLP, its data streamed from one file per image by a DataLoader."""

    name = "digits-files"
    params: Mapping[str, Any] = {
        **DigitsMLP.params,
        "augment": False,
        "loader_workers": 0,
    }
    structural = DigitsMLP.structural | {"augment", "loader_workers"}
    bounds: Mapping[str, tuple[float, float]] = {**DigitsMLP.bounds, "loader_workers": (0, 64)}

    def _loader(self, config: Mapping[str, Any], split: str, epoch: int | None) -> Any:
        from torch.utils.data import DataLoader

        cfg = self.resolve(config)
        train = epoch is not None
        augment = bool(cfg["augment"]) and train
        seed = batch_order_seed(int(cfg.get("data_seed", 0)), epoch or 0) if augment else None
        workers = positive_int(cfg, "loader_workers", minimum=0)
        return DataLoader(
            DigitFiles(files_root() / split, seed),  # type: ignore[arg-type]  # map-style
            batch_size=positive_int(cfg, "batch_size"),
            shuffle=train,
            drop_last=train,
            generator=epoch_generator(cfg, epoch) if epoch is not None else None,
            num_workers=workers,
            persistent_workers=False,
        )

    def train_batches(self, config: Mapping[str, Any], epoch: int) -> Iterable[Any]:
        return self._loader(config, "train", epoch)

    def val_batches(self, config: Mapping[str, Any]) -> Iterable[Any]:
        return self._loader(config, "val", None)

    def train_size(self, config: Mapping[str, Any]) -> int:
        return N_TRAIN
