"""Tensors a model holds under more than one name: tied weights (an output layer sharing its
embedding's matrix), a buffer handed to several blocks, a module used twice in a Sequential.

``named_parameters()`` and ``named_buffers()`` list such a tensor once, under its first
name; ``state_dict()`` lists it under every name. A fused array stacks the tensors of the
first names (:func:`worker.fused._stack`), so

- its template keeps the ties (:func:`meta_template`): ``functional_call`` then uses a
  tied group's one stacked tensor for every name of it. ``Module.to("meta")`` alone gives
  each name a meta tensor of its own, which the forward would read as it stands (on a CPU,
  uninitialised memory, silently);
- a member's exported state names every one (:func:`with_aliases`), as the model's own
  ``state_dict()`` does, so that ``load_state_dict`` takes it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import TypeVar

from torch import Tensor, nn

T = TypeVar("T")


def aliases(model: nn.Module) -> dict[str, str]:
    """Each second (third...) name of a parameter or buffer -> its first name."""
    out: dict[str, str] = {}
    for named in (
        model.named_parameters(remove_duplicate=False),
        model.named_buffers(remove_duplicate=False),
    ):
        first: dict[int, str] = {}
        for name, tensor in named:
            canonical = first.setdefault(id(tensor), name)
            if canonical != name:
                out[name] = canonical
    return out


def reused_modules(model: nn.Module) -> bool:
    """Some module object is a child of the tree more than once (``nn.Sequential(a, act, b,
    act)``): ``named_children``/``named_modules`` list it once, while the forward calls it at
    each place."""
    seen: set[int] = set()
    for module in model.modules():
        for child in module._modules.values():
            if child is None:
                continue
            if id(child) in seen:
                return True
            seen.add(id(child))
    return False


def meta_template(
    model: nn.Module, copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy
) -> nn.Module:
    """A copy of ``model`` (by ``copy_model``) on the meta device (structure only), its ties
    kept."""
    template = copy_model(model)
    ties = aliases(template)
    template.to("meta")
    for alias, canonical in ties.items():
        _set(template, alias, template.get_parameter(canonical)
             if _is_parameter(template, canonical) else template.get_buffer(canonical))  # fmt: skip
    return template


def with_aliases(tensors: Mapping[str, T], ties: Mapping[str, str]) -> dict[str, T]:
    """``tensors`` (by first names) with every alias of one of them added, the same value."""
    out = dict(tensors)
    for alias, canonical in ties.items():
        if canonical in tensors and alias not in out:
            out[alias] = tensors[canonical]
    return out


def _is_parameter(model: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return attr in model.get_submodule(owner)._parameters


def _set(model: nn.Module, name: str, tensor: Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._parameters:
        module._parameters[attr] = tensor  # type: ignore[assignment]
    else:
        module._buffers[attr] = tensor
