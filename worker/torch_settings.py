"""Process-wide torch settings a ``build_model`` may change: the default dtype, the default
device (torch keeps its context per thread, and an array's thread is reused by later arrays;
the device it names is also kept in a module global of torch's), the float32
matmul precision, deterministic algorithms, TF32 and cuDNN's choices. (Not the CPU's
intra-op threads: ``torch.set_num_threads`` is partly per thread under OpenMP, and an array
is built in one thread and may step in another.)

A worker process has one of each, which every model in it computes under: a build that
sets one (``torch.set_default_dtype(torch.float64)`` for some configs) would leave it set
for the members built after it and for every array's steps. :class:`worker.fused.FusedArray`
reads them before and after each member's build (:func:`read`), starts each build from the
process's own (:func:`put`), and puts a member's own back around its steps and evaluations
only, as :mod:`worker.outside_state` does for module globals.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch


def _deterministic() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _default_device() -> torch.device | None:
    """The default device ``torch.set_default_device`` set (in this thread: torch keeps it
    per thread), or None where none is set or the CPU is (as a fresh process's: a build's
    ``torch.set_default_device("cpu")`` changes nothing to put back)."""
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    device = None if context is None else torch.device(context.device)
    return None if device is None or device.type == "cpu" else device


def _flag(owner: Any, attr: str) -> tuple[Any, Any]:
    """(read, write) of a flag of a torch backend module (``torch.backends.cudnn.benchmark``)."""
    return (lambda: getattr(owner, attr)), (lambda v: setattr(owner, attr, v))


#: name (as the note says it) -> (read, write)
_SETTINGS: dict[str, tuple[Any, Any]] = {
    "torch.set_default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "torch.set_float32_matmul_precision": (
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
    ),
    "torch.use_deterministic_algorithms": (
        _deterministic,
        lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
    ),
    "torch.set_default_device": (_default_device, torch.set_default_device),
    "torch.backends.cuda.matmul.allow_tf32": _flag(torch.backends.cuda.matmul, "allow_tf32"),
    "torch.backends.cudnn.allow_tf32": _flag(torch.backends.cudnn, "allow_tf32"),
    "torch.backends.cudnn.deterministic": _flag(torch.backends.cudnn, "deterministic"),
    "torch.backends.cudnn.benchmark": _flag(torch.backends.cudnn, "benchmark"),
}

Settings = dict[str, Any]


def read() -> Settings:
    """Every setting now."""
    return {name: get() for name, (get, _) in _SETTINGS.items()}


def put(values: Mapping[str, Any]) -> None:
    """Set the settings of ``values`` (those that differ from now)."""
    for name, value in values.items():
        get, set_ = _SETTINGS[name]
        if get() != value:
            set_(value)


def members_own(
    base: Settings, after: Mapping[Hashable, Settings]
) -> tuple[dict[Hashable, Settings], list[str], list[str]]:
    """From the process's settings ``base`` and each member's ``after`` its build: each
    member's own of the settings some build changed (empty: none changed), those settings,
    and those the members differ in (they train one at a time)."""
    changed = sorted({n for a in after.values() for n, v in a.items() if base.get(n) != v})
    if not changed:
        return {}, [], []
    own = {key: {n: a[n] for n in changed} for key, a in after.items()}
    apart = [n for n in changed if len({repr(a[n]) for a in after.values()}) > 1]
    return own, changed, apart
