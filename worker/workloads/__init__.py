"""Workload registry: built-ins by name, user workloads from entry points.

User packages register workloads in the ``packtune.workloads`` entry-point
group; each entry point names a :class:`Workload` subclass or instance. The
API accepts only names found here: it never runs code a client sends.
Importing this module does not import torch.
"""

from __future__ import annotations

import functools
import logging
from importlib.metadata import entry_points

from worker.workloads.base import Workload

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "packtune.workloads"


def _builtins() -> list[Workload]:
    from worker.workloads.digits import DigitsCNN, DigitsMLP
    from worker.workloads.resnet import ResNetCifar
    from worker.workloads.synthetic import SyntheticMLP

    return [DigitsMLP(), DigitsCNN(), SyntheticMLP(), ResNetCifar()]


@functools.cache
def registry() -> dict[str, Workload]:
    """Every known workload by name (built-ins first; a plugin cannot shadow one)."""
    found: dict[str, Workload] = {w.name: w for w in _builtins()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            workload = obj() if isinstance(obj, type) else obj
        except Exception as exc:  # a broken plugin must not take the service down
            log.warning("workload entry point %s failed to load: %s", ep.name, exc)
            continue
        if not isinstance(workload, Workload):
            log.warning("entry point %s is not a packtune Workload; ignored", ep.name)
            continue
        if workload.name in found:
            log.warning("workload %s from entry point %s shadows a built-in; ignored",
                        workload.name, ep.name)
            continue
        found[workload.name] = workload
    return found


def get_workload(name: str) -> Workload:
    """The workload called ``name``; ``KeyError`` if none is registered."""
    try:
        return registry()[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {sorted(registry())}") from None
