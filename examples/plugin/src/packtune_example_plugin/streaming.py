"""A second example: the rings streamed from files through a DataLoader, with a step of the
workload's own (dict batches, a model with two heads, a searched loss weight).

``rings-files`` writes its points once as one ``.npy`` file each (under the system's
temporary folder, or ``PACKTUNE_EXAMPLE_DATA``), reads them with a map-style dataset
(:mod:`packtune_example_plugin.data`, imported inside the methods: no torch at import) and
trains a trunk with two heads: which ring (cross-entropy) and the point's radius (mean
squared error, weighted by ``aux_weight``, which is searched and may differ inside a fused
array because the model carries it as a buffer).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from packtune import OPTIMIZER_PARAMS, Workload, epoch_generator

N_TRAIN, N_VAL = 2048, 512


@functools.cache
def ring_files() -> Path:
    """The folder of points, written once and atomically (workers may start at once)."""
    import numpy as np

    base = Path(os.environ.get("PACKTUNE_EXAMPLE_DATA") or tempfile.gettempdir())
    root = base / "packtune-example-rings-v1"
    if root.is_dir():
        return root
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".rings-", dir=base))
    rng = np.random.default_rng(1234)
    for split, n in (("train", N_TRAIN), ("val", N_VAL)):
        (tmp / split).mkdir()
        for i in range(n):
            label = int(rng.integers(2))
            angle, radius = 2 * np.pi * rng.random(), 1.0 + label + 0.25 * rng.normal()
            point = np.array([radius * np.cos(angle), radius * np.sin(angle)], np.float32)
            np.save(tmp / split / f"{i:05d}_{label}.npy", point)
    try:
        os.rename(tmp, root)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return root


class RingFiles(Workload):
    """Rings from files via a DataLoader; two heads (ring, radius) and a step of its own."""

    name = "rings-files"
    params: Mapping[str, Any] = {
        "hidden": 32, "aux_weight": 0.5, "batch_size": 64, **OPTIMIZER_PARAMS,
    }  # fmt: skip
    structural = frozenset({"hidden", "batch_size"})
    fusible = frozenset({"aux_weight"})  # carried by the model as a buffer
    reports = {"val_accuracy": "max", "val_radius_mse": "min"}
    bounds = {"hidden": (1, 4096), "aux_weight": (0.0, 100.0), "batch_size": (1, N_TRAIN)}

    def build_model(self, config: Mapping[str, Any]) -> Any:
        from packtune_example_plugin.data import TwoHeads

        cfg = self.resolve(config)
        return TwoHeads(int(cfg["hidden"]), float(cfg["aux_weight"]))

    def train_batches(self, config: Mapping[str, Any], epoch: int) -> Iterable[Any]:
        from torch.utils.data import DataLoader

        from packtune_example_plugin.data import RingPoints

        cfg = self.resolve(config)
        return DataLoader(
            RingPoints(ring_files() / "train"), batch_size=int(cfg["batch_size"]),
            shuffle=True, drop_last=True, generator=epoch_generator(cfg, epoch),
        )  # fmt: skip

    def val_batches(self, config: Mapping[str, Any]) -> Iterable[Any]:
        from torch.utils.data import DataLoader

        from packtune_example_plugin.data import RingPoints

        return DataLoader(RingPoints(ring_files() / "val"), batch_size=256)

    def training_loss(self, model: Callable[..., Any], batch: Any) -> Any:
        import torch.nn.functional as F

        logits, radius, weight = model(batch["point"])
        ring = F.cross_entropy(logits, batch["label"])
        return ring + weight * F.mse_loss(radius, batch["radius"])

    def validation_metrics(self, model: Callable[..., Any], batch: Any) -> dict[str, Any]:
        import torch.nn.functional as F

        logits, radius, _ = model(batch["point"])
        return {
            "val_loss": F.cross_entropy(logits, batch["label"]),
            "val_accuracy": (logits.argmax(-1) == batch["label"]).float().mean(),
            "val_radius_mse": F.mse_loss(radius, batch["radius"]),
        }

    def train_size(self, config: Mapping[str, Any]) -> int:
        return N_TRAIN
