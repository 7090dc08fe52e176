"""Workload registry: built-ins by name, user workloads from entry points.

User packages register workloads in the ``packtune.workloads`` entry-point
group; each entry point names a :class:`Workload` subclass or instance. The
built-ins (in ``worker.workloads``) are named the same way, by
:data:`BUILTINS`, so that this core package imports no training code: a
workload module imports torch only inside its methods, and is loaded only when
the registry is first asked. The API accepts only names found here: it never
runs code a client sends. Importing this module does not import torch.
"""

from __future__ import annotations

import functools
import logging
from importlib.metadata import EntryPoint, entry_points

from packtune.workloads.base import Workload

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "packtune.workloads"


#: The built-in workloads, as entry points of this package (name: ``module:Class``).
BUILTINS = tuple(
    EntryPoint(name, value, ENTRY_POINT_GROUP)
    for name, value in (
        ("digits-mlp", "worker.workloads.digits:DigitsMLP"),
        ("digits-cnn", "worker.workloads.digits:DigitsCNN"),
        ("digits-files", "worker.workloads.digits_files:DigitsFiles"),
        ("synthetic-mlp", "worker.workloads.synthetic:SyntheticMLP"),
        ("resnet-cifar", "worker.workloads.resnet:ResNetCifar"),
    )
)


def _builtins() -> list[Workload]:
    loaded = [ep.load() for ep in BUILTINS]
    return [obj() if isinstance(obj, type) else obj for obj in loaded]


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
        problem = workload.interface_problem()
        if problem is not None:
            log.warning("workload %s from entry point %s is ignored: %s", workload.name,
                        ep.name, problem)  # fmt: skip
            continue
        if workload.name in found:
            log.warning(
                "workload %s from entry point %s is registered already (a built-in or an "
                "earlier entry point); ignored",
                workload.name,
                ep.name,
            )
            continue
        found[workload.name] = workload
    return found


def get_workload(name: str) -> Workload:
    """The workload called ``name``; ``KeyError`` if none is registered."""
    try:
        return registry()[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {sorted(registry())}") from None
