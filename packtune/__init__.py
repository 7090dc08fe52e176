"""packtune: pack-aware hyperparameter tuning.

This package is the torch-free core that the API, the scheduler and the
workers share (Hyperband, packing, search spaces, the study spec, the workload
interface and registry, settings), and the public surface for users: the
names below are stable (``Client``, ``Study``, ``Trial`` and ``ApiError``, the REST
client of :mod:`packtune.client`, are imported when first used, so that importing
packtune costs no HTTP library). Everything under ``service`` and ``worker`` is
internal.
"""

from typing import Any

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
    "ApiError", "Client", "Study", "Trial",
]  # fmt: skip

_CLIENT = ("ApiError", "Client", "Study", "Trial")


def __getattr__(name: str) -> Any:
    if name in _CLIENT:
        from packtune import client

        return getattr(client, name)
    raise AttributeError(f"module 'packtune' has no attribute {name!r}")
