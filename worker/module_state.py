"""Python attributes of a model's modules (a step counter a forward keeps on ``self``): read,
compared and carried over, apart from torch's own module bookkeeping, tensors and
submodules."""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

#: what every ``nn.Module`` keeps in its ``__dict__`` (parameters, buffers, hooks, ``training``)
_TORCH_OWN = frozenset(vars(nn.Module()))
_UNCOPIED = object()


def python_state(model: nn.Module) -> dict[str, Any]:
    """``module.attribute`` -> a copy of its value, for every module's own Python attributes
    (a value that cannot be copied is kept as itself: compared by identity)."""
    state: dict[str, Any] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, value in vars(module).items():
            if name in _TORCH_OWN or isinstance(value, (Tensor, nn.Module)):
                continue
            try:
                kept = copy.deepcopy(value)
            except Exception:  # noqa: BLE001 - a lock, a handle: compared as itself
                kept = value
            state[f"{prefix}.{name}" if prefix else name] = kept
    return state


def changed_state(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The names whose values differ between two :func:`python_state` readings."""
    return sorted(
        name
        for name in before.keys() | after.keys()
        if not _same(before.get(name, _UNCOPIED), after.get(name, _UNCOPIED))
    )


def copy_state(source: nn.Module, target: nn.Module, names: list[str]) -> None:
    """Set ``names`` (``module.attribute``) on ``target`` to their values on ``source``,
    both of one structure."""
    for full in names:
        prefix, _, name = full.rpartition(".")
        src, dst = source.get_submodule(prefix), target.get_submodule(prefix)
        if hasattr(src, name):
            value = getattr(src, name)
            try:
                value = copy.deepcopy(value)
            except Exception:  # noqa: BLE001 - not copyable: the value itself
                pass
            setattr(dst, name, value)
        elif hasattr(dst, name):
            delattr(dst, name)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an ambiguous comparison: say changed
        return False
