"""packtune: pack-aware hyperparameter tuning.

This package is the torch-free core that the API, the scheduler and the
workers share (Hyperband, packing, search spaces, the study spec, the workload
interface and registry, settings), and the public surface for users: the
names below are stable. Everything under ``service`` and ``worker`` is
internal.
"""

from packtune.workloads.base import (
    OPTIMIZER_HYPER,
    OPTIMIZER_PARAMS,
    PRECISIONS,
    Split,
    Workload,
    epoch_generator,
)

__all__ = [
    "OPTIMIZER_HYPER", "OPTIMIZER_PARAMS", "PRECISIONS", "Split", "Workload", "epoch_generator",
]  # fmt: skip
