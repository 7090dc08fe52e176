"""A teacher-student task with its sizes as parameters.

A fixed random *teacher* network (seeded by a constant, never by the trial
or study seed) labels Gaussian inputs; the student is an MLP trained to
match it. ``task="classification"`` takes the teacher's argmax as an int64
class label, ``task="regression"`` its raw outputs as float32 targets.

The teacher's architecture is fixed (two tanh layers of
:data:`TEACHER_HIDDEN` units): students of every ``hidden``/``layers`` learn
the same function. Every size parameter is structural, since it changes the
data or the shapes that an array's members share.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from packtune.workloads.base import OPTIMIZER_PARAMS, OPTIMIZER_STRUCTURAL, Split, Workload
from worker.workloads.parts import (
    ACTIVATIONS,
    activation,
    builds_own_model,
    classification_metrics,
    device_name,
    positive_int,
    stacked_cross_entropy,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

TASKS = ("classification", "regression")
TEACHER_SEED = 20_240_601
TEACHER_HIDDEN = 64


def _teacher(x: torch.Tensor, output_dim: int) -> torch.Tensor:
    """The fixed teacher's outputs for ``x``; its weights depend only on the two dims."""
    import torch

    gen = torch.Generator().manual_seed(TEACHER_SEED)
    dims = [x.shape[1], TEACHER_HIDDEN, TEACHER_HIDDEN, output_dim]
    h = x
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        hidden_layer = i < len(dims) - 2
        gain = 2.0 if hidden_layer else 1.0  # > 1 so the tanh layers are really non-linear
        weight = gain * torch.randn(d_in, d_out, generator=gen) / d_in**0.5
        h = h @ weight + 0.1 * torch.randn(d_out, generator=gen)
        if hidden_layer:
            h = torch.tanh(h)
    return h


@functools.lru_cache(maxsize=8)
def synthetic_splits(
    input_dim: int, output_dim: int, n_train: int, n_val: int, task: str, device: str
) -> tuple[Split, Split]:
    """Train and validation splits, generated once per process per sizes and device.

    Train and validation inputs come from separate fixed streams, so the
    validation set does not change with ``n_train``. Generation runs on the
    CPU with private generators: the global torch RNG is left alone.
    """
    import torch

    def split(stream: int, n: int) -> Split:
        gen = torch.Generator().manual_seed(TEACHER_SEED + stream)
        x = torch.randn(n, input_dim, generator=gen)
        out = _teacher(x, output_dim)
        y = out.argmax(dim=1) if task == "classification" else out
        return Split(x.to(device), y.to(device))

    return split(1, n_train), split(2, n_val)


class SyntheticMLP(Workload):
    """Student MLP on a seeded teacher-student task (sizes as parameters)."""

    name = "synthetic-mlp"
    #: val_accuracy for task="classification", val_r2 for task="regression"
    reports: Mapping[str, str] | None = {"val_accuracy": "max", "val_r2": "max"}
    params: Mapping[str, Any] = {
        "input_dim": 64,
        "hidden": 128,
        "layers": 2,
        "output_dim": 10,
        "n_train": 8192,
        "n_val": 1024,
        "task": "classification",
        "activation": "relu",
        "batch_size": 64,
        **OPTIMIZER_PARAMS,
    }
    structural = OPTIMIZER_STRUCTURAL | {
        "input_dim", "hidden", "layers", "output_dim", "n_train", "n_val", "task",
        "activation", "batch_size",
    }  # fmt: skip

    bounds: Mapping[str, tuple[float, float]] = {
        "input_dim": (1, 65_536), "hidden": (1, 65_536), "layers": (0, 64),
        "output_dim": (1, 65_536), "n_train": (1, 10_000_000), "n_val": (1, 10_000_000),
        "batch_size": (1, 10_000_000),
    }  # fmt: skip
    choices: Mapping[str, Sequence[Any]] = {"activation": ACTIVATIONS, "task": TASKS}

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        from torch import nn

        cfg = self.resolve(config)
        width = positive_int(cfg, "input_dim")
        hidden = positive_int(cfg, "hidden")
        modules: list[nn.Module] = []
        for _ in range(positive_int(cfg, "layers", minimum=0)):
            modules += [nn.Linear(width, hidden), activation(str(cfg["activation"]))]
            width = hidden
        modules.append(nn.Linear(width, positive_int(cfg, "output_dim")))
        return nn.Sequential(*modules)

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        cfg = self.resolve(config)
        task = str(cfg["task"])
        if task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, not {task!r}")
        return synthetic_splits(
            positive_int(cfg, "input_dim"),
            positive_int(cfg, "output_dim"),
            positive_int(cfg, "n_train"),
            positive_int(cfg, "n_val"),
            task,
            device_name(device),
        )

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy for int labels, mean squared error for float targets.

        The branch is on the dtype, which is fixed per workload config, so it is
        safe under ``vmap``.
        """
        import torch.nn.functional as F

        if targets.is_floating_point():
            return F.mse_loss(outputs, targets)
        return F.cross_entropy(outputs, targets)

    def stacked_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        if targets.is_floating_point():
            errors = F.mse_loss(outputs, targets.expand_as(outputs), reduction="none")
            return errors.flatten(1).mean(1)
        return stacked_cross_entropy(outputs, targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        import torch
        import torch.nn.functional as F

        if not targets.is_floating_point():
            return classification_metrics(outputs, targets)
        with torch.no_grad():
            mse = F.mse_loss(outputs.float(), targets)
            variance = targets.var(dim=0, unbiased=False).mean().clamp_min(1e-12)
        # R^2 against the per-output means (1: perfect, 0: predicting the means)
        return {"val_loss": float(mse), "val_r2": float(1.0 - mse / variance)}

    def train_size(self, config: Mapping[str, Any]) -> int:
        return positive_int(self.resolve(config), "n_train")

    def reports_for(self, config: Mapping[str, Any]) -> Mapping[str, str]:
        other = "val_r2" if self.class_targets(config) else "val_accuracy"
        return {name: better for name, better in (self.reports or {}).items() if name != other}

    def class_targets(self, config: Mapping[str, Any]) -> bool:
        return self.resolve(config)["task"] == "classification"

    def max_segments(self, config: Mapping[str, Any]) -> int | None:
        if not builds_own_model(self, SyntheticMLP):
            return None
        return int(self.resolve(config)["layers"]) + 1  # a Linear per hidden layer, the head
